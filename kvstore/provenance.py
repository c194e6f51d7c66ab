"""Where a benchmark figure came from: each benchmark run leaves one JSON record of it.

`recorded(main)` runs a benchmark's `main()` (one of benchmarks/, through benchmarks/provenance.py, or
one of the fleet simulator's commands), echoing what it prints, and then writes
`~/.cache/kvstore/bench/runs/<benchmark>-<UTC time>-<commit>-<pid>.json` (or under `$KVSTORE_BENCH_RUNS`):
the command, the commit (and whether the tree differed from it), the UTC date, the machine (CPU
model, cores, the CPU features the kernels select on, memory, GPU), the exit status, everything the
run printed, and the value `main()` returned. The README's benchmark rows name the machine; the
record is what ties a row to a commit and a command.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]  # the checkout (kvstore/ is at its top): its commit
FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def runs_dir() -> Path:
    return Path(os.environ.get("KVSTORE_BENCH_RUNS", Path.home() / ".cache" / "kvstore" / "bench" / "runs"))


def machine() -> dict[str, Any]:
    """The CPU, its cores and features, memory and GPUs of this host (Linux /proc; blanks elsewhere)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name":
                model = value.strip()
            elif name.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    mem_gib = None
    try:
        kib = next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal:"))
        mem_gib = round(int(kib.split()[1]) / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "features": [f for f in FEATURES if f in flags],
        "memory_gib": mem_gib,
        "gpus": _gpus(),
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
    }


def _gpus() -> list[str]:
    # The driver's own list: no torch import (a benchmark of the store alone should not pay for it).
    root = Path("/proc/driver/nvidia/gpus")
    names = []
    for info in sorted(root.glob("*/information")) if root.is_dir() else []:
        for line in info.read_text().splitlines():
            if line.startswith("Model:"):
                names.append(line.split(":", 1)[1].strip())
    return names


def commit() -> dict[str, Any]:
    """HEAD of the checkout the benchmark ran from, and whether tracked files differed from it."""

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"commit": None, "dirty": None}
        return {"commit": head.stdout.strip(), "dirty": git("diff", "--quiet", "HEAD").returncode != 0}
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}


class _Tee(io.TextIOBase):
    def __init__(self, out: Any) -> None:
        self.out, self.seen = out, io.StringIO()

    def write(self, s: str) -> int:
        self.seen.write(s)
        return self.out.write(s)

    def flush(self) -> None:
        self.out.flush()

    def isatty(self) -> bool:
        return self.out.isatty()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self.out.encoding


def record(
    benchmark: str, *, results: Any = None, printed: str = "", status: int = 0, started: dt.datetime
) -> Path:
    """Writes the run's record and returns its path."""
    where = commit()
    rec = {
        "benchmark": benchmark,
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "date": started.isoformat(timespec="seconds"),
        "seconds": round((dt.datetime.now(dt.timezone.utc) - started).total_seconds(), 1),
        **where,
        "machine": machine(),
        "status": status,
        "results": results,
        "printed": printed,
    }
    out = runs_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = (
        out / f"{benchmark}-{started:%Y%m%dT%H%M%SZ}-{(where['commit'] or 'nogit')[:10]}-{os.getpid()}.json"
    )
    path.write_text(json.dumps(rec, indent=1, default=str))
    return path


def recorded(main: Callable[[], Any], benchmark: str | None = None) -> None:
    """Runs `main()` (a benchmark's entry point), records the run, exits with its status."""
    name = benchmark or Path(sys.argv[0]).stem
    started = dt.datetime.now(dt.timezone.utc)
    tee, real = _Tee(sys.stdout), sys.stdout
    sys.stdout = tee
    status, results = 1, None
    try:
        results = main()
        status = results if isinstance(results, int) else 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.stdout = real
        if not {"-h", "--help"} & set(sys.argv[1:]):
            kept = None if isinstance(results, int) else results
            path = record(name, results=kept, printed=tee.seen.getvalue(), status=status, started=started)
            print(f"run recorded in {path}", file=sys.stderr)
    sys.exit(status)
