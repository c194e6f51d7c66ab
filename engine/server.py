"""OpenAI-compatible HTTP server (aiohttp): /v1/completions, /v1/chat/completions (SSE streaming),
/v1/models, /health, /metrics.

Every error is OpenAI-style JSON, `{"error": {"message", "type", "param", "code"}}`, whatever its
origin: bad input (400), an unknown route or model (404), a wrong method (405), a body over the limit
(413), a request the engine gave up on (500), a shutdown (503). A stream that fails after its first
chunk ends with an SSE `error` event and `[DONE]`, never a second HTTP response. A request whose
client hangs up is aborted (stream or not); SIGTERM drains in-flight requests for a grace period.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
import uuid
from typing import Any, TypeVar

from aiohttp import web
from kvstore.engine.async_engine import AsyncEngine
from kvstore.engine.errors import InvalidRequest, RequestFailed
from kvstore.engine.llm_engine import LLMEngine
from kvstore.engine.openai_logprobs import LogprobsRenderer
from kvstore.engine.outputs import RequestOutput
from kvstore.engine.protocol import (
    MAX_PROMPTS_PER_REQUEST,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    choices_of,
    resolve_max_tokens,
    sampling_params_from,
)
from kvstore.engine.sampling_params import SamplingParams
from kvstore.engine.server_middleware import (
    MAX_BODY_BYTES,
    MAX_BODY_KEY,
    browser_guard,
    error_response,
    errors_middleware,
    host_check,
    parse_json,
    unless_disconnected,
)
from kvstore.engine.serving import (
    check_model,
    completion_logprobs,
    generate_all,
    last_output,
    render_chat,
    streams,
    tokenize_chat,
    tokenize_completion_prompts,
    usage_of,
)
from kvstore.engine.streaming import Delta, SSEStream

logger = logging.getLogger(__name__)
ENGINE_KEY = web.AppKey("async_engine", AsyncEngine)
LOGPROBS_KEY = web.AppKey("logprobs_renderer", LogprobsRenderer)
COMPILING_KEY = web.AppKey("compiling_per_client", dict)  # client -> its new constraints compiling now
MAX_COMPILES_PER_CLIENT = 4  # of the compile helper's 32 slots (compile_worker.MAX_RUNNING_COMPILES)
_PARSE_OFF_LOOP_BYTES = 256 * 2**10  # bigger bodies are parsed in the tokenizer pool
R = TypeVar("R", CompletionRequest, ChatCompletionRequest)


async def _read(request: web.Request, cls: type[R]) -> R:
    """The body as a validated request; a big one is parsed and validated off the event loop."""
    raw = await request.read()  # HTTPRequestEntityTooLarge past client_max_size

    def parse() -> R:
        return cls.from_body(parse_json(raw))

    return await request.app[ENGINE_KEY].off_loop(parse) if len(raw) > _PARSE_OFF_LOOP_BYTES else parse()


def _client(request: web.Request) -> str:
    """Who sent `request`, for fair shares: its credentials when it has some, else its address."""
    auth = request.headers.get("Authorization")
    if auth:
        return "auth:" + hashlib.sha256(auth.encode(errors="replace")).hexdigest()[:16]
    return f"addr:{request.remote}"


async def _compile_constraint(request: web.Request, engine: LLMEngine, params: SamplingParams) -> None:
    """Compile a structured-output constraint before the request is queued: a bad one is a 400
    before any work, and a slow first compile (~0.3 s for a typical schema) blocks neither the event
    loop nor the running batch; add_request then finds it in the cache. The compile runs on its own
    (a child process); waiting for it holds no executor thread, so slow ones queue nothing.

    A client has at most MAX_COMPILES_PER_CLIENT new constraints compiling at once (a 429 past
    that), so one client's wave of slow schemas cannot take every compile slot from the others."""
    constraint = params.structured_outputs
    if constraint is None:
        return
    so = engine.structured_output
    compiling = request.app[COMPILING_KEY]
    client = None if so.cached(constraint) else _client(request)
    if client is not None:
        if compiling.get(client, 0) >= MAX_COMPILES_PER_CLIENT:
            raise RequestFailed(
                f"{MAX_COMPILES_PER_CLIENT} of your constraints are compiling already; retry when they are done",
                status=429,
            )
        compiling[client] = compiling.get(client, 0) + 1
    try:
        loop = asyncio.get_running_loop()  # the executor only for the lookup (and the first use's setup)
        future = await loop.run_in_executor(None, so.compile_future, constraint)
        await asyncio.wrap_future(future)
    finally:
        if client is not None:
            compiling[client] -= 1
            if not compiling[client]:
                del compiling[client]


