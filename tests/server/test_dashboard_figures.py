"""The dashboard's headline figures (server/static/dashboard_figures.js), run in node on samples of
a real server (the same file the page runs; the page itself: tests/server/test_dashboard.py).

Issue 30 #15: the store read rate said 100% while every lookup missed (a lookup cut short by a
missing key was counted nowhere), and "prefill time saved (est.)" read 18.3 s where the whole cold
prefill took 2.1 s (the cost per token came from prefills that also loaded KV)."""

from __future__ import annotations

import json
import shutil
import subprocess
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
    blob = make_blob(1, key=key(1))
    be.put_blob(key(1), blob)
    assert bytes(be.get_blob(key(1))) == blob and bytes(be.get_blob(key(1))) == blob
    for i in range(10):  # an engine asking for prefixes the store never had: each stops at its first key
        assert be.lookup([key(100 + i), key(200 + i)]) == (0, "not_stored")
    assert be.lookup([key(1)]) == (1, None)  # a whole one: not a miss
    be.close()
    text = urllib.request.urlopen(srv.url + "/metrics").read().decode()
    assert 'kvstore_prefix_lookups_total{result="cut_short"} 10.0' in text
    assert 'kvstore_prefix_lookups_total{result="whole"} 1.0' in text

    def history() -> list[dict]:
        return json.load(urllib.request.urlopen(srv.url + "/v1/stats/history"))["samples"]

    wait_for(lambda: history()[-1]["lookups_cut_short"] == 10 and history()[-1]["lookups"] == 11, timeout=10)
    samples = history()
    assert samples[-1]["lookups"] == 11 and samples[-1]["misses"] == 0  # no get missed
    reads = figures("f.storeReads(samples)", samples=samples)
    assert (reads["hits"], reads["misses"], reads["cutShort"]) == (2, 0, 10)
    assert reads["rate"] == pytest.approx(2 / 12)  # was hits / (hits + misses): 100%
    page = urllib.request.urlopen(srv.url + "/dashboard").read().decode()
    assert "function storeReads(samples)" in page and 'src="dashboard_figures.js"' not in page


def _engine(
    prompt: float = 0,
    engine_hits: float = 0,
    store_hits: float = 0,
    seconds: float = 0.0,
    prefills: int = 0,
    prefill_prompt: float | None = None,
    computed: float | None = None,
    running: int = 0,
    waiting: int = 0,
) -> dict:
    """One engine's fields in a sample (server/engine_scrape.py): the token counters grow when a request
    is admitted, the prefill_* ones when its prefill is over; computed None: an engine without them."""
    e = {"prompt_tokens": prompt, "engine_hit_tokens": engine_hits, "store_hit_tokens": store_hits,
         "prefill_seconds": seconds, "prefills": prefills, "running": running, "waiting": waiting}  # fmt: skip
    if computed is not None:
        e["prefill_prompt_tokens"], e["prefill_computed_tokens"] = prefill_prompt, computed
    return e


def _sample(t: float, **by_url: dict) -> dict:
    """A sample holding each engine's fields and their sum, as the server's sampler keeps them."""
    total: dict[str, float] = {}
    for e in by_url.values():
        for k, v in e.items():
            total[k] = total.get(k, 0) + v
    return {"t": t, "tiers": {}, "misses": 0, "engines": {**total, "by_url": by_url}}


