"""OpenAI-compatible HTTP server (aiohttp): /v1/completions, /v1/chat/completions (SSE streaming),
/v1/models, /health, /metrics.

One `LLMEngine` serves every request. `AsyncEngine` steps it in a worker thread; an asyncio lock
keeps `add_request` and `step` apart, so new requests join the running batch between two steps.
Errors are OpenAI-style JSON: `{"error": {"message", "type", "param", "code"}}` with a 4xx status.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing

from aiohttp import web
from pydantic import ValidationError

from engine.errors import EngineError, InvalidRequest, TokenizerError
from engine.llm_engine import LLMEngine, RequestOutput
from engine.protocol import ChatCompletionRequest, CompletionRequest, sampling_params_from

logger = logging.getLogger(__name__)
ENGINE_KEY = web.AppKey("async_engine", object)


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._queues: dict[str, asyncio.Queue] = {}
        self._aborts: set[str] = set()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="engine-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        # A step may still be running in the worker thread: let it end before touching the engine.
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)
        for q in list(self._queues.values()):
            q.put_nowait(EngineError("the server is shutting down"))
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            for rid in self._aborts:
                self.engine.abort_request(rid)
            self._aborts.clear()
            if not self.engine.has_unfinished_requests():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                async with self._lock:
                    outputs = await loop.run_in_executor(self._executor, self.engine.step)
            except Exception as e:  # a failed step fails its requests, not the server
                logger.exception("engine step failed")
                for rid, q in list(self._queues.items()):
                    q.put_nowait(EngineError(f"engine step failed: {e}"))
                    self._aborts.add(rid)
                continue
            for out in outputs:
                q = self._queues.get(out.request_id)
                if q is not None:
                    q.put_nowait(out)

    async def generate(
        self, prompt: str | list[int], params, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Yields a RequestOutput per new token, the last one finished. Raises InvalidRequest at once
        (before the first yield) for a bad prompt or parameters."""
        q: asyncio.Queue = asyncio.Queue()
        async with self._lock:
            self.engine.add_request(prompt, params, request_id)
            self._queues[request_id] = q
        self._wake.set()
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:  # client went away or the request failed: free its blocks
                self._aborts.add(request_id)
                self._wake.set()


def error_response(status: int, message: str, kind: str = "BadRequestError") -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status)


@web.middleware
async def errors_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except InvalidRequest as e:
        return error_response(400, str(e))
    except ValidationError as e:
        msg = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        return error_response(400, f"invalid request: {msg}")
    except EngineError as e:
        logger.warning("engine error: %s", e)
        return error_response(getattr(e, "status", 500), str(e), "EngineError")


