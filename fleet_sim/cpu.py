"""Engines sharing one box's CPUs: processor sharing, as the OS time-slices runnable threads.

Each engine runs one step at a time, `work` seconds long at full speed. With `cores` CPUs and n engines
in a step, each step runs at min(1, cores / n) of full speed, re-divided whenever a step starts or ends,
so a step that began alone slows down when others begin (and speeds up when they end). `cores=None`:
every engine has a device of its own, full speed always.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore.fleet_sim.events import EventLoop


@dataclass
class _Run:
    total: float  # seconds of work at full speed
    left: float  # of which not yet done
    fn: Callable[..., None]
    args: tuple[Any, ...]
    token: int = 0  # the end event scheduled last; every other is stale


class SharedCPU:
    def __init__(self, loop: EventLoop, cores: float | None) -> None:
        assert cores is None or cores > 0, cores
        self.loop = loop
        self.cores = cores
        self.runs: dict[int, _Run] = {}  # engine -> its step in progress
        self._updated = 0.0  # when every run's `left` was last brought up to date
        self.work_s = 0.0  # full-speed seconds of every step so far (the CPU time the engines used)
        # end events ever scheduled: a token is never reused, not even by the engine's next step
        self._tokens = 0

    def rate(self) -> float:
        """The speed every step runs at now (1 = full)."""
        n = len(self.runs)
        return min(1.0, self.cores / n) if self.cores and n else 1.0

    def start(self, engine: int, work: float, fn: Callable[..., None], *args: Any) -> None:
        """`engine` begins a step of `work` seconds at full speed; `fn(*args)` runs when it is done."""
        assert engine not in self.runs, f"engine {engine} is already in a step"
        self._advance()
        before = self.rate()
        self.runs[engine] = _Run(work, work, fn, args)
        self.work_s += work
        self._reschedule(list(self.runs) if self.rate() != before else [engine])

    def done(self, engine: int) -> float:
        """Seconds of full-speed work `engine`'s step has done so far."""
        self._advance()
        run = self.runs[engine]
        return run.total - run.left

    def resize(self, engine: int, work: float, fn: Callable[..., None], *args: Any) -> None:
        """`engine`'s step now ends after `work` seconds of full-speed work in all (a decode run cut
        short at a step boundary), calling `fn(*args)` instead."""
        self._advance()
        run = self.runs[engine]
        run.left = max(work - (run.total - run.left), 0.0)
        self.work_s += work - run.total
        run.total, run.fn, run.args = work, fn, args
        self._reschedule([engine])

    def _advance(self) -> None:
        now = self.loop.now
        if now > self._updated:
            progress = (now - self._updated) * self.rate()
            for run in self.runs.values():
                run.left = max(run.left - progress, 0.0)
        self._updated = now

    def _reschedule(self, engines: list[int]) -> None:
        rate = self.rate()
        for engine in engines:
            run = self.runs[engine]
            self._tokens += 1
            run.token = self._tokens
            self.loop.at(self.loop.now + run.left / rate, self._end, engine, run.token)

    def _end(self, engine: int, token: int) -> None:
        run = self.runs.get(engine)
        if run is None or run.token != token:
            return  # rescheduled since
        self._advance()
        before = self.rate()
        del self.runs[engine]
        if self.rate() != before:
            self._reschedule(list(self.runs))
        run.fn(*run.args)