def test_prefill_time_saved_pairs_each_prefills_seconds_with_its_own_tokens():
    """Issue 43, the samples of two real vLLM processes (server every 0.5 s): vLLM counts a request's
    prompt tokens when it is admitted and its prefill time when it finishes, a sample or more later.
    A cold 2,915-token prefill took 1.96 s on engine a; engine b loaded 2,816 tokens from the store and
    computed 99 in 0.22 s. Pairing each step's seconds with the same step's tokens found no cold step
    here (and where another request's tokens fell into the step, 22.4 ms a token: 2.2 min saved)."""
    cold = _engine(2915, prefills=1, seconds=1.959, prefill_prompt=2915, computed=2915)
    samples = [
        _sample(0.0, a=_engine(prefill_prompt=0, computed=0), b=_engine(prefill_prompt=0, computed=0)),
        _sample(0.5, a=_engine(2915, prefill_prompt=0, computed=0, running=1), b=_engine(prefill_prompt=0, computed=0)),
        _sample(1.0, a=_engine(2915, prefill_prompt=0, computed=0, running=1), b=_engine(prefill_prompt=0, computed=0)),
        _sample(1.5, a=cold, b=_engine(prefill_prompt=0, computed=0)),
        _sample(4.0, a=cold, b=_engine(2915, store_hits=2816, prefill_prompt=0, computed=0, running=1)),
        _sample(4.5, a=cold, b=_engine(2915, store_hits=2816, prefills=1, seconds=0.222, prefill_prompt=2915,
                                       computed=99)),
    ]  # fmt: skip
    saved = figures("f.prefillSaved(win, all)", win=samples, all=samples)
    assert saved["perToken"] == pytest.approx(1.959 / 2915) and saved["coldPrefills"] == 1
    assert saved["loadSeconds"] == pytest.approx(0.222 - 99 * 1.959 / 2915)
    assert saved["seconds"] == pytest.approx(1.959 - 0.222)  # the cold prefill less the one the store served
    served_cold = 1.959 * 2816 / 2915  # what computing the store's tokens cost the cold prefill
    assert served_cold / 1.5 < saved["seconds"] < 1.5 * served_cold
    # the sum of the engines alone (an older server's samples): the same pairing, one engine
    summed = [{**s, "engines": {k: v for k, v in s["engines"].items() if k != "by_url"}} for s in samples]
    assert figures("f.prefillSaved(win, all)", win=summed, all=summed)["seconds"] == pytest.approx(
        saved["seconds"]
    )


def test_a_prefill_the_store_served_is_not_a_cold_one_until_its_engine_is_idle():
    """kvstore-engine, issue 30's numbers: a cold 600-token prefill took 2.1 s on engine a; engine b
    loaded 592 tokens from the store, and its prefill (0.35 s, 8 computed tokens) is over a step after
    the store's tokens were counted, in the same step as a cold 300-token prefill (1.05 s). That step is
    no cold one (the old estimate: 25.9 s); the next, after b was idle, is."""
    a = _engine(600, prefills=1, seconds=2.1, prefill_prompt=600, computed=600)
    b1 = _engine(600, store_hits=592, prefill_prompt=0, computed=0, running=1, waiting=1)
    b2 = _engine(900, store_hits=592, prefills=2, seconds=1.4, prefill_prompt=900, computed=308, running=0)
    b3 = _engine(1400, 100, 592, prefills=3, seconds=2.8, prefill_prompt=1400, computed=708)
    samples = [_sample(0, a=_engine(prefill_prompt=0, computed=0), b=_engine(prefill_prompt=0, computed=0)),
               _sample(5, a=a, b=_engine(prefill_prompt=0, computed=0)), _sample(10, a=a, b=b1),
               _sample(15, a=a, b=b2), _sample(20, a=a, b=b3)]  # fmt: skip
    saved = figures("f.prefillSaved(win, all)", win=samples, all=samples)
    per_token = (2.1 + 1.4) / (600 + 400)  # a's cold prefill and b's 500-token one with 100 from its cache
    assert saved["perToken"] == pytest.approx(per_token) and saved["coldPrefills"] == 2
    assert saved["loadSeconds"] == pytest.approx(1.4 - 308 * per_token)
    assert saved["seconds"] == pytest.approx(592 * per_token - (1.4 - 308 * per_token))  # 1.75 s
    assert 2.1 * 592 / 600 / 1.5 < saved["seconds"] < 1.5 * 2.1 * 592 / 600
    # a window holding only the prefill the store served: the cost per token still comes from all kept
    warm = figures("f.prefillSaved(win, all)", win=samples[1:4], all=samples)
    assert warm["seconds"] == pytest.approx(saved["seconds"]) and warm["storeTokens"] == 592
    # no prefill the store served nothing to: the cost of a computed token is unknown, not guessed
    blind = figures("f.prefillSaved(win, all)", win=samples[1:4], all=samples[1:4])
    assert blind["perToken"] == "NaN" and blind["storeTokens"] == 592
    # engines that do not report their prefills' computed tokens: unknown too
    strip = ("prefill_prompt_tokens", "prefill_computed_tokens")
    old = [_sample(s["t"], **{u: {k: v for k, v in e.items() if k not in strip} for u, e in s["engines"]["by_url"].items()})
           for s in samples]  # fmt: skip
    assert figures("f.prefillSaved(win, all)", win=old, all=old)["perToken"] == "NaN"


def test_the_stores_tokens_split_over_tiers_in_whole_tokens():
    assert figures("f.splitWhole(2816, w)", w=[10, 1]) == [2560, 256]
    assert figures("f.splitWhole(5, w)", w=[1, 1, 1]) == [2, 2, 1]
    assert figures("f.splitWhole(7, w)", w=[0, 0]) == [7, 0]
