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
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from kvstore.engine.errors import InvalidRequest, ModelNotFound
from kvstore.engine.proxy import CONFIG_KEY, INFLIGHT_KEY, SESSION_KEY, BadGateway, EngineUnreachable, forward
from kvstore.engine.router.calibrate import Calibrator
from kvstore.engine.router.dashboard import dashboard
from kvstore.engine.router.index import PrefixIndex
from kvstore.engine.router.metrics import RouterMetrics
from kvstore.engine.router.scoring import POLICIES, Choice, EngineState, Request, choose
from kvstore.engine.router.subscriber import EventSubscriber, FeedCollector, FeedOptions, Source
from kvstore.engine.router.tokens import PromptTokens
from kvstore.engine.server_middleware import MAX_BODY_KEY, errors_middleware, parse_json, unless_disconnected

from kvstore.events import curve_server_key

logger = logging.getLogger(__name__)
ROUTER_KEY = web.AppKey("router", object)
ENGINE_HEADER = "X-KVStore-Engine"  # on every routed response: the engine that served it
DOWN_S = 5.0  # an engine that refused a connection is passed over this long
POLICY_HEADER = "X-KVStore-Policy"  # a request's own policy (A/B runs, benchmarks/bench_router.py)
DECISION_HEADER = "X-KVStore-Decision"  # on every routed response: why that engine (JSON, decision_record)
_MAX_BODY_BYTES = 64 * 2**20
MODELS_TIMEOUT_S = 2.0  # an engine's GET /v1/models
MODELS_REFRESH_S = 1.0  # a request naming an unknown model re-reads the engines' names at most this often


@dataclass
class EngineLoad:
    url: str
    in_flight: int = 0  # requests this router forwarded to it and not finished
    waiting_tokens: int = 0  # of those, prompt tokens it is to compute before their first token
    down_until: float = 0.0  # monotonic time; after a refused connection it is not chosen till then


@dataclass
class RouterConfig:
    engines: list[str]
    engine_events: list[str]
    engine_replay: list[str | None]
    store_events: list[str] = field(default_factory=list)
    store_replay: list[str | None] = field(default_factory=list)
    policy: str = "ttft"
    max_share: float = 1.2
    share_window: int = 64  # decisions per engine the share cap looks back over
    calibrate_s: float = 2.0  # between scrapes of the engines' /metrics (0: never)
    timeout_s: float = 600.0
    topic: str = ""
    model: str = ""  # the router's --model: an alias of the engines' served name ("" for none)
    events: FeedOptions = field(default_factory=FeedOptions)  # tokens, frame and index caps, checks

    def __post_init__(self) -> None:
        self.engines = [u.rstrip("/") for u in self.engines]
        if not self.engines:
            raise ValueError("the router needs at least one --engine URL")
        if len(self.engine_events) != len(self.engines):
            raise ValueError("give one --engine-events endpoint per --engine, in the same order")
        self.engine_replay = (list(self.engine_replay) + [None] * len(self.engines))[: len(self.engines)]
        self.store_replay = (list(self.store_replay) + [None] * len(self.store_events))[
            : len(self.store_events)
        ]
        self.timeout = aiohttp.ClientTimeout(total=self.timeout_s)


