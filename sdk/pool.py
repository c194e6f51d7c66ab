"""Idle keep-alive connections to one server, shared by the SDK's HTTP and data-plane clients."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar


class _Closable(Protocol):
    def close(self) -> None: ...


C = TypeVar("C", bound=_Closable)


class ConnectionPool(Generic[C]):
    """At most `size` idle connections, thread-safe; `take` opens a new one when none is idle. The pool
    holds no reference to its client (the opener is passed per call), so a client nobody closed is
    freed, and its sockets closed, as soon as it is dropped."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._idle: list[C] = []
        self._lock = threading.Lock()
        self.closed = False

    def __len__(self) -> int:
        """Connections idle in the pool now."""
        return len(self._idle)

    def take(self, open_connection: Callable[[], C]) -> C:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return open_connection()

    def release(self, conn: C) -> None:
        """Back into the pool, or closed when the pool is full or closed."""
        with self._lock:
            if not self.closed and len(self._idle) < self.size:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self.closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
