"""`kvstore-engine router`: a KV-aware OpenAI-compatible router in front of several engines.

    client --> router --> the engine `--policy` picks (ttft by default, kvstore.engine.router.scoring)
                 ^
                 +-- KV events (ZMQ, vLLM's format) from every engine and kvstore-server, replayed on start

For each request the router tokenizes the prompt as the engines do (`--model`: the same model
directory, for its tokenizer, chat template and the store's chunk keys), looks up how much of it each
engine holds and how much the store holds (kvstore.engine.router.index), scores the engines and forwards the
request through the proxy's `forward` (one place forwards OpenAI requests). With
`--prefill`/`--decode` instead of `--engine` it is the disaggregated proxy (kvstore.engine.proxy).

Model names, as a vLLM / production-stack client expects: the router learns the names each engine
serves from its GET /v1/models (at start, at every calibration probe, and again when a request names a
model it does not know) and answers GET /v1/models with them. A request's "model" may be one of those
names (it goes, unchanged, to an engine that serves it), the router's own `--model` (an alias: the
chosen engine's served name replaces it, e.g. "smollm2" -> "SmolLM2-135M-Instruct") or absent
(unchanged); any other name is the router's own 404, in the engines' error shape, forwarded to no
one and counted nowhere. A request counts as routed (kvstore_router_decisions, its prompt tokens as
local / remote / computed) only when its engine accepted it (status below 400); an engine's error
answer is counted in kvstore_router_engine_errors instead.

The front door (kvstore.engine.gateway.FrontDoor: kvstore-server's connection cap, header / body / idle
deadlines, its cross-origin rules): a body over the engines' limit (8 MiB) is a 413 before a byte of
it is read, and the bodies being read or routed hold at most `body_budget_bytes` (503 past it). A body
is parsed, checked and tokenized in a small pool of threads (`prep_workers`, `prep_queue` waiting:
503 past them), never in the event loop, and only its leading `route_tokens` tokens are routed on
(kvstore.engine.router.tokens), so a prompt of megabytes costs what one of kilobytes does. The body
goes to the engine as it came (re-encoded only to replace the model alias).

A hung engine is passed over: a streamed request whose engine has not begun its answer within
`first_byte_timeout_s` (its first token), or any request waiting on an engine whose health probe
(GET /health every `health_interval_s`, `health_timeout_s` to answer) fails, goes to the next engine
(504 when none is left), and the engine is not chosen again until its probe answers. Each engine's share
of the work, which ttft's hot-spot cost prices, counts its requests in flight and those it completed
recently, so a request that never completes keeps counting against its engine (a window of decisions
forgot it and sent more). An
engine URL may carry credentials (http://user:pass@host): they are sent to it and shown nowhere (the
engine's name everywhere is its URL without them).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
from aiohttp import web
from kvstore.engine.errors import InvalidRequest
from kvstore.engine.gateway import (
    DOOR_KEY,
    BadGateway,
    Busy,
    DoorCounters,
    EngineHung,
    EngineUnreachable,
)
from kvstore.engine.proxy import CONFIG_KEY, INFLIGHT_KEY, SESSION_KEY, forward
from kvstore.engine.router.dashboard import dashboard
from kvstore.engine.router.router import (
    DOWN_S,
    Prepared,
    Router,
    RouterConfig,
)
from kvstore.engine.router.scoring import POLICIES, Choice
from kvstore.engine.router.tokens import PromptTokens
from kvstore.engine.server_middleware import (
    MAX_BODY_BYTES,
    MAX_BODY_KEY,
    browser_guard,
    check_length,
    errors_middleware,
    host_check,
    parse_json,
    read_body,
    unless_disconnected,
)

from kvstore.errors import Busy as BudgetFull

logger = logging.getLogger(__name__)
ROUTER_KEY = web.AppKey("router", object)
ENGINE_HEADER = "X-KVStore-Engine"  # on every routed response: the engine that served it
POLICY_HEADER = "X-KVStore-Policy"  # a request's own policy (A/B runs, benchmarks/bench_router.py)
DECISION_HEADER = "X-KVStore-Decision"  # on every routed response: why that engine (JSON, decision_record)


def _prepare(router: Router, raw: bytes, chat: bool, served: frozenset[str]) -> Prepared:
    """In the prep pool: parse and check the body, read its leading tokens and their chunk keys, and
    encode it with each of `served` in place of the router's alias when it names the alias."""
    body = parse_json(raw)
    tokens = router.tokens
    prompt = tokens.of_chat(body) if chat else tokens.of_completion(body)
    keys = tokens.chunk_keys(prompt.tokens) if prompt and prompt.tokens else []
    model = body.get("model")
    alias = router.config.model
    aliased = {}
    if alias and model == alias and alias not in served:
        aliased = {name: json.dumps({**body, "model": name}).encode() for name in served}
    return Prepared(model, bool(body.get("stream")), prompt, keys, aliased)


