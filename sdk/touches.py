"""Reporting the gets a client served itself through a server's arena index (kvstore.protocol.arena_table).

The server still counts every such get (top-tier hits, and kvstore_reported_gets apart from the
requests it measured) and refreshes its blobs' recency, from a one-way TOUCH. A send costs far more than its bytes: it wakes the server, which this kernel may
run on the sender's CPU at once (measured here: 40 µs to 1 ms per send, against ~0.2 ms for a whole
1 MiB get), and a thread that sends reports as they come costs as much again in handing the GIL back
and forth. So a get only appends its report, and the reports go out together: with a get once SEND_S
has passed since the oldest, or from a thread once the client has been quiet for TAIL_S. The server's
counts and LRU order lag by that much.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvstore.protocol import dataplane as dp
from kvstore.protocol.wire import MAX_BATCH_KEYS

SEND_S = 0.05
TAIL_S = 0.05
MAX_PENDING = 1024  # keys: sent at once past this


class TouchReporter:
    def __init__(self, send: Callable[[int, dict], None]) -> None:
        """`send(op, meta)`: a one-way message (sdk.dataplane.DataPlaneClient.tell)."""
        self._send = send
        self._keys: list[str] = []
        self._gets: list[list] = []  # [number of keys, seconds] per get
        self._since = 0.0  # when the oldest pending report came
        self._lock = threading.Lock()
        self._pending = threading.Event()  # set while reports wait (the thread watches them)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, keys: list[str], seconds: float) -> None:
        now = time.monotonic()
        with self._lock:
            if not self._keys:
                self._since = now
            self._keys.extend(keys)
            self._gets.append([len(keys), seconds])
            due = now - self._since >= SEND_S or len(self._keys) >= MAX_PENDING
            if not due and not self._pending.is_set() and not self._stop.is_set():
                if self._thread is None:
                    self._thread = threading.Thread(target=self._tail, name="kvstore-touches", daemon=True)
                    self._thread.start()
                self._pending.set()
        if due:
            self.flush()

    def _tail(self) -> None:
        while not self._stop.is_set():
            self._pending.wait()
            if self._stop.wait(TAIL_S):
                return
            with self._lock:
                quiet = bool(self._keys) and time.monotonic() - self._since >= TAIL_S
            if quiet:
                self.flush()
            with self._lock:  # cleared under the lock, so that `add` sets it again for new reports
                if not self._keys:
                    self._pending.clear()

    def flush(self) -> None:
        with self._lock:
            keys, gets, self._keys, self._gets = self._keys, self._gets, [], []
        while keys:  # split on get boundaries: a message names at most MAX_BATCH_KEYS keys
            n = i = 0
            while i < len(gets) and n + gets[i][0] <= MAX_BATCH_KEYS:
                n += gets[i][0]
                i += 1
            assert i > 0, "a get of more than MAX_BATCH_KEYS keys is never served from the index"
            self._send(dp.TOUCH, {"k": keys[:n], "g": gets[:i]})
            keys, gets = keys[n:], gets[i:]

    def close(self) -> None:
        """Send what is pending and stop the thread."""
        self._stop.set()
        self._pending.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self.flush()
