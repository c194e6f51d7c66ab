"""The one clock a store and its tiers read (docs/design.md §4).

Everything in a `TieredStore` that expires or waits out a time asks the clock the store was given:
the tiers' TTLs (cpu, gpu: `monotonic`; disk, fs: `time`, since their expiry times and ages are
stored in files), the fs tier's eviction by age, the miss log (expired or evicted?) and the circuit
breakers. `SYSTEM` is the real one. `ManualClock` only moves when told to, so a test steps it past a
TTL, a backoff or an age instead of sleeping; threads that wait for work (a replayer, a sweeper)
still wait in real time, and tests wait on the condition they cause, not on a duration.
"""

from __future__ import annotations

import threading
import time


class Clock:
    """The system clock: `monotonic` for durations inside this process, `time` (seconds since the
    epoch) for times other processes or a restart read back (a file name, an mtime)."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    def time_ns(self) -> int:
        return time.time_ns()


SYSTEM = Clock()


class ManualClock(Clock):
    """A clock that moves only by `advance` (thread-safe). Its wall time starts at the real time it was
    made (or `wall`), so the times it writes into files look like times; both readings move together."""

    def __init__(self, wall: float | None = None, monotonic: float = 1000.0) -> None:
        self._lock = threading.Lock()
        self._wall_ns = int((time.time() if wall is None else wall) * 1e9)
        self._mono_ns = int(monotonic * 1e9)
        self._offset_ns = 0

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock does not go back, got {seconds}")
        with self._lock:
            self._offset_ns += round(seconds * 1e9)

    def monotonic(self) -> float:
        return (self._mono_ns + self._offset_ns) / 1e9

    def time(self) -> float:
        return self.time_ns() / 1e9

    def time_ns(self) -> int:
        return self._wall_ns + self._offset_ns
