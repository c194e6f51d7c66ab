"""Every benchmark run leaves a record of what produced its figures (issue 35 item 8): the command,
the commit, the date and the machine, written by `benchmarks/provenance.py` around each benchmark's
`main()`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
NOT_BENCHMARKS = {
    "fleet.py",
    "fleet_netns.py",
    "hostile_clients.py",
    "provenance.py",
}  # a launcher, 3 libraries


def _run(tmp_path: Path, body: str, *args: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    script = BENCH / f"_provenance_probe_{os.getpid()}.py"  # beside the benchmarks, as they run
    script.write_text(
        f'def main():\n{body}\n\nif __name__ == "__main__":\n    from provenance import recorded\n\n'
        "    recorded(main)\n"
    )
    try:
        env = {**os.environ, "KVSTORE_BENCH_RUNS": str(tmp_path)}
        proc = subprocess.run(
            [sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=60
        )
    finally:
        script.unlink()
    return proc, [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*.json"))]


def test_a_run_is_recorded_with_commit_machine_date_and_command(tmp_path: Path) -> None:
    proc, records = _run(tmp_path, "    print('ratio 1.23x')\n    return {'ratio': 1.23}", "--rounds", "3")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "ratio 1.23x\n"  # what it prints still reaches the terminal
    [rec] = records
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert rec["commit"] == head.stdout.strip() and isinstance(rec["dirty"], bool)
    assert rec["command"].endswith("--rounds 3") and "_provenance_probe_" in rec["command"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", rec["date"])
    assert rec["machine"]["cores"] == os.cpu_count() and rec["machine"]["cpu"]
    assert rec["printed"] == "ratio 1.23x\n" and rec["results"] == {"ratio": 1.23} and rec["status"] == 0
    assert rec["benchmark"].startswith("_provenance_probe_")


def test_a_failed_run_is_recorded_with_its_status(tmp_path: Path) -> None:
    proc, records = _run(tmp_path, "    print('half')\n    raise SystemExit(3)")
    assert proc.returncode == 3
    [rec] = records
    assert rec["status"] == 3 and rec["printed"] == "half\n"
    proc, records = _run(tmp_path, "    return 2")  # a main() that returns its exit status
    assert proc.returncode == 2 and sorted(r["status"] for r in records) == [2, 3]


def test_help_is_not_a_run(tmp_path: Path) -> None:
    proc, records = _run(tmp_path, "    print('usage')", "--help")
    assert proc.returncode == 0 and records == []


def test_every_benchmark_records_its_runs() -> None:
    scripts = [p for p in BENCH.glob("*.py") if p.name not in NOT_BENCHMARKS]
    scripts += [ROOT / "fleet_sim" / n for n in ("__main__.py", "cli.py", "validate.py", "calibrate.py")]
    assert len(scripts) >= 18
    missing = [p.name for p in scripts if not re.search(r"^\s*recorded\(main\b", p.read_text(), re.M)]
    assert not missing, f"benchmarks whose runs leave no record: {missing}"
