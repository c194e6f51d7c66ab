"""`kvstore-engine router` over tiny in-process engines publishing KV events (seconds, not minutes):
a prompt's follow-up goes to the engine that holds it (ttft and prefix), round_robin rotates, the
share cap spreads a popular prefix, a request may pick its policy, metrics, state and the dashboard tell
what happened."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from kvstore.engine.router.app import ENGINE_HEADER, POLICY_HEADER, build_router_app
from kvstore.engine.router.router import RouterConfig
from kvstore.engine.router.tokens import PromptTokens
from kvstore.engine.server import build_app as engine_app
from prometheus_client.parser import text_string_to_metric_families

from tests.connectors.test_proxy import serving
from tests.router.fleet import events_config
from tests.waiting import wait_until_async

FIGURES = Path(__file__).resolve().parents[2] / "engine" / "router" / "static" / "dashboard.js"
PANEL_FIELDS = {"in_flight", "waiting_tokens", "up", "decisions", "share", "tokens", "capped",
                "predicted_ttft_p50_s", "actual_ttft_p50_s", "ttft_samples"}  # fmt: skip


async def _fleet(stack: AsyncExitStack, tiny, **kw) -> tuple[TestClient, list[str]]:
    model, engines = tiny
    urls = [await stack.enter_async_context(serving(engine_app(e))) for e, _ in engines]
    config = RouterConfig(urls, [c["endpoint"] for _, c in engines], [c["replay_endpoint"] for _, c in engines],
                          calibrate_s=0, **kw)  # fmt: skip
    app = build_router_app(config, PromptTokens(model, chunk_size=16))
    client = await stack.enter_async_context(TestClient(TestServer(app)))

    async def healthy() -> bool:
        return (await client.get("/health")).status == 200

    with contextlib.suppress(AssertionError):  # as before: the tests that need it healthy say so
        await wait_until_async(healthy, timeout=10, interval=0.05)
    return client, urls


async def _complete(
    client: TestClient, prompt: list[int], policy: str | None = None, stream: bool = False
) -> str:
    headers = {POLICY_HEADER: policy} if policy else {}
    body = {"prompt": prompt, "max_tokens": 2, "stream": stream}
    r = await client.post("/v1/completions", json=body, headers=headers)
    assert r.status == 200, await r.text()
    await r.read()
    return r.headers[ENGINE_HEADER]


async def _indexed_blocks(client: TestClient) -> dict[str, int]:
    return (await (await client.get("/v1/router/state")).json())["index"]["engines"]


async def _indexed(client: TestClient, engine: str, blocks: int, before: dict[str, int]) -> None:
    """Wait until the router indexed `blocks` more blocks of `engine` than it held `before` (an engine
    chosen twice already holds the first prompt's blocks: a bare count would not wait at all)."""

    async def indexed() -> bool:
        return (await _indexed_blocks(client)).get(engine, 0) >= before.get(engine, 0) + blocks

    await wait_until_async(indexed, timeout=10, what=f"the router seeing {blocks} new blocks of {engine}")


async def test_follow_ups_go_where_their_prefix_is(tiny) -> None:
    async with AsyncExitStack() as stack:
        client, urls = await _fleet(stack, tiny)
        for k, policy in enumerate(("ttft", "prefix")):
            a = [3 + (i * (k + 7)) % 300 for i in range(120)]  # 7 full blocks
            before = await _indexed_blocks(client)
            first = await _complete(client, a, policy)
            await _indexed(client, first, 7, before)
            assert {await _complete(client, a + [5, 6, 7] * j, policy) for j in range(1, 4)} == {first}
        served = [await _complete(client, [9, 9, 9], "round_robin") for _ in range(3)]
        assert sorted(served) == sorted(urls), "round_robin rotates"
        r = await client.post(
            "/v1/completions", json={"prompt": [1], "max_tokens": 1}, headers={POLICY_HEADER: "x"}
        )
        assert r.status == 400 and POLICY_HEADER in (await r.json())["error"]["message"]
        text = await (await client.get("/metrics")).text()
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
        decided: dict[str, float] = {}
        for s in samples:
            if s.name == "kvstore_router_decisions_total":
                decided[s.labels["policy"]] = decided.get(s.labels["policy"], 0) + s.value
        assert decided["ttft"] == 4 and decided["round_robin"] == 3
        local = sum(
            s.value
            for s in samples
            if s.name == "kvstore_router_prompt_tokens_total" and s.labels["source"] == "local"
        )
        assert local >= 2 * 3 * 112, "each follow-up reused its 7 blocks"


async def test_the_share_cap_spreads_a_popular_prefix(tiny) -> None:
    async with AsyncExitStack() as stack:
        client, urls = await _fleet(stack, tiny, max_share=1.2)
        popular = [11 + (i * 5) % 290 for i in range(100)]
        before = await _indexed_blocks(client)
        first = await _complete(client, popular)
        await _indexed(client, first, 6, before)
        served = [await _complete(client, popular + [j + 1]) for j in range(12)]
        counts = sorted(served.count(u) for u in urls)
        assert counts[-1] <= 1.2 * 13 / 3 + 1 and counts[0] > 0, counts
        # a prefix only one engine holds (every engine holds `popular` by now, and ties are drawn)
        other = [17 + (i * 13) % 280 for i in range(100)]
        before = await _indexed_blocks(client)
        holder = await _complete(client, other, "prefix")
        await _indexed(client, holder, 6, before)
        prefix = [await _complete(client, other + [j + 1], "prefix") for j in range(6)]
        assert set(prefix) == {holder}, "prefix sends every request to the holder (the hot spot)"
        capped = {s.labels["engine"]: s.value for s in await _samples(client, "kvstore_router_capped_total")}
        assert capped.get(first, 0) > 0, capped
        state = await (await client.get("/v1/router/state")).json()
        assert {u: e["capped"] for u, e in state["engines"].items() if e["capped"]} == capped


async def test_an_engine_that_refuses_connections_is_passed_over(tiny, tmp_path) -> None:
    from tests.connectors.engine_util import free_port

    model, engines = tiny
    async with AsyncExitStack() as stack:
        up = await stack.enter_async_context(serving(engine_app(engines[0][0])))
        dead = f"http://127.0.0.1:{free_port()}"
        cfg = events_config(tmp_path, "dead")
        config = RouterConfig([dead, up], [cfg["endpoint"], engines[0][1]["endpoint"]],
                              [cfg["replay_endpoint"], engines[0][1]["replay_endpoint"]], policy="round_robin",
                              calibrate_s=0)  # fmt: skip
        client = await stack.enter_async_context(
            TestClient(TestServer(build_router_app(config, PromptTokens(model))))
        )
        assert {await _complete(client, [7, 8, 9]) for _ in range(4)} == {up}
        state = await (await client.get("/v1/router/state")).json()
        assert state["engines"][dead]["down_until"] > 0 and state["engines"][dead]["in_flight"] == 0
        assert (state["engines"][dead]["up"], state["engines"][up]["up"]) == (False, True)
        up_metric = {s.labels["engine"]: s.value for s in await _samples(client, "kvstore_router_engine_up")}
        assert up_metric == {dead: 0, up: 1}


async def _samples(client: TestClient, name: str) -> list:
    text = await (await client.get("/metrics")).text()
    return [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


async def _routed(client: TestClient) -> tuple[dict[tuple[str, str], int], dict[str, int], int]:
    """Five requests, three ttft and two streamed round_robin: ({(policy, engine): decisions},
    {engine: streamed}, prompt tokens)."""
    decided: dict[tuple[str, str], int] = {}
    streamed: dict[str, int] = {}
    tokens = 0
    for j, (policy, stream) in enumerate([("ttft", False)] * 3 + [("round_robin", True)] * 2):
        prompt = [5 + (i * (j + 3)) % 280 for i in range(20 + 10 * j)]
        engine = await _complete(client, prompt, policy, stream)
        decided[policy, engine] = decided.get((policy, engine), 0) + 1
        if stream:
            streamed[engine] = streamed.get(engine, 0) + 1
        tokens += len(prompt)
    return decided, streamed, tokens


async def test_metrics_have_their_labels_after_routed_requests(tiny) -> None:
    async with AsyncExitStack() as stack:
        client, urls = await _fleet(stack, tiny)
        decided, streamed, tokens = await _routed(client)
        got = {(s.labels["policy"], s.labels["engine"]): s.value
               for s in await _samples(client, "kvstore_router_decisions_total")}  # fmt: skip
        assert got == decided
        split = await _samples(client, "kvstore_router_prompt_tokens_total")
        assert {s.labels["source"] for s in split} == {"local", "remote", "miss"}
        assert {(s.labels["policy"], s.labels["engine"]) for s in split} == set(decided)
        assert sum(s.value for s in split) == tokens, "every prompt token is local, remote or a miss"
        predicted = {
            s.labels["engine"]: s.value
            for s in await _samples(client, "kvstore_router_predicted_ttft_seconds_count")
        }
        assert predicted == {u: sum(n for (_, e), n in decided.items() if e == u) for u in predicted}
        assert sum(predicted.values()) == 5
        for name in ("kvstore_router_actual_ttft_seconds_count", "kvstore_router_ttft_error_seconds_count"):
            assert {s.labels["engine"]: s.value for s in await _samples(client, name)} == streamed, name
        for name, value in (("kvstore_router_engine_in_flight", 0), ("kvstore_router_engine_waiting_tokens", 0),
                            ("kvstore_router_engine_up", 1)):  # fmt: skip
            assert {s.labels["engine"]: s.value for s in await _samples(client, name)} == dict.fromkeys(
                urls, value
            )
        policy = {s.labels["policy"]: s.value for s in await _samples(client, "kvstore_router_policy")}
        assert policy == {"round_robin": 0, "least_loaded": 0, "prefix": 0, "ttft": 1}


async def test_the_dashboard_polls_a_json_state_with_a_panel_per_engine(tiny) -> None:
    async with AsyncExitStack() as stack:
        client, urls = await _fleet(stack, tiny)
        decided, streamed, tokens = await _routed(client)
        r = await client.get("/dashboard")
        assert r.status == 200 and r.content_type == "text/html"
        page = await r.text()
        assert 'src="dashboard.js"' not in page and "function enginePanels(state)" in page, "figures inline"
        assert "fetch(STATE_URL)" in page
        endpoint = re.search(r'const STATE_URL = "([^"]+)"', page).group(1)
        r = await client.get(endpoint)
        assert r.status == 200 and r.content_type == "application/json"
        state = await r.json()
        assert state["policy"] == "ttft" and set(state["engines"]) == set(urls)
        for url, e in state["engines"].items():
            assert PANEL_FIELDS <= set(e), url
            n = sum(n for (_, u), n in decided.items() if u == url)
            assert e["decisions"] == {p: k for (p, u), k in decided.items() if u == url}
            assert e["share"] == n / 5 and set(e["tokens"]) == {"local", "remote", "miss"}
            assert (e["predicted_ttft_p50_s"] is not None) == (n > 0)
            assert e["ttft_samples"] == streamed.get(url, 0)
            assert (e["actual_ttft_p50_s"] is not None) == (url in streamed)
            assert (e["in_flight"], e["waiting_tokens"], e["up"]) == (0, 0, True)
        assert sum(sum(e["tokens"].values()) for e in state["engines"].values()) == tokens
        if shutil.which("node") is None:
            pytest.skip("node is not installed: the page's figures are not run")
        script = (f"const f = require({json.dumps(str(FIGURES))});"
                  "const s = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
                  "const p = f.enginePanels(s); process.stdout.write(JSON.stringify({p, t: f.fleetTotals(p)}));")  # fmt: skip
        run = subprocess.run(
            ["node", "-e", script], input=json.dumps(state), capture_output=True, text=True, timeout=30
        )
        assert run.returncode == 0, run.stderr
        out = json.loads(run.stdout)
        panels = {p["url"]: p for p in out["p"]}
        assert set(panels) == set(urls) and out["t"]["decisions"] == 5 and out["t"]["tokens"] == tokens
        assert out["t"]["local"] + out["t"]["remote"] + out["t"]["miss"] == pytest.approx(1)
        for url, p in panels.items():
            e = state["engines"][url]
            assert (p["inFlight"], p["waitingTokens"], p["share"]) == (0, 0, e["share"])
            if p["tokens"]:
                assert p["local"] + p["remote"] + p["miss"] == pytest.approx(1)
                assert p["miss"] == pytest.approx(e["tokens"]["miss"] / sum(e["tokens"].values()))
        shown = _render(page, state)
        assert shown["policy"] == "ttft" and shown["kpi-decisions"] == "5"
        for url in urls:
            assert f'data-engine="{url}"' in shown["engines"], "a panel per engine"
        assert shown["engines"].count('data-field="in_flight">0<') == 3


def _render(page: str, state: dict) -> dict[str, str]:
    """The page's scripts run in node with `fetch` answering `state` and a stub document: each
    element's text or HTML by id."""
    scripts = "\n".join(re.findall(r"<script>(.*?)</script>", page, re.S))
    harness = (
        "const els = {}; global.document = {getElementById: id => (els[id] = els[id] || {textContent: '', innerHTML: ''})};"
        "global.setTimeout = () => {}; const state = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
        "global.fetch = async () => ({ok: true, json: async () => state});"
        f"eval({json.dumps(scripts)});"
        "setImmediate(() => process.stdout.write(JSON.stringify(Object.fromEntries("
        "Object.entries(els).map(([k, e]) => [k, e.innerHTML || e.textContent])))));"
    )
    run = subprocess.run(
        ["node", "-e", harness], input=json.dumps(state), capture_output=True, text=True, timeout=30
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)
