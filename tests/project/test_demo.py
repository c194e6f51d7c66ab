"""The demo (`make demo`, examples/demo.py): its store part runs and says what it showed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples.demo import store_round_trip

ROOT = Path(__file__).resolve().parents[2]


def test_demo_store_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store_round_trip(tmp_path)
    out = capsys.readouterr().out
    assert "read back bit-exact" in out and "lookup_prefix = 4/4" in out


def test_make_demo_runs_the_demo_script() -> None:
    """The Makefile's `demo` target runs examples/demo.py (make -n: printed, not run). Under `make test`
    this make is a sub-make: without the parent's MAKEFLAGS/MAKELEVEL it prints no "Entering directory"."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    out = subprocess.run(
        ["make", "--no-print-directory", "-n", "demo"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip().splitlines()[-1].endswith("python examples/demo.py")
    help_out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--store-only" in help_out
