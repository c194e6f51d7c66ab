"""`kvstore-engine router` over tiny in-process engines publishing KV events (seconds, not minutes):
a prompt's follow-up goes to the engine that holds it (ttft and prefix), round_robin rotates, the
share cap spreads a popular prefix, a request may pick its policy, metrics and state tell what happened."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from engine.engine_args import EngineArgs
from engine.llm_engine import LLMEngine
from engine.router.app import ENGINE_HEADER, POLICY_HEADER, RouterConfig, build_router_app
from engine.router.tokens import PromptTokens
from engine.server import build_app as engine_app
from tests.connectors.test_proxy import serving
from tests.engine.conftest import make_tiny_engine_dir
from tests.router.fleet import events_config


@pytest.fixture
def tiny(tmp_path_factory):
    """Engines of this test's own: the engine server's cleanup shuts its engine down (events too)."""
    root = tmp_path_factory.mktemp("router_app")
    model = make_tiny_engine_dir(root / "llama")
    engines = []
    for i in range(3):
        cfg = events_config(root, f"tiny{i}")
        args = EngineArgs(model=str(model), max_model_len=256, kv_cache_memory="4MiB", kv_events_config=cfg)
        engines.append((LLMEngine(args), cfg))
    yield model, engines
    for engine, _ in engines:
        engine.shutdown()


async def _fleet(stack: AsyncExitStack, tiny, **kw) -> tuple[TestClient, list[str]]:
    model, engines = tiny
    urls = [await stack.enter_async_context(serving(engine_app(e))) for e, _ in engines]
    config = RouterConfig(urls, [c["endpoint"] for _, c in engines], [c["replay_endpoint"] for _, c in engines],
                          calibrate_s=0, **kw)  # fmt: skip
    app = build_router_app(config, PromptTokens(model, chunk_size=16))
    client = await stack.enter_async_context(TestClient(TestServer(app)))
    for _ in range(200):
        if (await client.get("/health")).status == 200:
            break
        await asyncio.sleep(0.05)
    return client, urls


async def _complete(client: TestClient, prompt: list[int], policy: str | None = None) -> str:
    headers = {POLICY_HEADER: policy} if policy else {}
    r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}, headers=headers)
    assert r.status == 200, await r.text()
    await r.read()
    return r.headers[ENGINE_HEADER]


async def _indexed_blocks(client: TestClient) -> dict[str, int]:
    return (await (await client.get("/v1/router/state")).json())["index"]["engines"]


async def _indexed(client: TestClient, engine: str, blocks: int, before: dict[str, int]) -> None:
    """Wait until the router indexed `blocks` more blocks of `engine` than it held `before` (an engine
    chosen twice already holds the first prompt's blocks: a bare count would not wait at all)."""
    for _ in range(200):
        state = await _indexed_blocks(client)
        if state.get(engine, 0) >= before.get(engine, 0) + blocks:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the router never saw {blocks} new blocks of {engine}: {state}")


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
        prefix = [await _complete(client, popular + [j + 1], "prefix") for j in range(6)]
        assert len(set(prefix)) == 1, "prefix sends every request to the holder: the hot spot the cap avoids"


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
