"""`kvstore-engine proxy` on its own: request rewriting and errors (no engines needed)."""

from __future__ import annotations

from aiohttp.test_utils import TestClient, TestServer

from engine.proxy import ProxyConfig, build_app, prefill_request
from tests.connectors.engine_util import free_port


def test_prefill_request_asks_for_one_token_without_streaming() -> None:
    body = {"prompt": "hi", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True}}
    req = prefill_request(body)
    assert req["max_tokens"] == 1 and req["stream"] is False and "stream_options" not in req
    assert body["max_tokens"] == 50, "the decode engine gets the original request"
    chat = prefill_request({"messages": [], "max_completion_tokens": 9})
    assert chat["max_completion_tokens"] == 1


async def test_bad_body_is_400_and_a_dead_engine_is_502() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    app = build_app(ProxyConfig([dead], [dead], timeout_s=5))
    async with TestClient(TestServer(app)) as client:
        r = await client.post(
            "/v1/completions", data=b"{not json", headers={"Content-Type": "application/json"}
        )
        assert r.status == 400 and (await r.json())["error"]["type"] == "BadRequestError"
        r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        body = await r.json()
        assert r.status == 502 and "prefill engine" in body["error"]["message"]
        r = await client.get("/health")
        assert r.status == 503
