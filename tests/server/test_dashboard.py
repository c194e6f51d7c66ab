"""/dashboard rendered by headless Chromium with real traffic behind it, from two kvstore-engines and
from two vLLM processes: the funnel starts at the engines' own prefix cache and shows their counters,
the store's tiers serve the rest, the prefill time saved is checked against the cold prefill measured
here, the charts draw the server's samples, and the token lives for the browser session only.

Chromium is Debian's package, which `make test` installs (the Makefile's `chromium` step); the fixture
only finds it: missing, the tests fail under CI=true and skip elsewhere, saying how to install it.
A screenshot is kept as a test artifact in artifacts/dashboard.png (gitignored).
"""

from __future__ import annotations

import logging
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
from tests.connectors.vllm.vllm_util import VllmServer, requires_vllm, start_all, transfer_config
from tests.server.conftest import key, make_blob, wait_for

log = logging.getLogger(__name__)
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
TOKEN = "dash-token"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's chromium, put there by `make test` (its `chromium` step); never installed from here."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    why = ("chromium is not installed, so the dashboard's DOM tests cannot run: `make chromium` installs "
           "Debian's package as root (apt-get install -y --no-install-recommends chromium)")  # fmt: skip
    if in_ci():
        pytest.fail(f"{why} (CI=true: the set-up must have done it)", pytrace=False)
    pytest.skip(why)