async def _json_body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise InvalidRequest("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return body


def _check_model(request: web.Request, model: str | None) -> LLMEngine:
    engine = request.app[ENGINE_KEY].engine
    if model is not None and model != engine.model_name:
        raise web.HTTPNotFound(
            text=json.dumps({"error": {"message": f"the model {model!r} does not exist; this server serves "
                             f"{engine.model_name!r}", "type": "NotFoundError", "param": "model", "code": 404}}),
            content_type="application/json",
        )  # fmt: skip
    return engine


class _Delta:
    """Turns cumulative text into stream deltas, holding back what a stop string may still cut off
    and a trailing incomplete UTF-8 character."""

    def __init__(self, stop: list[str]) -> None:
        self.sent = 0
        self.hold = max((len(s) for s in stop), default=1) - 1

    def __call__(self, out: RequestOutput) -> str:
        text = out.outputs[0].text
        end = len(text) if out.finished else max(self.sent, len(text) - self.hold)
        if not out.finished and text[self.sent : end].endswith("\ufffd"):
            end -= 1
        delta, self.sent = text[self.sent : end], max(self.sent, end)
        return delta


def _usage(out: RequestOutput) -> dict:
    p, c = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


async def _sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


async def _send(resp: web.StreamResponse, payload: dict | str) -> None:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    await resp.write(f"data: {data}\n\n".encode())


async def completions(request: web.Request) -> web.StreamResponse:
    req = CompletionRequest.model_validate(await _json_body(request))
    engine = _check_model(request, req.model)
    aengine: AsyncEngine = request.app[ENGINE_KEY]
    prompts = req.prompts()
    params = sampling_params_from(req, default_max_tokens=16)
    base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": engine.model_name}  # fmt: skip
    if req.stream:
        if len(prompts) != 1:
            raise InvalidRequest("streaming supports one prompt per request")
        async with aclosing(aengine.generate(prompts[0], params, base["id"])) as gen:
            first = await anext(gen)  # raises InvalidRequest before the stream starts
            resp, delta = await _sse(request), _Delta(params.stop)
            out = first
            async for out in _chain(first, gen):
                choice = {
                    "index": 0,
                    "text": delta(out),
                    "logprobs": None,
                    "finish_reason": out.outputs[0].finish_reason,
                }
                await _send(resp, {**base, "choices": [choice]})
        if req.include_usage:
            await _send(resp, {**base, "choices": [], "usage": _usage(out)})
        await _send(resp, "[DONE]")
        await resp.write_eof()
        return resp
    results = await asyncio.gather(
        *(_last(aengine.generate(p, params, f"{base['id']}-{i}")) for i, p in enumerate(prompts))
    )
    choices = [{"index": i, "text": o.outputs[0].text, "logprobs": None, "finish_reason": o.outputs[0].finish_reason,
                "stop_reason": o.outputs[0].stop_reason} for i, o in enumerate(results)]  # fmt: skip
    usage = {
        k: sum(_usage(o)[k] for o in results) for k in ("prompt_tokens", "completion_tokens", "total_tokens")
    }
    return web.json_response({**base, "choices": choices, "usage": usage})


async def chat_completions(request: web.Request) -> web.StreamResponse:
    req = ChatCompletionRequest.model_validate(await _json_body(request))
    engine = _check_model(request, req.model)
    aengine: AsyncEngine = request.app[ENGINE_KEY]
    try:
        prompt = engine.tokenizer.apply_chat_template(req.plain_messages(), tokenize=True)
    except TokenizerError as e:
        raise InvalidRequest(str(e)) from e
    n_prompt = len(prompt)
    params = sampling_params_from(req, default_max_tokens=max(1, engine.max_model_len - n_prompt))
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": engine.model_name}
    if req.stream:
        chunk = {**base, "object": "chat.completion.chunk"}
        async with aclosing(aengine.generate(prompt, params, base["id"])) as gen:
            first = await anext(gen)
            resp, delta = await _sse(request), _Delta(params.stop)
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            await _send(resp, {**chunk, "choices": [role]})
            out = first
            async for out in _chain(first, gen):
                text = delta(out)
                reason = out.outputs[0].finish_reason
                if text or reason:
                    body = {"content": text} if text else {}
                    await _send(
                        resp, {**chunk, "choices": [{"index": 0, "delta": body, "finish_reason": reason}]}
                    )
        if req.include_usage:
            await _send(resp, {**chunk, "choices": [], "usage": _usage(out)})
        await _send(resp, "[DONE]")
        await resp.write_eof()
        return resp
    out = await _last(aengine.generate(prompt, params, base["id"]))
    choice = {"index": 0, "message": {"role": "assistant", "content": out.outputs[0].text},
              "finish_reason": out.outputs[0].finish_reason, "stop_reason": out.outputs[0].stop_reason}  # fmt: skip
    return web.json_response({**base, "object": "chat.completion", "choices": [choice], "usage": _usage(out)})


async def _chain(first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    yield first
    if not first.finished:
        async for out in rest:
            yield out


async def _last(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    out = None
    async with aclosing(gen):
        async for item in gen:
            out = item
    assert out is not None and out.finished
    return out


async def models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY].engine
    card = {"id": engine.model_name, "object": "model", "created": 0, "owned_by": "kvstore",
            "max_model_len": engine.max_model_len}  # fmt: skip
    return web.json_response({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[ENGINE_KEY].engine.render_metrics()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def build_app(engine: LLMEngine) -> web.Application:
    app = web.Application(middlewares=[errors_middleware], client_max_size=8 * 2**20)
    aengine = AsyncEngine(engine)
    app[ENGINE_KEY] = aengine

    async def on_startup(_: web.Application) -> None:
        await aengine.start()

    async def on_cleanup(_: web.Application) -> None:
        await aengine.stop()
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)  # KV saves reach the store

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


def serve(engine: LLMEngine, host: str = "127.0.0.1", port: int = 8000) -> None:
    logger.info("serving %s on http://%s:%d", engine.model_name, host, port)
    web.run_app(build_app(engine), host=host, port=port, print=None)
