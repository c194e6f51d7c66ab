"""Triton kernels tested on the CPU: a test module's cases run under TRITON_INTERPRET=1 in a fresh
interpreter (the choice to interpret is made when triton.language is first imported, which other test
modules have done already), which prints one JSON line per case for the module's fixture to read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def interpreted_rows(module: str, *args: str, timeout: float = 240) -> list[dict]:
    """`python -m module *args` under TRITON_INTERPRET=1: the JSON lines it printed."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def interpreted_errors(module: str) -> dict[str, str]:
    """Each case of `module` (run by `report`) -> its traceback, or "" where it passed."""
    return {r["case"]: r["error"] for r in interpreted_rows(module)}


def report(cases: dict[str, Callable[[], None]]) -> None:
    """The subprocess's side: each case run on the CPU, one JSON line each (the error, or "")."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    for name, case in cases.items():
        try:
            case()
            error = ""
        except Exception:  # reported to the parent test, which fails on it
            error = traceback.format_exc()
        print(json.dumps({"case": name, "error": error}), flush=True)