def _run_chromium(chromium: str, profile: Path, url: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [chromium, *FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=5000",
         "--window-size=1400,1300", *extra, url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _attrs(tag: str) -> dict[str, str]:
    return dict(re.findall(r'([\w-]+)="([^"]*)"', tag))


def _box(dom: str, box: str) -> str:
    return dom.split(f'id="{box}"', 1)[1].split("</div></div>", 1)[0] if f'id="{box}"' in dom else ""


def _stages(dom: str, box: str) -> dict[str, float]:
    """label -> data-value of the rows in the funnel box `box` (funnel or reasons)."""
    rows = re.findall(
        r'<div class="row" data-stage="([\w-]+)" data-value="([\d.e+-]+)"><span>([^<]*)</span>',
        _box(dom, box),
    )
    return {label: float(value) for _, value, label in rows}


def _shown(dom: str, box: str) -> dict[str, str]:
    """label -> the count a row shows (its text before the share), e.g. '2,816 tok'."""
    rows = re.findall(r"<span>([^<]*)</span><div [^>]*></div><span class=\"num\">([^<]*) · ", _box(dom, box))
    return dict(rows)


def _saved(dom: str) -> float:
    """The page's prefill time saved by the store (its data-value, seconds)."""
    return float(re.search(r'id="kpi-seconds-saved" data-value="([\d.e+-]+)"', dom).group(1))


def _history(srv, token: str | None = None) -> list[dict]:  # noqa: ANN001 (tests.server.conftest.Server)
    headers = {"Authorization": f"Bearer {token}"} if token else None
    return srv.request("GET", "/v1/stats/history", headers=headers).json()["samples"]


def _wait_sampled(srv, prefills: int) -> None:
    """Until the server's samples hold `prefills` finished prefills with every engine idle, and one more."""

    def engines() -> dict:
        return (srv.request("GET", "/v1/stats/history").json()["samples"][-1:] or [{}])[0].get(
            "engines"
        ) or {}

    def done() -> bool:
        e = engines()
        return e.get("prefills") == prefills and e.get("running") == e.get("waiting") == 0

    wait_for(done, timeout=60)
    t = srv.request("GET", "/v1/stats/history").json()["samples"][-1]["t"]
    wait_for(lambda: srv.request("GET", "/v1/stats/history").json()["samples"][-1]["t"] > t, timeout=30)


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
        cold_s = metric(first, "vllm:request_prefill_time_seconds_sum")  # the whole cold prefill, measured
        http_json(first + "/v1/completions", body)  # the engine's own prefix cache
        wait_saves_landed(first)
        n = http_json(second + "/v1/completions", body)["usage"]["prompt_tokens"]  # another engine: the store
        http_json(second + "/v1/completions", {**body, "prompt": doc(300, 78)})  # new: a not_stored miss
        # the full 256-token chunks and the first run's partial chunk, up to the block before the last token
        stored = (n - 1) // 16 * 16
        assert stored > 512 and metric(second, "vllm:external_prefix_cache_hits_total") == stored
        _wait_sampled(srv, prefills=4)  # samples that include all of it
        url = f"{srv.url}/dashboard"
        run = _run_chromium(chromium, tmp_path / "profile", url, "--dump-dom")
        assert run.returncode == 0, run.stderr[-2000:]
        dom = run.stdout
        assert re.search(r'<span id="status" class="">\d+ samples', dom), dom[:3000]
        funnel = _stages(dom, "funnel")
        assert set(funnel) == {"engine prefix cache", "store: cpu", "store: disk", "recomputed"}, funnel
        assert funnel["engine prefix cache"] >= 512 and funnel["store: cpu"] == stored, funnel
        assert funnel["store: disk"] == 0 and funnel["recomputed"] > 0
        assert _shown(dom, "funnel")["store: cpu"] == f"{stored:,} tok"  # the engines' count, not rounded

        def total(name: str) -> int:
            return int(sum(metric(u, name) for u in (first, second)))

        assert funnel["engine prefix cache"] == total("vllm:prefix_cache_hits_total")
        assert funnel["recomputed"] == total("vllm:request_prefill_kv_computed_tokens_sum")
        hit_rate = float(re.search(r'id="kpi-hit-rate" data-value="([\d.]+)"', dom).group(1))
        prompt_tokens = sum(funnel.values())
        assert hit_rate == pytest.approx((funnel["engine prefix cache"] + stored) / prompt_tokens, rel=1e-6)
        assert re.search(r'id="kpi-seconds-saved"[^>]*>[\d.]+ (ms|s)<', dom), (
            "prefill time saved, with a unit"
        )
        # issue 30 #15 (KV loading counted as compute: 9x) and issue 43 (one request's prefill seconds
        # over another's tokens: 30x with vLLM; failed a loaded box's make test): within 1.5x of what
        # computing the tokens the store served cost the cold prefill measured above
        served_cold_s = cold_s * stored / n
        saved = _saved(dom)
        log.info("kvstore-engine: %.3f s saved, %.3f s the cold prefill of the store's %d tokens (%.2fx)",
                 saved, served_cold_s, stored, saved / served_cold_s)  # fmt: skip
        assert served_cold_s / 1.5 < saved < 1.5 * served_cold_s, (saved, served_cold_s)
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


VLLM_BLOCK = 128  # vLLM's CPU block: a store hit is every whole block before the last prompt token


@pytest.mark.slow
@requires_vllm
@pytest.mark.timeout(900)
def test_two_vllm_processes_cold_then_a_store_hit(server_factory, chromium, tmp_path):
    """Issue 43: after one cold 2,915-token prefill (~4 s) and one store hit the page said '2.2 min'
    saved (22.4 ms per computed token where the cold prefill cost ~1.4), and its funnel read 2,820
    store tokens where vLLM counted 2,816."""
    from kvstore.engine.convert import ensure_smollm2  # noqa: PLC0415

    ports = [free_port(), free_port()]
    srv = server_factory(
        store={"tiers": ["cpu", "disk"], "cpu_capacity": "256MiB"}, sample_interval=0.5,
        engine_metrics=[f"http://127.0.0.1:{p}" for p in ports],
    )  # fmt: skip
    model = ensure_smollm2()
    servers = [
        VllmServer(model, p, transfer_config(srv.url, "kv_both"), tmp_path / f"vllm{i}.log", core=i)
        for i, p in enumerate(ports)
    ]
    start_all(servers)
    try:
        cold, warm = servers
        prompt = doc(2915, 79)
        assert cold.complete(prompt, max_tokens=2)["cached"] == 0
        cold_s = cold.metric("vllm:request_prefill_time_seconds_sum")  # the cold prefill, measured
        hit = warm.complete(prompt, max_tokens=2)  # another process: the store's tokens
        served = (len(prompt) - 1) // VLLM_BLOCK * VLLM_BLOCK
        assert hit["cached"] == served == warm.metric("vllm:external_prefix_cache_hits_total") == 2816
        _wait_sampled(srv, prefills=2)

        def total(name: str) -> int:
            return int(sum(s.metric(name) for s in servers))

        run = _run_chromium(chromium, tmp_path / "profile", f"{srv.url}/dashboard", "--dump-dom")
        assert run.returncode == 0, run.stderr[-2000:]
        dom = run.stdout
        funnel, shown = _stages(dom, "funnel"), _shown(dom, "funnel")
        # the funnel is vLLM's own counters: its prefix cache, the connector's hits, what it computed
        prompt_tokens, local = total("vllm:prefix_cache_queries_total"), total("vllm:prefix_cache_hits_total")
        computed = total("vllm:request_prefill_kv_computed_tokens_sum")
        assert (prompt_tokens, local, computed) == (2 * 2915, 0, 2915 + 2915 - served)
        assert funnel == {"engine prefix cache": local, "store: cpu": served, "store: disk": 0,
                          "recomputed": computed}  # fmt: skip
        assert shown == {"engine prefix cache": "0 tok", "store: cpu": "2,816 tok", "store: disk": "0 tok",
                         "recomputed": "3,014 tok"}  # fmt: skip
        # saved: within 1.5x of what computing the store's tokens cost the cold prefill measured here
        served_cold_s = cold_s * served / len(prompt)
        saved = _saved(dom)
        log.info("vLLM: %.3f s saved, %.3f s the cold prefill of the store's %d tokens (%.2fx; cold %.3f s)",
                 saved, served_cold_s, served, saved / served_cold_s, cold_s)  # fmt: skip
        assert served_cold_s / 1.5 < saved < 1.5 * served_cold_s, (saved, served_cold_s, cold_s)
        assert re.search(r'id="kpi-seconds-saved"[^>]*>[\d.]+ (ms|s)<', dom)
        assert "from 1 prefill the store served nothing to, times its 2,816 tokens" in dom
    finally:
        for s in servers:
            s.stop()


@pytest.mark.slow
def test_token_lives_for_the_session_only(server_factory, chromium, tmp_path):
    srv = server_factory(auth_token=TOKEN, sample_interval=0.2)
    be = RemoteBackend(srv.url, token=TOKEN)
    for i in range(3):
        be.put_blob(key(i), make_blob(i))
        be.get_blob(key(100 + i))
        n = len(_history(srv, TOKEN))
        wait_for(lambda n=n: len(_history(srv, TOKEN)) > n)  # each round in a sample of its own
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
    wait_for(lambda: (_history(srv)[-1:] or [{}])[0].get("lookups_cut_short") == 6)  # sampled
    run = _run_chromium(chromium, tmp_path / "profile", f"{srv.url}/dashboard", "--dump-dom")
    assert run.returncode == 0 and re.search(r'<span id="status" class="">\d+ samples', run.stdout)
    rate = float(re.search(r'id="kpi-hit-rate" data-value="([\d.]+)"', run.stdout).group(1))
    assert rate == pytest.approx(2 / 8)
    assert _stages(run.stdout, "funnel")["lookups cut short"] == 6
    assert re.search(r'id="kpi-store-hit-rate">25%<', run.stdout)
