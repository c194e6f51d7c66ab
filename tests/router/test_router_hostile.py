"""The router's front door against hostile clients and a hung engine (issue 45 items 2, 3, 7, 11). Each
test ran against the router before the change and failed there:

- item 2: a body over the engines' 8 MiB is a 413 before it is read (was read up to 64 MiB first); a
  huge prompt is tokenized in the prep pool, only its lead (the event loop answered nobody meanwhile);
- item 3: with one engine hung, every request is answered by the other within the health probe's
  deadline (the hung one got 9 of 20, each waiting 600 s); the share cap counts requests in flight;
- item 7: a half-sent request is closed at the header deadline, and with 256 descriptors 300 idle
  connections leave a fresh request answered (a fast 503), in a router process of its own; --timeout
  is a silence between bytes, not a total (a slow stream is not cut);
- item 11: credentials in an engine URL reach the engine and no client, header, state, metric or log;
  browser-shaped cross-origin POSTs are refused; token ids outside [0, 2^31) are a 400 (was a 500).

The engines are tests.router.fake_engine's: real HTTP servers answering as kvstore-engine does."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from kvstore.engine.router import app as app_mod
from kvstore.engine.router import decision as decision_mod
from kvstore.engine.router.app import DECISION_HEADER, ENGINE_HEADER, build_router_app
from kvstore.engine.router.router import Router, RouterConfig
from kvstore.engine.router.scoring import Choice, choose
from kvstore.engine.router.tokens import PromptTokens

from tests.connectors.engine_util import free_port
from tests.engine.conftest import make_tiny_engine_dir
from tests.router.fake_engine import FakeEngine, hung_engine

ROOT = Path(__file__).resolve().parents[2]
HEALTH_DEADLINE_S = 2.0 + 2.0 + 6.0  # the router's health probe interval + its timeout (defaults) + margin
HEADER_DEADLINE_S = 10.0 + 10.0  # the router's header timeout (default) + margin


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_engine_dir(tmp_path_factory.mktemp("router_hostile") / "llama")


def _config(urls: list[str], tmp: Path, **kw) -> RouterConfig:
    events = [f"ipc://{tmp}/none{i}-pub" for i in range(len(urls))]
    return RouterConfig(urls, events, [None] * len(urls), calibrate_s=0, **kw)


@contextlib.asynccontextmanager
async def _router(urls: list[str], tmp: Path, model: Path, **kw) -> AsyncIterator[TestClient]:
    app = build_router_app(_config(urls, tmp, **kw), PromptTokens(model, chunk_size=16))
    async with TestClient(TestServer(app)) as client:
        yield client


@contextlib.asynccontextmanager
async def _engines(*engines: FakeEngine) -> AsyncIterator[list[str]]:
    try:
        yield [await e.start() for e in engines]
    finally:
        for e in engines:
            await e.stop()


def _raw(port: int, data: bytes, timeout_s: float) -> bytes:
    """Send `data` on a new connection and read until the server closes it or `timeout_s` passes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        with contextlib.suppress(OSError):  # the server may answer and close while we still send
            s.sendall(data)
        got = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := s.recv(65536):
                got += chunk
                if b"\r\n\r\n" in got and b'"error"' in got:
                    break
        return got


# ---- item 2: one large request froze the router ------------------------------------------------------
@pytest.mark.parametrize("size", [9 * 2**20, 60 * 2**20, 2**40])
async def test_a_body_over_the_engines_limit_is_refused_before_it_is_read(tmp_path, model_dir, size) -> None:
    """Only its headers and 64 KiB are sent: the 413 must come without the rest (the router used to
    wait for up to 64 MiB, and parse and tokenize them)."""
    fake = FakeEngine()
    async with _engines(fake) as urls, _router(urls, tmp_path, model_dir) as client:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {size}\r\n\r\n"
        ).encode()
        got = await asyncio.to_thread(_raw, client.port, head + b'{"prompt": "' + b"a" * 65536, 15.0)
        assert got.startswith(b"HTTP/1.1 413"), got[:200]
        err = json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]
        assert err["code"] == 413 and str(8 * 2**20) in err["message"]
        assert fake.served == 0