async def completions(request: web.Request) -> web.StreamResponse:
    aengine = request.app[ENGINE_KEY]
    engine = aengine.engine
    req = await _read(request, CompletionRequest)
    check_model(engine, req.model)
    prompts = req.prompts()
    if len(prompts) * req.n > MAX_PROMPTS_PER_REQUEST:
        raise InvalidRequest(
            f"a request holds at most {MAX_PROMPTS_PER_REQUEST} choices (prompts x n), got {len(prompts) * req.n}",
            param="n",
        )
    token_ids = await aengine.off_loop(tokenize_completion_prompts, engine, prompts, req.add_special_tokens)
    params = [
        sampling_params_from(req, resolve_max_tokens(req.max_tokens, len(ids), engine.max_model_len, 16))
        for ids in token_ids
    ]
    for ids, p in zip(token_ids, params, strict=True):  # all of them before the first is queued
        engine.check_request(ids, p)
    await _compile_constraint(request, engine, params[0])  # one constraint for every prompt of the request
    base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": engine.model_name}  # fmt: skip
    logprobs = request.app[LOGPROBS_KEY]
    # choice index = prompt index * n + i, as in vLLM
    flat_ids = [ids for ids in token_ids for _ in range(req.n)]
    flat_params = [c for p in params for c in choices_of(p, req.n)]
    if req.stream:
        sent = [[0, 0] for _ in flat_ids]  # per choice: output tokens whose logprobs went out, their text

        def chunk(i: int, out: RequestOutput, text: str) -> dict:
            c = out.outputs[0]
            lps = None
            if c.logprobs is not None:
                done = sent[i]
                lps = logprobs.completion(c.logprobs[done[0] :], done[1])
                done[0], done[1] = len(c.logprobs), done[1] + sum(map(len, lps["tokens"]))
            choice = {"index": i, "text": text, "logprobs": lps, "finish_reason": c.finish_reason}
            if c.finish_reason is not None:
                choice["stop_reason"] = c.stop_reason
            return {
                **base,
                "choices": [choice],
                **({"usage": usage_of([out])} if req.continuous_usage else {}),
            }

        usage = (
            (lambda outs: {**base, "choices": [], "usage": usage_of(outs, req.n)})
            if req.include_usage
            else None
        )
        stream = SSEStream(request, [Delta(p.stop) for p in flat_params], chunk, usage=usage,
                           window=aengine.admission_window)  # fmt: skip
        return await unless_disconnected(
            request, stream.run(streams(aengine, flat_ids, flat_params, base["id"]))
        )
    results = await unless_disconnected(request, generate_all(aengine, flat_ids, flat_params, base["id"]))
    if req.echo:  # the prompt as sent (a string), or its ids' decode
        texts = [
            p if isinstance(p, str) else engine.tokenizer.decode(p) for p in prompts for _ in range(req.n)
        ]
    choices = [{"index": i, "text": (texts[i] if req.echo else "") + o.outputs[0].text,
                "logprobs": completion_logprobs(logprobs, o, req.echo),
                "finish_reason": o.outputs[0].finish_reason, "stop_reason": o.outputs[0].stop_reason}
               for i, o in enumerate(results)]  # fmt: skip
    if req.prompt_logprobs is not None:  # vLLM's field, per choice
        for choice, o in zip(choices, results, strict=True):
            choice["prompt_logprobs"] = logprobs.vllm_prompt(o.prompt_logprobs)
    return web.json_response({**base, "choices": choices, "usage": usage_of(results, req.n)})


async def chat_completions(request: web.Request) -> web.StreamResponse:
    aengine = request.app[ENGINE_KEY]
    engine = aengine.engine
    req = await _read(request, ChatCompletionRequest)
    check_model(engine, req.model)
    prompt = await aengine.off_loop(tokenize_chat, engine, req)
    max_tokens = resolve_max_tokens(req.requested_max_tokens, len(prompt), engine.max_model_len, None)
    params = sampling_params_from(req, max_tokens)
    engine.check_request(prompt, params)
    choice_params = choices_of(params, req.n)
    await _compile_constraint(request, engine, params)
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": engine.model_name}
    logprobs = request.app[LOGPROBS_KEY]
    if req.stream:
        base["object"] = "chat.completion.chunk"
        role = {
            **base,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
        }

        sent = [0] * req.n  # per choice: output tokens whose logprobs went out (a chunk with no text waits)

        def chunk(i: int, out: RequestOutput, text: str) -> dict | None:
            c = out.outputs[0]
            if not text and c.finish_reason is None:
                return None
            choice: dict[str, Any] = {"index": i, "delta": {"content": text} if text else {},
                                      "finish_reason": c.finish_reason}  # fmt: skip
            if c.logprobs is not None:
                choice["logprobs"], sent[i] = logprobs.chat(c.logprobs[sent[i] :]), len(c.logprobs)
            if c.finish_reason is not None:
                choice["stop_reason"] = c.stop_reason
            return {
                **base,
                "choices": [choice],
                **({"usage": usage_of([out])} if req.continuous_usage else {}),
            }

        if req.continuous_usage:
            role["usage"] = {
                "prompt_tokens": len(prompt),
                "completion_tokens": 0,
                "total_tokens": len(prompt),
            }
        usage = (
            (lambda outs: {**base, "choices": [], "usage": usage_of(outs, req.n)})
            if req.include_usage
            else None
        )
        heads = [{**role, "choices": [{**role["choices"][0], "index": i}]} for i in range(req.n)]
        stream = SSEStream(request, [Delta(params.stop) for _ in range(req.n)], chunk, usage=usage, head=heads,
                           window=aengine.admission_window)  # fmt: skip
        gens = streams(aengine, [prompt] * req.n, choice_params, base["id"])
        return await unless_disconnected(request, stream.run(gens))
    if req.n == 1:
        outs = [await unless_disconnected(request, last_output(aengine.generate(prompt, params, base["id"])))]
    else:
        outs = await unless_disconnected(
            request, generate_all(aengine, [prompt] * req.n, choice_params, base["id"])
        )
    choices = [{"index": i, "message": {"role": "assistant", "content": o.outputs[0].text},
                "logprobs": None if o.outputs[0].logprobs is None else logprobs.chat(o.outputs[0].logprobs),
                "finish_reason": o.outputs[0].finish_reason, "stop_reason": o.outputs[0].stop_reason}
               for i, o in enumerate(outs)]  # fmt: skip
    body = {**base, "object": "chat.completion", "choices": choices, "usage": usage_of(outs, req.n)}
    if req.prompt_logprobs is not None:  # vLLM's field, once per response
        body["prompt_logprobs"] = logprobs.vllm_prompt(outs[0].prompt_logprobs)
    return web.json_response(body)