class Router:
    """The decision state: index, loads, recent decisions, costs. Used from the event loop only,
    except the index (the event thread feeds it)."""

    def __init__(self, config: RouterConfig, tokens: PromptTokens) -> None:
        self.config = config
        self.tokens = tokens
        self.index = PrefixIndex(config.events.max_engine_blocks, config.events.max_store_keys)
        self.metrics = RouterMetrics(config.engines, config.policy)
        self.calibrator = Calibrator()
        self.loads = {u: EngineLoad(u) for u in config.engines}
        window = config.share_window * len(config.engines)
        self.recent = collections.defaultdict(lambda: collections.deque(maxlen=window))  # per policy
        self.turn = 0
        self.cards: dict[str, list[dict[str, Any]]] = {u: [] for u in config.engines}  # GET /v1/models
        self.models_read_at = -float("inf")  # monotonic time the last read of the engines' names ended
        self._reading: asyncio.Future | None = None  # the read in progress: callers share it
        engine_key, store_key = (curve_server_key(t) if t else None
                                 for t in (config.events.engine_token, config.events.store_token))  # fmt: skip
        sources = [
            Source(url, ev, rp, self.index.apply_engine, config.topic, engine_key)
            for url, ev, rp in zip(config.engines, config.engine_events, config.engine_replay, strict=True)
        ]
        sources += [
            Source(f"store{i}", ev, rp, self.index.apply_store, config.topic, store_key)
            for i, (ev, rp) in enumerate(zip(config.store_events, config.store_replay, strict=True))
        ]
        self.subscriber = EventSubscriber(sources, config.events)
        self.metrics.registry.register(FeedCollector(self.subscriber, self.index))

    def served(self, url: str) -> list[str]:
        """The model names the engine at `url` serves, as its last GET /v1/models said ([] if never)."""
        return [c["id"] for c in self.cards[url]]

    def model_cards(self) -> list[dict[str, Any]]:
        """Every engine's model cards, one per name, in --engine order: the router's GET /v1/models."""
        seen: dict[str, dict[str, Any]] = {}
        for cards in self.cards.values():
            for card in cards:
                seen.setdefault(card["id"], card)
        return list(seen.values())

    def learn_models(self, url: str, payload: Any) -> None:
        """Keep the model cards of the engine at `url` from its GET /v1/models answer."""
        data = payload.get("data") if isinstance(payload, dict) else None
        cards = [c for c in data or [] if isinstance(c, dict) and isinstance(c.get("id"), str)]
        if not cards:
            raise ValueError(f"{url}/v1/models lists no model")
        if [c["id"] for c in cards] != self.served(url):
            logger.info("engine %s serves %s", url, ", ".join(repr(c["id"]) for c in cards))
        self.cards[url] = cards

    def models_stale(self, now: float) -> bool:
        """Whether the engines' names may be read again: a read is in progress (join it) or the last
        one ended over MODELS_REFRESH_S ago."""
        reading = self._reading is not None and not self._reading.done()
        return reading or now - self.models_read_at >= MODELS_REFRESH_S

    async def read_models(self, session: aiohttp.ClientSession) -> None:
        """Ask every engine for the names it serves (GET /v1/models); one that does not answer keeps
        the names it last gave. Concurrent callers share one read."""
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self._read_models(session))
        await asyncio.shield(self._reading)

    def stop_reading(self) -> None:
        if self._reading is not None:
            self._reading.cancel()

    async def _read_models(self, session: aiohttp.ClientSession) -> None:
        timeout = aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S)

        async def one(url: str) -> None:
            try:
                async with session.get(url + "/v1/models", timeout=timeout) as resp:
                    if resp.status == 200:
                        self.learn_models(url, await resp.json(content_type=None))
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                logger.debug("models: %s/v1/models: %r", url, e)

        try:
            await asyncio.gather(*(one(u) for u in self.config.engines))
        finally:
            self.models_read_at = time.monotonic()

    def engines_for(self, model: Any) -> tuple[list[str], bool] | None:
        """The engines a request naming `model` may go to, and whether its model is the alias to
        rewrite; None when no engine is known to serve it (a 404). A request with no model, or any
        request while no engine has said what it serves, may go to every engine, unchanged."""
        every = list(self.loads)
        if model is None or not any(self.cards.values()):
            return every, False
        if not isinstance(model, str):
            raise InvalidRequest("'model' must be a string", param="model")
        serving = [u for u in every if model in self.served(u)]
        if serving:
            return serving, False
        if self.config.model and model == self.config.model:
            return every, True
        return None

    def model_not_found(self, model: str) -> ModelNotFound:
        names = [c["id"] for c in self.model_cards()]
        alias = f" (or the router's alias {self.config.model!r})" if self.config.model else ""
        return ModelNotFound(
            f"the model {model[:100]!r} does not exist; the engines serve "
            f"{', '.join(map(repr, names))}{alias}",
            param="model",
        )

    def engine_body(self, body: dict, url: str, alias: bool) -> dict:
        """The body the engine at `url` gets: the alias replaced by its served name."""
        names = self.served(url)
        return {**body, "model": names[0]} if alias and names else body

    def decide(
        self,
        token_ids: list[int] | None,
        policy: str | None = None,
        now: float = 0.0,
        among: list[str] | None = None,
    ) -> Choice:
        """Choose an engine (of `among`, every engine by default). It is counted in the share cap's
        window now; in the metrics once the engine accepts the request (`answered`)."""
        policy = policy or self.config.policy
        recent = self.recent[policy]
        counts = collections.Counter(recent)
        if token_ids:
            keys = self.tokens.chunk_keys(token_ids)
            store = self.index.store_chunks(keys) * self.tokens.chunk_size
            request = Request(len(token_ids), store)
        else:
            request = Request(1)
        engines = [
            EngineState(
                url,
                self.index.local_tokens(url, token_ids) if token_ids else 0,
                load.in_flight,
                load.waiting_tokens,
                counts[url],
            )
            for url, load in self.loads.items()
            if load.down_until <= now and (among is None or url in among)
        ] or [EngineState(url, recent=counts[url]) for url in among or self.loads]  # all down: try them all
        choice = choose(policy, engines, request, self.calibrator.costs, self.config.max_share, self.turn)
        self.turn += 1
        recent.append(choice.engine)
        return choice

    def answered(self, choice: Choice, status: int) -> None:
        """The engine answered `choice`'s request with `status`: below 400 it is a routed request
        (decisions, prompt tokens by source, predicted TTFT); an error answer is counted as one and
        leaves the share cap's window (the engine did no work for it)."""
        if status < 400:
            self.metrics.decided(choice)
            return
        self.metrics.engine_error(choice.engine, status)
        try:
            self.recent[choice.policy].remove(choice.engine)
        except ValueError:  # the window moved past it already
            pass

    def add_load(self, choice: Choice) -> int:
        """Count `choice` in its engine's load: one more in flight, and its tokens to compute waiting
        (not those it loads from the store: a load runs beside the engine's steps, queueing no one).
        Returns the waiting tokens added, which the caller takes off at the first token."""
        load = self.loads[choice.engine]
        load.in_flight += 1
        load.waiting_tokens += choice.compute_tokens
        return choice.compute_tokens

    def decision_record(self, choice: Choice) -> dict[str, Any]:
        """What the router knew when it chose: the estimate, the prompt's split, every engine's load
        (before this request was added) and estimate, the engines the share cap passed over."""
        return {
            "policy": choice.policy,
            "predicted_ttft_s": round(choice.predicted_ttft_s, 6),
            "local_tokens": choice.local_tokens,
            "store_tokens": choice.store_tokens,
            "compute_tokens": choice.compute_tokens,
            "loads": {u: [ld.in_flight, ld.waiting_tokens] for u, ld in self.loads.items()},
            "estimates": {u: round(t, 6) for u, t in choice.estimates.items()},
            "capped": list(choice.capped),
            "costs": vars(self.calibrator.costs),
        }

    def state(self, now: float) -> dict[str, Any]:
        return {
            "policy": self.config.policy,
            "ready": self.subscriber.ready.is_set(),
            "index": self.index.stats(),
            "sources": {s.name: s.state() for s in self.subscriber.sources},
            "costs": vars(self.calibrator.costs),
            "engines": {u: self.engine_state(u, now) for u in self.loads},
        }

    def engine_state(self, url: str, now: float) -> dict[str, Any]:
        """One engine's load (`url`, `in_flight`, `waiting_tokens`, `down_until`, `up`) and its figures
        (kvstore.engine.router.metrics.EngineTally.summary): the dashboard's panel."""
        load = self.loads[url]
        return {**vars(load), "up": load.down_until <= now, **self.metrics.summary(url)}