async def test_a_huge_prompt_is_tokenized_off_the_loop_and_only_its_lead(tmp_path, model_dir) -> None:
    """A 7.9 MB prompt (the engine's limit admits it): while it is being tokenized, the router answers
    others (it used to tokenize all of it in its event loop: 8.6 s for every other client)."""
    fake = FakeEngine()
    async with _engines(fake) as urls, _router(urls, tmp_path, model_dir) as client:
        tokens = client.server.app[app_mod.ROUTER_KEY].tokens
        seen: list[int] = []
        late: list[int] = []  # prompts whose tokenizing nobody else got an answer during
        entered, answered = threading.Event(), threading.Event()
        real_encode = tokens.tokenizer.encode

        def encode(text: str, *a, **kw):
            seen.append(len(text))
            if len(text) > 50_000:
                entered.set()
                if not answered.wait(30):  # the test sets it once the router answered someone else
                    late.append(len(text))
            return real_encode(text, *a, **kw)

        tokens.tokenizer.encode = encode
        huge = {"prompt": "The keeper climbed the stairs. " * 255_000, "max_tokens": 2}  # 7.9 MB
        big = asyncio.ensure_future(client.post("/v1/completions", json=huge))
        assert await asyncio.to_thread(entered.wait, 60), "the huge prompt was never tokenized"
        try:
            r = await client.get("/v1/router/state")  # answered while the huge prompt is being tokenized
            assert r.status == 200
            answered.set()
        finally:
            answered.set()
        resp = await big
        assert resp.status == 200, await resp.text()
        assert not late, "the router answered nobody while it tokenized the huge prompt"
        limit = 16_384 * 8  # the default route_tokens x CHARS_PER_TOKEN
        assert max(seen) <= limit, f"the router tokenized {max(seen)} characters of the prompt"
        assert fake.served == 1


# ---- item 3: a hung engine kept getting requests -----------------------------------------------------
async def test_a_hung_engine_is_passed_over_and_its_requests_answered_elsewhere(tmp_path, model_dir) -> None:
    """One engine stopped (its socket accepts, nothing answers): 20 requests at once, streamed and not,
    are all answered by the other within the health probe's deadline; then none is even considered
    for the hung one (the share cap used to push 9 of 20 onto it, each waiting 600 s)."""
    fake = FakeEngine()
    with hung_engine() as hung:
        async with _engines(fake) as (good,), _router([hung, good], tmp_path, model_dir) as client:

            async def one(i: int) -> tuple[int, str, dict]:
                body = {"prompt": [5 + i, 6, 7], "max_tokens": 3, "stream": i % 2 == 0}
                r = await client.post("/v1/completions", json=body)
                text = await r.text()
                assert "event: error" not in text, text
                return (
                    r.status,
                    r.headers.get(ENGINE_HEADER, ""),
                    json.loads(r.headers.get(DECISION_HEADER, "{}")),
                )

            results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(20))), HEALTH_DEADLINE_S)
            assert [(s, e) for s, e, _ in results] == [(200, good)] * 20
            state = await (await client.get("/v1/router/state")).json()
            assert not state["engines"][hung]["up"] and "health probe" in state["engines"][hung]["down_why"]
            assert state["engines"][hung]["in_flight"] == 0
            later = await asyncio.gather(*(one(i) for i in range(10)))
            assert all(hung not in d["estimates"] for _, _, d in later), "a hung engine was still considered"


def test_the_share_cap_counts_requests_in_flight_until_they_complete(monkeypatch) -> None:
    """A window of decisions forgot a hung engine's requests once newer decisions pushed them out, and
    it looked under its share again; requests in flight now count until they complete."""
    router = Router(_config(["http://h", "http://g"], Path("/nonexistent"), share_window=2), tokens=None)
    seen = []

    def spy(policy, engines, *a):
        seen.append(engines)
        return choose(policy, engines, *a)

    monkeypatch.setattr(decision_mod, "choose", spy)  # the decision core scores for the router

    def sent(engine: str) -> Choice:
        choice = Choice(engine, "ttft", 0.0, 0, 0, 1)
        router.add_load(choice)
        return choice

    for _ in range(3):
        sent("http://h")  # hung: never finished
    for _ in range(10):
        router.finished(sent("http://g"), 200)
    router.finished(sent("http://g"), 502)  # an error answer is no completion
    router.decide(None, "ttft")
    recent = {e.name: e.recent for e in seen[-1]}
    assert recent == {"http://h": 3, "http://g": 4}, recent  # g: its last 2 x 2 completions


