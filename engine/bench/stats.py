"""Figures for benchmarks on a busy machine: percentiles, medians with their spread, CPU-seconds."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil


def percentiles(values: list[float], ps: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    """`{"mean": .., "p50": .., ...}` of `values` (seconds), empty input gives NaNs."""
    if not values:
        return {"mean": float("nan"), **{f"p{p}": float("nan") for p in ps}}
    arr = np.asarray(values, dtype=np.float64)
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in ps}}


def format_ms(name: str, values: list[float]) -> str:
    s = percentiles(values)
    if not values:
        return f"{name:<26} n/a"
    return (f"{name:<26} mean {s['mean'] * 1e3:8.1f} ms   p50 {s['p50'] * 1e3:8.1f}   "
            f"p90 {s['p90'] * 1e3:8.1f}   p99 {s['p99'] * 1e3:8.1f}")  # fmt: skip


@dataclass(frozen=True)
class Spread:
    """The median of per-round values and their min..max."""

    median: float
    lo: float
    hi: float

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        assert values, "no rounds"
        return cls(float(np.median(values)), float(min(values)), float(max(values)))

    def __str__(self) -> str:
        return f"{self.median:.2f} ({self.lo:.2f}-{self.hi:.2f})"


def cpu_seconds(pid: int | None = None, children: bool = False) -> float:
    """User + system CPU time of a process (default: this one), with `children` also of all its live
    descendants (vLLM's EngineCore and workers are children of the process that called `LLM()`)."""
    proc = psutil.Process(pid or os.getpid())
    total = 0.0
    for p in [proc, *(proc.children(recursive=True) if children else [])]:
        try:
            t = p.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        total += t.user + t.system
    return total


class Timer:
    """Wall and CPU seconds of a block: `with Timer() as t: ...; t.wall, t.cpu` (see `cpu_seconds`)."""

    def __init__(self, children: bool = False) -> None:
        self.children = children
        self.wall = self.cpu = 0.0

    def __enter__(self) -> Timer:
        self._cpu0 = cpu_seconds(children=self.children)
        self._wall0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._wall0
        self.cpu = cpu_seconds(children=self.children) - self._cpu0


def write_json(path: str | Path | None, result: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