async def _route(request: web.Request, path: str, chat: bool) -> web.StreamResponse:
    router: Router = request.app[ROUTER_KEY]
    inflight = request.app[INFLIGHT_KEY]
    task = asyncio.current_task()
    inflight.add(task)
    started = time.monotonic()
    try:
        body = parse_json(await request.read())
        if not isinstance(body, dict):
            raise InvalidRequest("the request body must be a JSON object")
        policy = request.headers.get(POLICY_HEADER)
        if policy is not None and policy not in POLICIES:
            raise InvalidRequest(f"{POLICY_HEADER} must be one of {', '.join(POLICIES)}, got {policy!r}")
        model = body.get("model")
        target = router.engines_for(model)
        unknown = target is None or (model is not None and not any(router.cards.values()))
        if unknown and router.models_stale(time.monotonic()):  # not read yet, or an engine changed model
            await router.read_models(request.app[SESSION_KEY])
            target = router.engines_for(model)
        if target is None:
            raise router.model_not_found(model)
        among, alias = target
        token_ids = router.tokens.of_chat(body) if chat else router.tokens.of_completion(body)
        streamed = bool(body.get("stream"))
        problems = []
        for _ in among:  # an engine that refuses the connection never got it: the next one may
            choice = router.decide(token_ids, policy, time.monotonic(), among)
            sent = router.engine_body(body, choice.engine, alias)
            try:
                return await _send(request, router, path, sent, choice, started, streamed)
            except EngineUnreachable as e:
                router.loads[choice.engine].down_until = time.monotonic() + DOWN_S
                problems.append(str(e))
        raise BadGateway("; ".join(problems))
    finally:
        inflight.discard(task)


