"""The dashboard's headline figures (server/static/dashboard_figures.js), run in node on samples of
a real server (the same file the page runs; the page itself: tests/server/test_dashboard.py).

Issue 30 #15: the store read rate said 100% while every lookup missed (a lookup cut short by a
missing key was counted nowhere), and "prefill time saved (est.)" read 18.3 s where the whole cold
prefill took 2.1 s (the cost per token came from prefills that also loaded KV)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from kvstore.sdk.remote import RemoteBackend

from tests.server.conftest import key, make_blob, wait_for

FIGURES = Path(__file__).resolve().parents[2] / "server" / "static" / "dashboard_figures.js"
NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")


def figures(call: str, **data: Any) -> Any:
    """`call` (a JS expression over the names in `data`) evaluated in node with the figures loaded."""
    script = (
        f"const f = require({json.dumps(str(FIGURES))});"
        "const d = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
        f"const {{{', '.join(data)}}} = d;"
        f"process.stdout.write(JSON.stringify((({', '.join(data)}) => {call})({', '.join(data)}), "
        "(k, v) => Number.isNaN(v) ? 'NaN' : v));"
    )
    run = subprocess.run(
        [NODE, "-e", script], input=json.dumps(data), capture_output=True, text=True, timeout=30
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


@pytest.mark.parametrize("transport", ["http", "tcp"])
def test_lookups_cut_short_count_as_misses_in_the_store_read_rate(server_factory, transport):
    srv = server_factory(sample_interval=0.1)
    be = RemoteBackend(srv.url, transport=transport)
    be.put_blob(key(1), make_blob(1))
    assert bytes(be.get_blob(key(1))) == make_blob(1) and bytes(be.get_blob(key(1))) == make_blob(1)
    for i in range(10):  # an engine asking for prefixes the store never had: each stops at its first key
        assert be.lookup([key(100 + i), key(200 + i)]) == (0, "not_stored")
    assert be.lookup([key(1)]) == (1, None)  # a whole one: not a miss
    be.close()
    text = urllib.request.urlopen(srv.url + "/metrics").read().decode()
    assert 'kvstore_prefix_lookups_total{result="cut_short"} 10.0' in text
    assert 'kvstore_prefix_lookups_total{result="whole"} 1.0' in text

    def history() -> list[dict]:
        return json.load(urllib.request.urlopen(srv.url + "/v1/stats/history"))["samples"]

    wait_for(lambda: history()[-1]["lookups_cut_short"] == 10, timeout=10)
    time.sleep(0.15)
    samples = history()
    assert samples[-1]["lookups"] == 11 and samples[-1]["misses"] == 0  # no get missed
    reads = figures("f.storeReads(samples)", samples=samples)
    assert (reads["hits"], reads["misses"], reads["cutShort"]) == (2, 0, 10)
    assert reads["rate"] == pytest.approx(2 / 12)  # was hits / (hits + misses): 100%
    page = urllib.request.urlopen(srv.url + "/dashboard").read().decode()
    assert "function storeReads(samples)" in page and 'src="dashboard_figures.js"' not in page


def _engines(
    t: float, prompt: float, engine_hits: float, store_hits: float, seconds: float, prefills: int
) -> dict:
    return {"t": t, "tiers": {}, "misses": 0, "engines": {
        "prompt_tokens": prompt, "engine_hit_tokens": engine_hits, "store_hit_tokens": store_hits,
        "prefill_seconds": seconds, "prefills": prefills}}  # fmt: skip


def test_prefill_time_saved_counts_compute_only():
    """The issue's engines: a cold 600-token prefill took 2.1 s; the same prompt on another engine
    took 0.35 s with 592 tokens from the store (its KV load and request overhead included) and 8
    computed. Saved: what 600 cold tokens cost (2.1 s) less the 0.35 s spent, 1.75 s. In a window
    holding that prefill, the old estimate (592 tokens x 0.35 s / 8 computed tokens) said 25.9 s."""
    samples = [
        _engines(0, 0, 0, 0, 0.0, 0),
        _engines(5, 600, 0, 0, 2.1, 1),  # cold: computed, saved to the store
        _engines(10, 1200, 592, 0, 2.13, 2),  # the engine's own prefix cache: no store token
        _engines(15, 1800, 592, 592, 2.48, 3),  # another engine: the store's 592 tokens
    ]
    saved = figures("f.prefillSaved(win, all)", win=samples, all=samples)
    assert saved["perToken"] == pytest.approx(2.13 / (1200 - 592))  # cold steps: seconds per computed token
    computed = 1800 - 592 - 592
    assert saved["seconds"] == pytest.approx((computed + 592) * 2.13 / 608 - 2.48)
    assert 1.5 < saved["seconds"] < 2.1  # never more than the whole cold prefill
    # a window holding only the warm prefill: the cost per token still comes from the cold ones kept
    warm = figures("f.prefillSaved(win, all)", win=samples[2:], all=samples)
    assert warm["seconds"] == pytest.approx(600 * 2.13 / 608 - 0.35) and warm["coldPrefills"] == 2
    # no prefill the store served nothing to: the cost of a computed token is unknown, not guessed
    blind = figures("f.prefillSaved(win, all)", win=samples[2:], all=samples[2:])
    assert blind["perToken"] == "NaN" and blind["storeTokens"] == 592
