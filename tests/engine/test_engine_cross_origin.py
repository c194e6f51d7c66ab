"""A web page in a browser must not run prompts on `kvstore-engine serve` (issue 45 item 11): the engine
refuses what kvstore-server refuses without a token (kvstore.front_door.origin.HostCheck): a Host that is not
an IP address, localhost or an --allowed-hosts name (DNS rebinding), an Origin of another site, and a
POST a page could send cross-origin without a CORS preflight (no Content-Type, text/plain, a form). It
used to run them all. OpenAI clients (application/json, no Origin) are served as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from kvstore.engine.engine_args import EngineArgs
from kvstore.engine.llm_engine import LLMEngine
from kvstore.engine.server import build_app

BODY = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()


@pytest.fixture(scope="module")
def engine(tiny_bpe_engine_dir: Path):
    engine = LLMEngine(EngineArgs(model=str(tiny_bpe_engine_dir), max_model_len=128, kv_cache_memory="4MiB"))
    yield engine
    engine.shutdown()


@pytest.mark.parametrize(
    "headers,status",
    [
        ({"Origin": "http://evil.example"}, 403),
        ({"Origin": "null"}, 403),  # sandboxed frames, file:// pages
        ({"Host": "evil.example:8000"}, 403),  # DNS rebinding: the page's own name resolves to the engine
        ({"Host": "127.0.0.1.nip.io"}, 403),
        ({"Content-Type": "text/plain"}, 415),
        ({"Content-Type": "text/plain;charset=UTF-8"}, 415),
        ({"Content-Type": "application/x-www-form-urlencoded"}, 415),
        ({"Content-Type": "multipart/form-data; boundary=x"}, 415),
        ({"Content-Type": None}, 415),
        ({}, 200),  # an OpenAI client
        ({"Origin": "http://localhost:3000"}, 200),  # a page of this host
        ({"Host": "localhost:8000", "Origin": "http://localhost:8000"}, 200),
        ({"Content-Type": "application/json; charset=utf-8"}, 200),
    ],
)
async def test_browser_shaped_requests_are_refused(engine, headers, status) -> None:
    headers = {"Content-Type": "application/json", **headers}
    skip = [h for h, v in headers.items() if v is None]
    headers = {h: v for h, v in headers.items() if v is not None}
    async with TestClient(TestServer(build_app(engine))) as client:
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            body = BODY
            if path == "/v1/chat/completions":
                body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode()
            if path == "/tokenize":
                body = json.dumps({"prompt": "Hi"}).encode()
            r = await client.post(path, data=body, headers=headers, skip_auto_headers=skip)
            assert r.status == status, (path, await r.text())
            err = (await r.json()).get("error") if status != 200 else None
            if err is not None:
                assert err["code"] == status and set(err) == {"message", "type", "param", "code"}
                assert "Access-Control-Allow-Origin" not in r.headers


async def test_an_allowed_host_name_is_served(engine) -> None:
    app = build_app(engine, allowed_hosts=["engine", "kvstore-decode"])
    async with TestClient(TestServer(app)) as client:
        for host, status in (("engine:8000", 200), ("kvstore-decode", 200), ("evil.example", 403)):
            r = await client.post(
                "/v1/completions", data=BODY, headers={"Host": host, "Content-Type": "application/json"}
            )
            assert r.status == status, await r.text()
    async with TestClient(TestServer(build_app(engine, allowed_hosts=["*"]))) as client:
        r = await client.post(
            "/v1/completions", data=BODY, headers={"Host": "evil.example", "Content-Type": "application/json"}
        )
        assert r.status == 200