async def _route(request: web.Request, path: str, chat: bool) -> web.StreamResponse:
    router: Router = request.app[ROUTER_KEY]
    inflight = request.app[INFLIGHT_KEY]
    task = asyncio.current_task()
    inflight.add(task)
    started = time.monotonic()
    try:
        policy = request.headers.get(POLICY_HEADER)
        if policy is not None and policy not in POLICIES:
            raise InvalidRequest(f"{POLICY_HEADER} must be one of {', '.join(POLICIES)}, got {policy!r}")
        check_length(request)  # 413 before anything is held for it
        try:  # what reading, parsing and routing the body holds at most: 2x its bytes
            router.budget.reserve(request, 2 * (request.content_length or request.app[MAX_BODY_KEY]))
        except BudgetFull as e:
            raise Busy(str(e)) from None
        raw = await read_body(request, router.config.door.body_timeout_s)
        served = frozenset(names[0] for names in map(router.served, router.loads) if names)
        prep = await router.prep.run(_prepare, router, raw, chat, served)
        model = prep.model
        target = router.engines_for(model)
        unknown = target is None or (model is not None and not any(router.cards.values()))
        if unknown and router.models_stale(time.monotonic()):  # not read yet, or an engine changed model
            await router.read_models(request.app[SESSION_KEY])
            target = router.engines_for(model)
        if target is None:
            raise router.model_not_found(model)
        among, alias = target
        token_ids, total = (prep.prompt.tokens, prep.prompt.total) if prep.prompt else (None, None)
        problems, hung = [], False
        for _ in among:  # an engine that never got the request, or never began its answer: the next one
            choice = router.decide(token_ids, policy, time.monotonic(), among, total, prep.keys)
            sent = _engine_body(router, raw, prep, choice.engine, alias)
            try:
                return await _send(request, router, path, sent, choice, started, prep.stream)
            except EngineUnreachable as e:
                router.mark_down(choice.engine, "it refused a connection", DOWN_S)
                problems.append(str(e))
            except EngineHung as e:
                router.mark_down(choice.engine, str(e), DOWN_S)
                problems.append(str(e))
                hung = True
        raise (EngineHung if hung else BadGateway)("; ".join(problems))
    finally:
        router.budget.release(request)
        inflight.discard(task)


def _engine_body(router: Router, raw: bytes, prep: Prepared, url: str, alias: bool) -> bytes:
    """The body the engine at `url` gets: as it came, or with the alias replaced by its served name."""
    names = router.served(url)
    if not alias or not names:
        return raw
    body = prep.aliased.get(names[0])
    if body is None:  # the engine's name changed since the prep: encode it here (rare)
        body = json.dumps({**parse_json(raw), "model": names[0]}).encode()
    return body