# ---- item 7: slowloris emptied the router -----------------------------------------------------------
@pytest.fixture
def router_process(tmp_path, model_dir):
    """`kvstore-engine router` with 256 file descriptors, its engine down (nothing here needs one)."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    cmd = [sys.executable, "-m", "kvstore.engine", "router", "--port", "0", "--model", str(model_dir),
           "--chunk-size", "16", "--calibrate-interval", "0", "--engine", f"http://127.0.0.1:{free_port()}",
           "--engine-events", f"ipc://{tmp_path}/none-pub"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=limit, env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    try:
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (line := proc.stdout.readline()):
            lines.append(line)
            if m := re.search(r"listening on http://127.0.0.1:(\d+)", line):
                threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
                yield int(m.group(1))
                break
        else:
            raise RuntimeError("the router did not start:\n" + "".join(lines[-30:]))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_slowloris_is_closed_and_idle_connections_leave_a_fresh_request_answered(router_process) -> None:
    port = router_process
    # a request whose headers never finish is closed at the header deadline (it stayed open 90 s+)
    started = time.monotonic()
    got = _raw(port, b"GET /v1/router/state HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: 1", HEADER_DEADLINE_S)
    assert time.monotonic() - started < HEADER_DEADLINE_S, "the half-sent request was never closed"
    assert got.startswith(b"HTTP/1.1 408"), got[:200]
    # 300 connections that say nothing, with 256 descriptors: a fresh request is still answered
    idle = []
    try:
        for _ in range(300):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        got = _raw(port, b"GET /v1/router/state HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 5.0)
        assert got.startswith((b"HTTP/1.1 503", b"HTTP/1.1 200")), got[:200]
        if got.startswith(b"HTTP/1.1 503"):
            assert b"Retry-After" in got and b"limit" in got
    finally:
        for s in idle:
            s.close()


async def test_the_timeout_is_between_bytes_not_over_a_stream(tmp_path, model_dir) -> None:
    """--timeout 1 and a stream of 8 tokens 0.4 s apart (3 s): the stream is whole (it was cut at 1 s)."""
    async with (
        _engines(FakeEngine(ttft_s=0.2, itl_s=0.4)) as urls,
        _router(urls, tmp_path, model_dir, timeout_s=1.0) as client,
    ):
        r = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 8, "stream": True})
        text = await r.text()
    assert r.status == 200 and "event: error" not in text, text
    assert text.count(" tok") == 8 and text.endswith("data: [DONE]\n\n")


# ---- item 11: credentials, cross-origin, token ids ----------------------------------------------------
async def test_engine_credentials_are_used_and_never_shown(tmp_path, model_dir, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    fake = FakeEngine(credentials=("router", "s3cret-pw"))
    async with _engines(fake) as (url,):
        secret_url = url.replace("http://", "http://router:s3cret-pw@")
        async with _router([secret_url], tmp_path, model_dir) as client:
            r = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
            assert r.status == 200, await r.text()
            shown = [json.dumps(dict(r.headers)), await r.text()]
            for path in ("/v1/router/state", "/metrics", "/v1/models"):
                shown.append(await (await client.get(path)).text())
        assert fake.served == 1 and fake.auth_seen[-1] == fake.expected_auth
        dead = f"http://router:s3cret-pw@127.0.0.1:{free_port()}"
        async with _router([dead], tmp_path, model_dir) as client:
            r = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
            assert r.status == 502
            shown += [
                json.dumps(dict(r.headers)),
                await r.text(),
                await (await client.get("/v1/router/state")).text(),
            ]
    shown += [rec.getMessage() for rec in caplog.records]
    assert not [s for s in shown if "s3cret" in s]
    assert any(f"127.0.0.1:{url.rsplit(':', 1)[1]}" in s for s in shown)


@pytest.mark.parametrize(
    "headers,status",
    [
        ({"Origin": "http://evil.example"}, 403),
        ({"Origin": "null"}, 403),
        ({"Host": "evil.example"}, 403),  # DNS rebinding: the page's own name resolves to the router
        ({"Content-Type": "text/plain"}, 415),  # what a page may send cross-origin without a preflight
        ({"Content-Type": "application/x-www-form-urlencoded"}, 415),
        ({"Content-Type": "multipart/form-data; boundary=x"}, 415),
        ({"Origin": "http://127.0.0.1:1234"}, 200),  # a page of this host
        ({"Origin": "http://localhost"}, 200),
    ],
)
async def test_cross_origin_browser_requests_are_refused(tmp_path, model_dir, headers, status) -> None:
    fake = FakeEngine()
    async with _engines(fake) as urls, _router(urls, tmp_path, model_dir) as client:
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}).encode()
        r = await client.post(
            "/v1/completions", data=body, headers={"Content-Type": "application/json", **headers}
        )
        assert r.status == status, await r.text()
        if status != 200:
            assert (await r.json())["error"]["code"] == status
            assert "Access-Control-Allow-Origin" not in r.headers
        assert fake.served == (status == 200)


@pytest.mark.parametrize("bad", [2**31, -1, 2**63, 10**30])
async def test_token_ids_outside_int32_are_a_400_before_any_work(tmp_path, model_dir, bad) -> None:
    fake = FakeEngine()
    async with _engines(fake) as urls, _router(urls, tmp_path, model_dir) as client:
        prompt = [1, 2, bad] + list(range(3, 40))  # in the first chunk the router hashes
        for body in ({"prompt": prompt}, {"prompt": [[1, 2, 3], prompt]}):
            r = await client.post("/v1/completions", json={**body, "max_tokens": 2})
            err = (await r.json())["error"]
            assert r.status == 400 and err["param"] == "prompt" and "2147483648" in err["message"], err
        assert fake.served == 0


async def test_a_client_reading_nothing_of_its_stream_is_closed(tmp_path, model_dir) -> None:
    """A stream of 64 KiB tokens nobody reads: once the buffers are full, the router waits --timeout
    (1 s here) for its client, then closes the connection and the engine's request with it."""
    fake = FakeEngine(ttft_s=0.0, itl_s=0.001)
    async with _engines(fake) as urls, _router(urls, tmp_path, model_dir, timeout_s=1.0) as client:
        body = json.dumps(
            {"prompt": [1, 2, 3], "max_tokens": 10**6, "stream": True, "kvstore_fake_pad": 65536}
        )
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n")  # fmt: skip

        sock = socket.create_connection(("127.0.0.1", client.port))
        try:
            sock.sendall((head + body).encode())  # and never a recv

            async def in_flight() -> int:
                state = await (await client.get("/v1/router/state")).json()
                return sum(e["in_flight"] for e in state["engines"].values())

            seen = []
            for _ in range(300):  # 30 s: the buffers' fill + --timeout, with room
                seen.append(await in_flight())
                if seen[-1] == 0 and 1 in seen:
                    break
                await asyncio.sleep(0.1)
            assert 1 in seen and seen[-1] == 0, "the router kept writing to a client that read nothing"
        finally:
            sock.close()


async def test_bodies_past_the_prep_queue_are_a_503(tmp_path, model_dir) -> None:
    """One prep thread, no queue: while it tokenizes one body, the next is a 503 with Retry-After."""
    fake = FakeEngine()
    async with (
        _engines(fake) as urls,
        _router(urls, tmp_path, model_dir, prep_workers=1, prep_queue=0) as client,
    ):
        tokens = client.server.app[app_mod.ROUTER_KEY].tokens
        entered, release = threading.Event(), threading.Event()
        real_encode = tokens.tokenizer.encode

        def encode(text: str, *a, **kw):
            entered.set()
            release.wait(30)
            return real_encode(text, *a, **kw)

        tokens.tokenizer.encode = encode
        first = asyncio.ensure_future(
            client.post("/v1/completions", json={"prompt": "held", "max_tokens": 2})
        )
        try:
            assert await asyncio.to_thread(entered.wait, 30)
            r = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
            assert r.status == 503 and r.headers["Retry-After"] == "1", await r.text()
            assert (await r.json())["error"]["code"] == 503
        finally:
            release.set()
        assert (await first).status == 200