async def _send(
    request: web.Request,
    router: Router,
    path: str,
    body: dict,
    choice: Choice,
    started: float,
    streamed: bool,
) -> web.StreamResponse:
    load = router.loads[choice.engine]
    headers = {ENGINE_HEADER: choice.engine, DECISION_HEADER: json.dumps(router.decision_record(choice))}
    pending = router.add_load(choice)

    def first(status: int) -> None:
        nonlocal pending
        load.waiting_tokens -= pending
        pending = 0
        if streamed and status == 200:
            router.metrics.first_token(choice, time.monotonic() - started)

    try:
        return await unless_disconnected(
            request,
            forward(request, path, body, choice.engine, "engine", first, headers,
                    lambda status: router.answered(choice, status)),
        )  # fmt: skip
    finally:
        load.in_flight -= 1
        load.waiting_tokens -= pending


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
                async with session.get(url + "/metrics", timeout=timeout) as resp:
                    if resp.status == 200:
                        router.calibrator.observe(url, await resp.text())
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                logger.debug("calibration: %s/metrics: %r", url, e)


def build_router_app(config: RouterConfig, tokens: PromptTokens) -> web.Application:
    app = web.Application(middlewares=[errors_middleware], client_max_size=_MAX_BODY_BYTES)
    router = Router(config, tokens)
    app[ROUTER_KEY] = router
    app[CONFIG_KEY] = config
    app[MAX_BODY_KEY] = _MAX_BODY_BYTES
    app[INFLIGHT_KEY] = set()
    tasks: list[asyncio.Task] = []

    async def on_startup(_: web.Application) -> None:
        app[SESSION_KEY] = aiohttp.ClientSession(timeout=config.timeout)
        router.subscriber.start()
        tasks.append(asyncio.create_task(router.read_models(app[SESSION_KEY])))
        if config.calibrate_s > 0:
            tasks.append(asyncio.create_task(_calibrate(app)))

    async def on_cleanup(_: web.Application) -> None:
        for t in tasks:
            t.cancel()
        router.stop_reading()
        router.subscriber.stop()
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