async def _send(
    request: web.Request,
    router: Router,
    path: str,
    body: bytes,
    choice: Choice,
    started: float,
    streamed: bool,
) -> web.StreamResponse:
    headers = {ENGINE_HEADER: choice.engine, DECISION_HEADER: json.dumps(router.decision_record(choice))}
    pending = router.add_load(choice)
    status: int | None = None

    def first(code: int) -> None:
        nonlocal pending
        router.decider.computed(choice.engine, pending)
        pending = 0
        if streamed and code == 200:
            router.metrics.first_token(choice, time.monotonic() - started)

    def answered(code: int) -> None:
        nonlocal status
        status = code
        router.answered(choice, code)

    first_byte = router.config.first_byte_timeout_s if streamed else None
    try:
        return await unless_disconnected(
            request,
            forward(request, path, body, router.config.address[choice.engine], "engine", first, headers,
                    answered, first_byte, router.abandon(choice.engine)),
        )  # fmt: skip
    finally:
        router.decider.computed(choice.engine, pending)
        router.finished(choice, status)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _route(request, "/v1/completions", chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _route(request, "/v1/chat/completions", chat=True)


async def models(request: web.Request) -> web.Response:
    """The models the engines serve, from their own GET /v1/models (read again when none is known)."""
    router: Router = request.app[ROUTER_KEY]
    if not router.model_cards():
        await router.read_models(request.app[SESSION_KEY])
    cards = router.model_cards()
    if not cards:
        raise BadGateway("no engine answered GET /v1/models: " + ", ".join(router.config.engines))
    return web.json_response({"object": "list", "data": cards})


async def health(request: web.Request) -> web.Response:
    router: Router = request.app[ROUTER_KEY]
    if not router.subscriber.ready.is_set():
        return web.json_response({"status": "replaying KV events"}, status=503)
    if not router.subscriber.alive:
        return web.json_response({"status": "the KV events thread has stopped"}, status=503)
    return web.json_response({"status": "ok"})


async def state(request: web.Request) -> web.Response:
    return web.json_response(request.app[ROUTER_KEY].state(time.monotonic()))


async def metrics(request: web.Request) -> web.Response:
    router: Router = request.app[ROUTER_KEY]
    now = time.monotonic()
    for url, load in router.loads.items():
        router.metrics.set_load(url, load.in_flight, load.waiting_tokens, load.down_until <= now)
    router.metrics.set_costs(router.calibrator.costs)
    return web.Response(body=router.metrics.render(), content_type="text/plain")


async def _calibrate(app: web.Application) -> None:
    router: Router = app[ROUTER_KEY]
    session: aiohttp.ClientSession = app[SESSION_KEY]
    timeout = aiohttp.ClientTimeout(total=2)
    while True:
        await asyncio.sleep(router.config.calibrate_s)
        await router.read_models(session)
        for url in router.config.engines:
            try:
                async with session.get(router.config.address[url] + "/metrics", timeout=timeout) as resp:
                    if resp.status == 200:
                        router.calibrator.observe(url, await resp.text())
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                logger.debug("calibration: %s/metrics: %r", url, e)


async def probe(router: Router, session: aiohttp.ClientSession, url: str) -> None:
    """One health probe of `url`: 200 puts it up; another status puts it down (an engine draining
    finishes what it has); no answer within health_timeout_s puts it down and sends the requests
    waiting for its first bytes elsewhere."""
    timeout = aiohttp.ClientTimeout(total=router.config.health_timeout_s)
    try:
        async with session.get(router.config.address[url] + "/health", timeout=timeout) as resp:
            if resp.status == 200:
                router.mark_up(url)
            else:
                router.mark_down(url, f"its health probe answered HTTP {resp.status}")
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        why = "refused" if isinstance(e, aiohttp.ClientConnectorError) else "got no answer"
        router.mark_down(
            url, f"its health probe {why} (within {router.config.health_timeout_s:g} s)", abandon=True
        )


async def _probe(app: web.Application) -> None:
    router: Router = app[ROUTER_KEY]
    while True:
        await asyncio.gather(*(probe(router, app[SESSION_KEY], u) for u in router.config.engines))
        await asyncio.sleep(router.config.health_interval_s)


def build_router_app(config: RouterConfig, tokens: PromptTokens) -> web.Application:
    door = config.door
    guard = browser_guard(host_check(door.allowed_hosts, door.host))
    app = web.Application(middlewares=[errors_middleware, guard], client_max_size=MAX_BODY_BYTES)
    router = Router(config, tokens)
    door.counters = DoorCounters(router.metrics.registry)
    app[ROUTER_KEY] = router
    app[CONFIG_KEY] = config
    app[DOOR_KEY] = door
    app[MAX_BODY_KEY] = MAX_BODY_BYTES
    app[INFLIGHT_KEY] = set()
    tasks: list[asyncio.Task] = []

    async def on_startup(_: web.Application) -> None:
        app[SESSION_KEY] = aiohttp.ClientSession(timeout=config.timeout)
        router.subscriber.start()
        tasks.append(asyncio.create_task(router.read_models(app[SESSION_KEY])))
        if config.calibrate_s > 0:
            tasks.append(asyncio.create_task(_calibrate(app)))
        if config.health_interval_s > 0:
            tasks.append(asyncio.create_task(_probe(app)))

    async def on_cleanup(_: web.Application) -> None:
        for t in tasks:
            t.cancel()
        router.stop_reading()
        router.subscriber.stop()
        router.prep.close()
        await app[SESSION_KEY].close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/router/state", state)
    app.router.add_get("/dashboard", dashboard)
    return app
