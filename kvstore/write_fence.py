"""Orders the copies a read makes (promotion into upper tiers, admission into lower ones) after the
writes of the same key.

A read that found v1 in a lower tier copies it upward later; a put of v2 (or a delete) acknowledged in
between must win, or the upper tier serves v1 after v2 was acknowledged. So: a read takes `now()`
before it looks; a write runs inside `writing(keys)`; a copy runs inside `copying(keys, since)`,
which says which keys may be copied (no write of them in progress or ended since the read began)
and makes writes of those keys wait until the copy is done. Writes never wait on each other here,
and a copy never waits at all.

Memory is bounded: the end of the last `capacity` written keys is remembered; for any other key the
latest forgotten end stands in, which only ever refuses a copy, never allows a stale one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


class WriteFence:
    def __init__(self, capacity: int = 1 << 16) -> None:
        assert capacity > 0
        self._cond = threading.Condition()
        self._seq = 0  # bumped when a write ends
        self._writing: dict[str, int] = {}  # key -> writes in progress
        self._copying: dict[str, int] = {}  # key -> copies in progress
        self._ended: OrderedDict[str, int] = OrderedDict()  # key -> seq its last write ended at
        self._floor = 0  # the latest end forgotten from _ended
        self._capacity = capacity

    def now(self) -> int:
        with self._cond:
            return self._seq

    @contextmanager
    def writing(self, keys: Sequence[str]) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not any(k in self._copying for k in keys))
            for k in keys:
                self._writing[k] = self._writing.get(k, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                self._seq += 1
                for k in keys:
                    n = self._writing.pop(k) - 1
                    if n:
                        self._writing[k] = n
                    self._ended[k] = self._seq
                    self._ended.move_to_end(k)
                while len(self._ended) > self._capacity:
                    _, end = self._ended.popitem(last=False)
                    self._floor = max(self._floor, end)

    @contextmanager
    def copying(self, keys: Sequence[str], since: int) -> Iterator[list[bool]]:
        """Yield, per key, whether a read that began at `since` may copy what it found."""
        with self._cond:
            ok = [k not in self._writing and self._ended.get(k, self._floor) <= since for k in keys]
            held = [k for k, good in zip(keys, ok, strict=True) if good]
            for k in held:
                self._copying[k] = self._copying.get(k, 0) + 1
        try:
            yield ok
        finally:
            with self._cond:
                for k in held:
                    n = self._copying.pop(k) - 1
                    if n:
                        self._copying[k] = n
                self._cond.notify_all()
