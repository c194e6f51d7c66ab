"""A stand-in for `kvstore-engine serve` behind the router (tests/router/test_router_hostile.py,
benchmarks/bench_router_hostile.py): a real aiohttp server with the routes the router uses (GET /health,
/v1/models, /metrics; POST /v1/completions and /v1/chat/completions, JSON or SSE like the engine's) and a
set latency instead of a model: `ttft_s` before the first token, `itl_s` between tokens. Given a
publisher, it announces the full 16-token blocks of each token-id prompt it served as KV events
(BlockStored, vLLM's format), as an engine's prefix cache would.

`hung_engine()` is an engine that stopped (SIGSTOP): its socket accepts connections (the kernel's
backlog) and nothing ever answers; `FakeEngine.hang()` / `resume()` stop and continue one (every
route, /health too, waits till it resumes). A request's "kvstore_fake_pad": N pads each streamed token
with N bytes (a stream that fills a client's buffers fast)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import socket
from collections.abc import Iterator
from typing import Any

from aiohttp import web

from kvstore.events import block_stored

BLOCK = 16
SERVED = "fake-model"


class FakeEngine:
    def __init__(
        self,
        ttft_s: float = 0.02,
        itl_s: float = 0.005,
        tokens: int = 4,
        credentials: tuple[str, str] | None = None,
        publisher: Any = None,
    ) -> None:
        self.ttft_s, self.itl_s, self.tokens = ttft_s, itl_s, tokens
        self.publisher = publisher  # tests.router.test_events_hostile.RawPublisher or None
        self.expected_auth = (
            "Basic " + base64.b64encode(":".join(credentials).encode()).decode() if credentials else None
        )
        self.served = 0  # completions answered
        self.auth_seen: list[str | None] = []
        self.runner: web.AppRunner | None = None
        self.url = ""
        self._resumed: asyncio.Future | None = None  # not None while hung

    def hang(self) -> None:
        if self._resumed is None:
            self._resumed = asyncio.get_running_loop().create_future()

    def resume(self) -> None:
        if self._resumed is not None:
            self._resumed.set_result(None)
            self._resumed = None

    async def _stopped(self) -> None:
        while self._resumed is not None:
            await asyncio.shield(self._resumed)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=16 * 2**20)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        return app

    async def start(self) -> str:
        self.runner = web.AppRunner(self.app(), access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        return self.url

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _check(self, request: web.Request) -> web.Response | None:
        await self._stopped()
        given = request.headers.get("Authorization")
        self.auth_seen.append(given)
        if self.expected_auth is not None and given != self.expected_auth:
            return web.json_response({"error": {"message": "unauthorized", "code": 401}}, status=401)
        return None

    async def health(self, request: web.Request) -> web.Response:
        return await self._check(request) or web.json_response({"status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        await self._stopped()
        return web.Response(text="")

    async def models(self, request: web.Request) -> web.Response:
        return await self._check(request) or web.json_response(
            {"object": "list", "data": [{"id": SERVED, "object": "model", "owned_by": "kvstore"}]}
        )

    async def complete(self, request: web.Request) -> web.StreamResponse:
        refused = await self._check(request)
        if refused is not None:
            return refused
        body = await request.json()
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            self.announce(prompt)
        n = int(body.get("max_tokens") or self.tokens)
        await asyncio.sleep(self.ttft_s)
        await self._stopped()
        self.served += 1
        if not body.get("stream"):
            await asyncio.sleep(self.itl_s * (n - 1))
            text = " tok" * n
            return web.json_response(
                {"id": "cmpl-fake", "object": "text_completion", "model": body.get("model") or SERVED,
                 "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                 "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}}
            )  # fmt: skip
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        token = " tok" + "." * int(body.get("kvstore_fake_pad") or 0)
        for i in range(n):
            if i:
                await asyncio.sleep(self.itl_s)
                await self._stopped()
            event = {"id": "cmpl-fake", "object": "text_completion", "choices": [{"index": 0, "text": token}]}
            await out.write(f"data: {json.dumps(event)}\n\n".encode())
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    def announce(self, prompt: list[int]) -> None:
        """BlockStored for the prompt's full blocks (the last token is always recomputed)."""
        if self.publisher is None:
            return
        parent, events = None, []
        for i in range((len(prompt) - 1) // BLOCK):
            tokens = prompt[i * BLOCK : (i + 1) * BLOCK]
            h = hashlib.blake2b(repr((parent, tokens)).encode(), digest_size=8).digest()
            events.append(block_stored([h], parent, tokens, BLOCK, "GPU"))
            parent = h
        if events:
            self.publisher.publish(events)


@contextlib.contextmanager
def hung_engine() -> Iterator[str]:
    """An engine that stopped: connections are accepted into the backlog and never answered."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()