async def models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY].engine
    card = {"id": engine.model_name, "object": "model", "created": 0, "owned_by": "kvstore",
            "max_model_len": engine.max_model_len}  # fmt: skip
    return web.json_response({"object": "list", "data": [card]})


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: {count, max_model_len, tokens}."""
    aengine = request.app[ENGINE_KEY]
    engine = aengine.engine
    req = TokenizeRequest.from_body(parse_json(await request.read()))
    check_model(engine, req.model)
    if req.prompt is not None:
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = await aengine.off_loop(engine.tokenize, req.prompt, special)
    else:
        ids = await aengine.off_loop(render_chat, engine, req, bool(req.add_special_tokens))
    return web.json_response(
        {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": None}
    )


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's /detokenize: {prompt} for {tokens}."""
    aengine = request.app[ENGINE_KEY]
    engine = aengine.engine
    req = DetokenizeRequest.from_body(parse_json(await request.read()))
    check_model(engine, req.model)
    vocab = engine.tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in req.tokens):
        raise InvalidRequest(f"token ids must be in [0, {vocab})", param="tokens")
    return web.json_response({"prompt": await aengine.off_loop(engine.tokenizer.decode, req.tokens)})


async def health(request: web.Request) -> web.Response:
    if request.app[ENGINE_KEY].draining:
        return error_response(503, "the server is shutting down")
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[ENGINE_KEY].engine.render_metrics()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def build_app(
    engine: LLMEngine,
    max_body_bytes: int = MAX_BODY_BYTES,
    shutdown_timeout: float = 10.0,
    allowed_hosts: list[str] | tuple[str, ...] = (),
    host: str = "",
) -> web.Application:
    """`shutdown_timeout`: how long requests in flight at shutdown may run before they are failed;
    `allowed_hosts` (and `host`, the name it listens on): names a request's Host may give besides IP
    addresses and localhost (kvstore.engine.server_middleware.browser_guard; "*": any)."""
    guard = browser_guard(host_check(allowed_hosts, host))
    app = web.Application(middlewares=[errors_middleware, guard], client_max_size=max_body_bytes)
    app[MAX_BODY_KEY] = max_body_bytes
    aengine = AsyncEngine(engine)
    app[ENGINE_KEY] = aengine
    app[LOGPROBS_KEY] = LogprobsRenderer(engine.tokenizer)
    app[COMPILING_KEY] = {}

    async def on_startup(_: web.Application) -> None:
        await aengine.start()

    async def on_shutdown(_: web.Application) -> None:  # the listening socket is closed already
        await aengine.drain(shutdown_timeout)

    async def on_cleanup(_: web.Application) -> None:
        await aengine.stop()
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)  # KV saves reach the store

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


def serve(
    engine: LLMEngine,
    host: str = "127.0.0.1",
    port: int = 8000,
    shutdown_timeout: float = 10.0,
    allowed_hosts: list[str] | tuple[str, ...] = (),
) -> None:
    app = build_app(engine, shutdown_timeout=shutdown_timeout, allowed_hosts=allowed_hosts, host=host)

    def ready(message: str) -> None:
        """aiohttp's "Running on URL", once the socket is bound: with --port 0, the real port."""
        m = re.search(r"Running on (\S+)", message)
        url = m.group(1) if m else f"http://{host}:{port}"
        print(f"kvstore-engine serve ({engine.model_name}) listening on {url}", flush=True)

    # After the drain every handler has answered; aiohttp's own wait is only a backstop.
    web.run_app(app, host=host, port=port, print=ready, shutdown_timeout=5.0)
