"""`kvstore-engine proxy`: request rewriting, errors in the engine's JSON shape, a decode engine that is
down found before the prefill runs, failover, a decode engine that breaks mid-stream, SIGTERM drain.
The engines are real (a tiny checkpoint with a trained tokenizer) except where a broken one is needed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from kvstore.engine.engine_args import EngineArgs
from kvstore.engine.llm_engine import LLMEngine
from kvstore.engine.proxy import ProxyConfig, build_app, prefill_request
from kvstore.engine.server import build_app as engine_app
from prometheus_client.parser import text_string_to_metric_families

from tests.connectors.engine_util import free_port
from tests.engine.conftest import make_tiny_engine_dir

ROOT = Path(__file__).resolve().parents[2]
BODY = {"prompt": "The quick brown fox", "max_tokens": 2}


def test_prefill_request_asks_for_one_token_without_streaming() -> None:
    body = {"prompt": "hi", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True}}
    req = prefill_request(body)
    assert req["max_tokens"] == 1 and req["stream"] is False and "stream_options" not in req
    assert body["max_tokens"] == 50, "the decode engine gets the original request"
    chat = prefill_request({"messages": [], "max_completion_tokens": 9})
    assert chat["max_completion_tokens"] == 1


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    model = make_tiny_engine_dir(tmp_path_factory.mktemp("proxy_engine") / "llama")
    return LLMEngine(EngineArgs(model=str(model), max_model_len=256, kv_cache_memory="4MiB"))


@asynccontextmanager
async def serving(app: web.Application):
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


def requests_served(engine: LLMEngine) -> float:
    families = text_string_to_metric_families(engine.render_metrics().decode())
    return sum(s.value for f in families for s in f.samples if s.name == "vllm:request_success_total")


def one_sentence(message: str) -> bool:
    return ". " not in message and "Error(" not in message and "Cannot connect" not in message


async def test_bad_body_and_unknown_routes_are_json_errors() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with TestClient(TestServer(build_app(ProxyConfig([dead], [dead], timeout_s=5)))) as client:
        r = await client.post(
            "/v1/completions", data=b"{not json", headers={"Content-Type": "application/json"}
        )
        assert r.status == 400 and (await r.json())["error"]["type"] == "BadRequestError"
        for method, path, status in (("GET", "/nope", 404), ("GET", "/v1/completions", 405)):
            r = await client.request(method, path)
            assert r.status == status and (await r.json())["error"]["code"] == status
        r = await client.get("/health")
        body = await r.json()
        assert r.status == 503 and f"decode engine {dead} is not reachable" in body["error"]["message"]


async def test_a_down_decode_engine_is_a_502_naming_it_and_nothing_is_prefilled(engine: LLMEngine) -> None:
    hung = socket.socket()  # accepts connections (the backlog) and never answers: a hung engine
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)
    hung_url = f"http://127.0.0.1:{hung.getsockname()[1]}"
    dead = f"http://127.0.0.1:{free_port()}"
    try:
        async with serving(engine_app(engine)) as prefill_url:
            before = requests_served(engine)
            for decode, expected in ((dead, f"decode engine {dead} is not reachable (connection refused)"),
                                     (hung_url, f"decode engine {hung_url} did not answer within 0.5 s")):  # fmt: skip
                config = ProxyConfig([prefill_url], [decode], timeout_s=30, health_timeout_s=0.5)
                async with TestClient(TestServer(build_app(config))) as client:
                    r = await client.post("/v1/completions", json=BODY)
                    err = (await r.json())["error"]
                assert r.status == 502 and err["message"].startswith(expected), err
                assert one_sentence(err["message"]) and err["type"] == "BadGatewayError"
            assert requests_served(engine) == before, (
                "a request was prefilled for a decode engine that is down"
            )
            # With a second decode engine that is up, the request goes there.
            config = ProxyConfig([prefill_url], [dead, prefill_url], timeout_s=30, health_timeout_s=0.5)
            async with TestClient(TestServer(build_app(config))) as client:
                r = await client.post("/v1/completions", json=BODY)
                assert r.status == 200 and len((await r.json())["choices"]) == 1
    finally:
        hung.close()


@asynccontextmanager
async def breaking_decode_engine():
    """Healthy, then it starts a stream and crashes (the connection drops) after one event."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        if head.startswith("GET /health"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
        else:
            length = int(
                next(h.split(":")[1] for h in head.split("\r\n") if h.lower().startswith("content-length"))
            )
            await reader.readexactly(length)
            event = b'data: {"choices": [{"index": 0, "text": "Once", "finish_reason": null}]}\n\n'
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        await writer.drain()
        writer.transport.abort()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def test_a_decode_engine_that_breaks_mid_stream_ends_the_stream_with_an_error_event(
    engine: LLMEngine,
) -> None:
    async with serving(engine_app(engine)) as prefill_url, breaking_decode_engine() as decode_url:
        config = ProxyConfig([prefill_url], [decode_url], timeout_s=30)
        async with TestClient(TestServer(build_app(config))) as client:
            r = await client.post("/v1/completions", json={**BODY, "stream": True})
            assert r.status == 200
            text = (await r.read()).decode()
    assert "HTTP/1.1" not in text and text.startswith("data: ")
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and events[-2].startswith("event: error\ndata: ")
    err = json.loads(events[-2].split("data: ", 1)[1])["error"]
    assert (
        err["code"] == 502
        and err["message"].startswith(f"decode engine {decode_url} ")
        and one_sentence(err["message"])
    )


@pytest.mark.slow
async def test_sigterm_drains_the_requests_in_flight(engine: LLMEngine) -> None:
    async with serving(engine_app(engine)) as engine_url:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvstore.engine", "proxy", "--prefill", engine_url, "--decode", engine_url,
            "--port", "0", "--shutdown-timeout", "60",
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
            proxy_url = line.split("listening on ")[1].strip()
            body = {**BODY, "max_tokens": 120, "ignore_eos": True, "temperature": 0, "stream": True}
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{proxy_url}/v1/completions", json=body) as r:
                    assert (await r.content.readline()).startswith(b"data: ")
                    proc.send_signal(signal.SIGTERM)
                    rest = (await r.read()).decode()
            events = [e for e in rest.split("\n\n") if e.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and "error" not in rest
            assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
            assert await asyncio.wait_for(proc.wait(), 60) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
