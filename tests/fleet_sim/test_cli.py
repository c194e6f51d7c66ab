"""kvstore-fleet-sim: JSON lines with the fields the issue names, a table, a plot page, the
capacity at 90% of the unbounded hit rate, clear errors; the pyproject script points at it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from kvstore.fleet_sim import cli, report

ROOT = Path(__file__).resolve().parents[2]
FIELDS = ("engines", "policy", "hit_rate", "ttft_p50_s", "ttft_p90_s", "bytes_moved_per_request")


def test_json_lines_one_per_configuration(traces, tmp_path, capsys) -> None:
    plot = tmp_path / "p.html"
    argv = ["--trace", str(traces[0]), "--limit", "300", "--engines", "2,4", "--policy", "round_robin,ttft",
            "--store-gib", "0,inf", "--json", "--plot", str(plot)]  # fmt: skip
    assert cli.main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 8
    assert [(r["engines"], r["policy"], r["store_gib"]) for r in rows[:4]] == [
        (2, "round_robin", 0), (2, "round_robin", "inf"), (2, "ttft", 0), (2, "ttft", "inf")]  # fmt: skip
    for r in rows:
        assert all(k in r for k in FIELDS)
        assert 0 <= r["hit_rate"] <= 1 and 0 < r["ttft_p50_s"] <= r["ttft_p90_s"]
        assert (r["bytes_moved_per_request"] == 0) == (r["store_gib"] == 0)
    on = [r for r in rows if r["store_gib"] == "inf"]
    off = [r for r in rows if r["store_gib"] == 0]
    assert all(a["hit_rate"] > b["hit_rate"] for a, b in zip(on, off, strict=True))
    page = plot.read_text()
    assert page.startswith("<!doctype html>") and page.count("<svg") >= 5 and "hit rate" in page


def test_table_and_the_capacity_at_90_percent(traces, tmp_path, capsys) -> None:
    argv = ["--trace", str(traces[0]), "--limit", "300", "--engines", "4", "--store-gib", "0,8,64,inf",
            "--profile", "llama3-8b-h100", "--plot", str(tmp_path / "p.html")]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "hit %" in out and "TTFT p90 s" in out and " off " in out
    assert "90% of the unbounded hit rate" in out


def test_capacity_for_interpolates_between_swept_points() -> None:
    rows = [{"engines": 4, "policy": "ttft", "store_gib": g, "hit_rate": h}
            for g, h in ((0, 0.1), (10, 0.2), (20, 0.4), (math.inf, 0.4))]  # fmt: skip
    [(engines, policy, gib, unbounded)] = report.capacity_for(rows)
    assert (engines, policy, unbounded) == (4, "ttft", 0.4)
    assert gib == pytest.approx(10 + 10 * (0.36 - 0.2) / (0.4 - 0.2))


def test_a_bad_trace_is_a_clear_error(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\nnope\n')
    assert cli.main(["--trace", str(bad), "--no-plot"]) == 2
    assert f"{bad}:2: not JSON" in capsys.readouterr().err
    assert cli.main(["--trace", str(bad), "--profile", "nope", "--no-plot"]) == 2
    assert "no profile 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--policy", "fastest"])


def test_the_module_runs_and_the_script_entry_points_at_it() -> None:
    out = subprocess.run([sys.executable, "-m", "kvstore.fleet_sim", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0 and "--store-gib" in out.stdout
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kvstore-fleet-sim"] == "kvstore.fleet_sim.cli:main"
