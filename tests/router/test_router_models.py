"""Model names through `kvstore-engine router` (issue 43): the router learns what its engines serve
(GET /v1/models), answers /v1/models itself, takes its own `--model` as an alias of the served name,
answers an unknown model with its own 404 (forwarded to no engine, counted nowhere), and never counts an
engine's error answer as a routed request or its prompt tokens as computed."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from kvstore.engine.router import router as router_mod
from kvstore.engine.router.app import ENGINE_HEADER, POLICY_HEADER, build_router_app
from kvstore.engine.router.router import RouterConfig
from kvstore.engine.router.tokens import PromptTokens
from kvstore.engine.server import build_app as engine_app
from prometheus_client.parser import text_string_to_metric_families

from tests.connectors.test_proxy import requests_served, serving
from tests.router.fleet import events_config
from tests.waiting import wait_until_async

ALIAS = "smollm2"


async def _samples(client: TestClient, name: str) -> dict[tuple, float]:
    text = await (await client.get("/metrics")).text()
    return {
        tuple(sorted(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name
    }


async def _counted(client: TestClient) -> tuple[float, float]:
    """(requests counted as routed, prompt tokens counted by source) so far."""
    decisions = await _samples(client, "kvstore_router_decisions_total")
    tokens = await _samples(client, "kvstore_router_prompt_tokens_total")
    return sum(decisions.values()), sum(tokens.values())


async def _router(stack: AsyncExitStack, model_dir, urls: list[str], cfgs: list[dict], **kw) -> TestClient:
    kw.setdefault("calibrate_s", 0)
    config = RouterConfig(urls, [c["endpoint"] for c in cfgs], [c["replay_endpoint"] for c in cfgs], **kw)
    app = build_router_app(config, PromptTokens(model_dir, chunk_size=16))
    return await stack.enter_async_context(TestClient(TestServer(app)))


async def test_the_router_serves_the_engines_names_and_its_alias(tiny) -> None:
    model_dir, engines = tiny
    served = engines[0][0].model_name
    assert served != ALIAS
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serving(engine_app(e))) for e, _ in engines]
        client = await _router(stack, model_dir, urls, [c for _, c in engines], model=ALIAS)
        r = await client.get("/v1/models")
        assert r.status == 200, await r.text()
        assert [c["id"] for c in (await r.json())["data"]] == [served]

        for name in (served, ALIAS, None):
            body = {"prompt": [5, 6, 7], "max_tokens": 2} | ({"model": name} if name else {})
            r = await client.post("/v1/completions", json=body)
            assert r.status == 200, (name, await r.text())
            assert (await r.json())["model"] == served, "the alias went to the engine as its served name"
        r = await client.post("/v1/chat/completions", json={"model": ALIAS, "max_tokens": 2,
                                                              "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
        assert r.status == 200, await r.text()
        decisions, tokens = await _counted(client)
        assert decisions == 4 and tokens > 3 * 3

        before = await _counted(client)
        served_before = [requests_served(e) for e, _ in engines]
        r = await client.post("/v1/completions", json={"model": "nope", "prompt": [5, 6, 7], "max_tokens": 2})
        assert r.status == 404
        assert ENGINE_HEADER not in r.headers, "the router answered it itself"
        error = (await r.json())["error"]
        assert (error["code"], error["param"], error["type"]) == (404, "model", "NotFoundError")
        assert "'nope'" in error["message"] and repr(served) in error["message"]
        assert await _counted(client) == before, "a request for an unknown model is counted nowhere"
        assert [requests_served(e) for e, _ in engines] == served_before, "and sent to no engine"


async def test_an_engines_error_answer_is_not_a_routed_request(tiny) -> None:
    model_dir, engines = tiny
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serving(engine_app(e))) for e, _ in engines]
        client = await _router(stack, model_dir, urls, [c for _, c in engines])
        before = await _counted(client)
        for stream in (False, True):
            r = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2,
                                                           "temperature": -1, "stream": stream})  # fmt: skip
            assert r.status == 400, await r.text()
            assert r.headers[ENGINE_HEADER] in urls, "the engine refused it"
        assert await _counted(client) == before, "a refused request is neither routed nor computed"
        errors = await _samples(client, "kvstore_router_engine_errors_total")
        assert sum(errors.values()) == 2 and {dict(k)["code"] for k in errors} == {"400"}
        state = await (await client.get("/v1/router/state")).json()
        assert sum(e["errors"] for e in state["engines"].values()) == 2
        assert all(sum(e["tokens"].values()) == 0 for e in state["engines"].values())
        r = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2})
        assert r.status == 200 and (await _counted(client))[0] == before[0] + 1


def _fake_engine(names: list[str], seen: list[dict]) -> web.Application:
    """An engine that serves `names` (a list the test may change) and answers a completion with the
    model it was asked for; a name it does not serve is its 404, like the engine's."""

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": n, "object": "model"} for n in names]})

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        if body.get("model") not in (None, *names):
            return web.json_response({"error": {"message": "no such model", "code": 404}}, status=404)
        return web.json_response({"model": body.get("model"), "choices": [{"text": "x"}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return app


async def test_requests_go_to_the_engines_that_serve_their_model(tmp_path, monkeypatch) -> None:
    """Two engines serving different names: a name goes only to its engine, the alias to either as
    that engine's name; an engine that changes its model is read again when a request names the new one."""
    from tests.engine.conftest import make_tiny_engine_dir

    model_dir = make_tiny_engine_dir(tmp_path / "llama")
    names = {"a": ["model-a"], "b": ["model-b", "model-b-too"]}
    seen: dict[str, list[dict]] = {"a": [], "b": []}
    async with AsyncExitStack() as stack:
        urls = {k: await stack.enter_async_context(serving(_fake_engine(names[k], seen[k]))) for k in names}
        cfgs = [events_config(tmp_path, k) for k in names]
        client = await _router(stack, model_dir, list(urls.values()), cfgs, model=ALIAS, policy="round_robin")
        r = await client.get("/v1/models")
        assert [c["id"] for c in (await r.json())["data"]] == ["model-a", "model-b", "model-b-too"]

        async def send(model: str) -> tuple[int, str | None, dict]:
            r = await client.post("/v1/completions", json={"model": model, "prompt": [1, 2], "max_tokens": 1})
            return r.status, r.headers.get(ENGINE_HEADER), await r.json()

        assert {(await send("model-a"))[1] for _ in range(3)} == {urls["a"]}
        assert {(await send("model-b-too"))[1] for _ in range(3)} == {urls["b"]}
        got = [await send(ALIAS) for _ in range(4)]
        assert {(s, e, b["model"]) for s, e, b in got} == {
            (200, urls["a"], "model-a"),
            (200, urls["b"], "model-b"),
        }
        assert all(b["model"] != ALIAS for bodies in seen.values() for b in bodies), "no engine saw the alias"

        sent = sum(map(len, seen.values()))
        status, engine, body = await send("model-c")
        assert (status, engine, body["error"]["param"]) == (404, None, "model")
        assert sum(map(len, seen.values())) == sent
        monkeypatch.setattr(router_mod, "MODELS_REFRESH_S", 0.0)
        names["a"][:] = ["model-c"]  # engine a restarted with another model
        status, engine, body = await send("model-c")
        assert (status, engine, body["model"]) == (200, urls["a"], "model-c")
        assert [c["id"] for c in (await (await client.get("/v1/models")).json())["data"]] == [
            "model-c", "model-b", "model-b-too"
        ]  # fmt: skip
        decisions = await _samples(client, "kvstore_router_decisions_total")
        assert sum(decisions.values()) == 3 + 3 + 4 + 1


async def test_models_are_learned_at_start_before_any_request(tmp_path) -> None:
    """The router reads its engines' names on start (and at each calibration probe): a client's first
    request, naming the alias, already goes as the served name."""
    from tests.engine.conftest import make_tiny_engine_dir

    model_dir = make_tiny_engine_dir(tmp_path / "llama")
    names, seen = ["served-name"], []
    async with AsyncExitStack() as stack:
        url = await stack.enter_async_context(serving(_fake_engine(names, seen)))
        client = await _router(stack, model_dir, [url], [events_config(tmp_path, "e")], model=ALIAS,
                               calibrate_s=0.05)  # fmt: skip
        r = await client.post("/v1/completions", json={"model": ALIAS, "prompt": [1, 2], "max_tokens": 1},
                              headers={POLICY_HEADER: "round_robin"})  # fmt: skip
        assert r.status == 200 and (await r.json())["model"] == "served-name"
        names[:] = ["renamed"]

        async def renamed() -> bool:  # the calibration probe reads the names again
            return [c["id"] for c in (await (await client.get("/v1/models")).json())["data"]] == ["renamed"]

        await wait_until_async(renamed, timeout=2)


@pytest.mark.parametrize("model", [5, ["x"]])
async def test_a_model_that_is_not_a_string_is_a_400(tmp_path, model) -> None:
    from tests.engine.conftest import make_tiny_engine_dir

    model_dir = make_tiny_engine_dir(tmp_path / "llama")
    seen: list[dict] = []
    async with AsyncExitStack() as stack:
        url = await stack.enter_async_context(serving(_fake_engine(["m"], seen)))
        client = await _router(stack, model_dir, [url], [events_config(tmp_path, "e")])
        r = await client.post("/v1/completions", json={"model": model, "prompt": [1], "max_tokens": 1})
        assert r.status == 400 and (await r.json())["error"]["param"] == "model" and not seen
