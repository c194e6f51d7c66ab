"""/dashboard rendered by headless Chromium with real traffic from two SmolLM2 engines behind it: the
funnel starts at the engines' own prefix cache, the store's tiers serve the rest, the charts draw the
server's samples, and the token lives for the browser session only.

Chromium comes from the Debian package; the fixture installs it when missing and running as root.
A screenshot is kept as a test artifact in artifacts/dashboard.png (gitignored).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import urllib.error
from pathlib import Path

import pytest
from kvstore.sdk.remote import RemoteBackend

from tests.connectors.engine_util import ENGINE, doc, free_port
from tests.connectors.test_engine_pd import Proc, http_json, metric, wait_saves_landed
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


def _run_chromium(chromium: str, profile: Path, url: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [chromium, *FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=5000",
         "--window-size=1400,1300", *extra, url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _attrs(tag: str) -> dict[str, str]:
    return dict(re.findall(r'([\w-]+)="([^"]*)"', tag))


def _stages(dom: str, box: str) -> dict[str, float]:
    """data-stage -> data-value of the rows in the funnel box `box` (funnel or reasons)."""
    part = dom.split(f'id="{box}"', 1)[1].split("</div></div>", 1)[0] if f'id="{box}"' in dom else ""
    rows = re.findall(
        r'<div class="row" data-stage="([\w-]+)" data-value="([\d.e+-]+)"><span>([^<]*)</span>', part
    )
    return {label: float(value) for _, value, label in rows}


def start_engine(port: int, store_url: str) -> Proc:
    args = ["serve", "--port", str(port), "--kv-backend", "kvstore", "--kv-store-url", store_url,
            "--max-model-len", str(ENGINE["max_model_len"]), "--kv-cache-memory", ENGINE["kv_cache_memory"],
            "--num-threads", "1"]  # fmt: skip
    proc = Proc(args)
    proc.drain()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"engine exited: {''.join(proc.tail)[-3000:]}")
        try:
            http_json(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    proc.stop()
    raise RuntimeError("engine did not start")


@pytest.mark.slow
def test_dashboard_tells_the_cache_story_with_real_engines(server_factory, chromium, tmp_path):
    ports = [free_port(), free_port()]
    srv = server_factory(
        store={"tiers": ["cpu", "disk"], "cpu_capacity": "64MiB"}, sample_interval=0.5,
        engine_metrics=[f"http://127.0.0.1:{p}" for p in ports],
    )  # fmt: skip
    engines = []
    try:
        for p in ports:
            engines.append(start_engine(p, srv.url))
        body = {"prompt": doc(600, 77), "max_tokens": 2, "temperature": 0, "ignore_eos": True}
        first, second = (f"http://127.0.0.1:{p}" for p in ports)
        http_json(first + "/v1/completions", body)  # cold: computed, its chunks saved
        cold_s = metric(first, "vllm:request_prefill_time_seconds_sum")  # the whole cold prefill
        http_json(first + "/v1/completions", body)  # the engine's own prefix cache
        wait_saves_landed(first)
        n = http_json(second + "/v1/completions", body)["usage"]["prompt_tokens"]  # another engine: the store
        http_json(second + "/v1/completions", {**body, "prompt": doc(300, 78)})  # new: a not_stored miss
        # the full 256-token chunks and the first run's partial chunk, up to the block before the last token
        stored = (n - 1) // 16 * 16
        assert stored > 512 and metric(second, "vllm:external_prefix_cache_hits_total") == stored
        time.sleep(1.5)  # a few samples that include all of it
        url = f"{srv.url}/dashboard"
        run = _run_chromium(chromium, tmp_path / "profile", url, "--dump-dom")
        assert run.returncode == 0, run.stderr[-2000:]
        dom = run.stdout
        assert re.search(r'<span id="status" class="">\d+ samples', dom), dom[:3000]
        funnel = _stages(dom, "funnel")
        assert set(funnel) == {"engine prefix cache", "store: cpu", "store: disk", "recomputed"}, funnel
        assert funnel["engine prefix cache"] >= 512 and funnel["store: cpu"] == stored, funnel
        assert funnel["store: disk"] == 0 and funnel["recomputed"] > 0
        hit_rate = float(re.search(r'id="kpi-hit-rate" data-value="([\d.]+)"', dom).group(1))
        prompt_tokens = sum(funnel.values())
        assert hit_rate == pytest.approx((funnel["engine prefix cache"] + stored) / prompt_tokens, rel=1e-6)
        assert re.search(r'id="kpi-seconds-saved"[^>]*>[\d.]+ (ms|s)<', dom), (
            "prefill time saved, with a unit"
        )
        # issue 30 #15: the estimate counted KV loading as compute (18.3 s of a 2.1 s cold prefill, 9x).
        # The store served one prompt, so the truth is about one cold prefill less its load; the cost per
        # token comes from other prefills (a cold 300-token one on the second engine, an engine-cache
        # hit's overhead), which on a loaded box run up to ~1.3x slower per token than this one (CI:
        # 0.53 s estimated against a 0.47 s cold prefill). 1.5x still fails the old 9x overcount.
        saved = float(re.search(r'id="kpi-seconds-saved" data-value="([\d.e+-]+)"', dom).group(1))
        assert 0 < saved < 1.5 * cold_s, (saved, cold_s)
        assert "per computed token, from" in dom
        assert _stages(dom, "reasons")["not stored"] >= 1
        charts = {_attrs(t)["id"]: _attrs(t) for t in re.findall(r"<svg [^>]*>", dom)}
        assert set(charts) == {f"chart-{n}" for n in ("hitrate", "latency", "bytes", "evictions", "requests")}
        assert all(int(c["data-points"]) >= 2 for c in charts.values()), charts
        series = {_attrs(t)["data-series"] for t in re.findall(r"<path [^>]*data-series=[^>]*>", dom)}
        assert {
            "prompt tokens not recomputed",
            "store reads",
            "cpu",
            "get (same host) p50",  # engines on this host read their chunks in the arena, in place
            "get (same host) p99",
            "put p99",
        } <= series
        assert re.search(r'id="kpi-get-p99"[^>]*>[\d.]+ (µs|ms|s)<', dom), (
            "get latency from the reported gets"
        )
        assert "0.0" not in re.findall(r'class="label"[^>]*>([^<]*)<', dom), "axes read in units, not 0.0"
        assert re.search(r"<tr><td>cpu</td><td>[1-9]", dom), "the tier table shows the stored chunks"
        ARTIFACTS.mkdir(exist_ok=True)
        shot = _run_chromium(
            chromium, tmp_path / "profile", url, f"--screenshot={ARTIFACTS / 'dashboard.png'}"
        )
        assert shot.returncode == 0 and (ARTIFACTS / "dashboard.png").stat().st_size > 20_000
    finally:
        for e in engines:
            e.stop()


@pytest.mark.slow
def test_token_lives_for_the_session_only(server_factory, chromium, tmp_path):
    srv = server_factory(auth_token=TOKEN, sample_interval=0.2)
    be = RemoteBackend(srv.url, token=TOKEN)
    for i in range(3):
        be.put_blob(key(i), make_blob(i))
        be.get_blob(key(100 + i))
        time.sleep(0.25)
    be.close()
    profile = tmp_path / "profile"
    run = _run_chromium(chromium, profile, f"{srv.url}/dashboard#token={TOKEN}", "--dump-dom")
    assert run.returncode == 0 and re.search(r'<span id="status" class="">\d+ samples', run.stdout)
    assert _stages(run.stdout, "reasons")["not stored"] == 3
    # the same browser profile, a new session: the token is gone (it was never in localStorage)
    again = _run_chromium(chromium, profile, f"{srv.url}/dashboard", "--dump-dom")
    assert "401: open /dashboard#token=YOUR_TOKEN" in again.stdout
    assert 'data-points="' not in again.stdout  # nothing drawn without data


@pytest.mark.slow
def test_the_headline_counts_lookups_cut_short(server_factory, chromium, tmp_path):
    """Issue 30 #15: with two gets that hit and every lookup missing, the page said 100%."""
    srv = server_factory(sample_interval=0.2)
    be = RemoteBackend(srv.url)
    be.put_blob(key(1), make_blob(1))
    be.get_blob(key(1))
    be.get_blob(key(1))
    for i in range(6):
        assert be.lookup([key(100 + i)])[0] == 0
    be.close()
    time.sleep(0.6)
    run = _run_chromium(chromium, tmp_path / "profile", f"{srv.url}/dashboard", "--dump-dom")
    assert run.returncode == 0 and re.search(r'<span id="status" class="">\d+ samples', run.stdout)
    rate = float(re.search(r'id="kpi-hit-rate" data-value="([\d.]+)"', run.stdout).group(1))
    assert rate == pytest.approx(2 / 8)
    assert _stages(run.stdout, "funnel")["lookups cut short"] == 6
    assert re.search(r'id="kpi-store-hit-rate">25%<', run.stdout)
