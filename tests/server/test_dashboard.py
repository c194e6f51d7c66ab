"""/dashboard rendered by headless Chromium: its charts draw the server's own samples.

Chromium comes from the Debian package; the fixture installs it when missing and running as root.
A screenshot is kept as a test artifact in artifacts/dashboard.png (gitignored).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from sdk.remote import RemoteBackend
from tests.server.conftest import key, make_blob

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
TOKEN = "dash-token"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip


@pytest.fixture(scope="session")
def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("chromium is not installed and this is not a root Debian box to install it on")
    run = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "chromium"],
                         capture_output=True, text=True, timeout=900,
                         env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))  # fmt: skip
    found = shutil.which("chromium")
    if run.returncode != 0 or not found:
        pytest.skip(f"apt-get install chromium failed: {run.stderr[-500:]}")
    return found


def _run_chromium(chromium: str, tmp_path: Path, url: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [chromium, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000",
         "--window-size=1280,900", *extra, url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _attrs(tag: str) -> dict[str, str]:
    return dict(re.findall(r'([\w-]+)="([^"]*)"', tag))


@pytest.mark.slow
def test_dashboard_draws_charts_with_data(server_factory, chromium, tmp_path):
    srv = server_factory(
        store={"tiers": ["cpu", "disk"], "cpu_capacity": "1MiB"}, auth_token=TOKEN, sample_interval=0.2
    )
    be = RemoteBackend(srv.url, token=TOKEN)
    for i in range(8):  # traffic across several samples: hits, misses, evictions to disk
        be.put_blob(key(i), make_blob(i, tokens=2048))
        be.get_blob(key(0))
        be.get_blob(key(10_000 + i))
        time.sleep(0.25)
    be.close()
    url = f"{srv.url}/dashboard#token={TOKEN}"
    run = _run_chromium(chromium, tmp_path, url, "--dump-dom")
    assert run.returncode == 0, run.stderr[-2000:]
    dom = run.stdout
    charts = {_attrs(t)["id"]: _attrs(t) for t in re.findall(r"<svg [^>]*>", dom)}
    assert set(charts) == {"chart-hitrate", "chart-bytes", "chart-requests"}, dom[:2000]
    for chart in charts.values():
        assert int(chart["data-points"]) >= 5, chart
    series = [_attrs(t) for t in re.findall(r"<path [^>]*data-series=[^>]*>", dom)]
    by_chart = {
        name: [s for s in series if s["data-series"] == name] for name in ("cpu", "disk", "requests/s")
    }
    assert len(by_chart["cpu"]) == 2 and len(by_chart["disk"]) == 2  # hit rate and bytes, per tier
    assert all(int(s["data-points"]) >= 5 for s in series if s["data-series"] in ("cpu", "requests/s"))
    assert all(len(s["d"].split("L")) == int(s["data-points"]) for s in series)  # one vertex per point
    assert re.search(r'<body[^>]*data-samples="(\d+)"', dom)
    assert re.search(r'<div id="status" class="">\d+ samples', dom), "the page reports an error"
    row = re.search(r"<tr><td>cpu</td><td>(\d+)</td>", dom)
    assert row and int(row.group(1)) >= 1  # the tier table shows the latest sample
    ARTIFACTS.mkdir(exist_ok=True)
    shot = _run_chromium(chromium, tmp_path, url, f"--screenshot={ARTIFACTS / 'dashboard.png'}")
    assert shot.returncode == 0 and (ARTIFACTS / "dashboard.png").stat().st_size > 10_000


@pytest.mark.slow
def test_dashboard_without_token_says_so(server_factory, chromium, tmp_path):
    srv = server_factory(auth_token=TOKEN)
    run = _run_chromium(chromium, tmp_path, f"{srv.url}/dashboard", "--dump-dom")
    assert run.returncode == 0
    assert "401: open /dashboard#token=YOUR_TOKEN" in run.stdout
    assert 'data-points="' not in run.stdout  # nothing drawn without data
