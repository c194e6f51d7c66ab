"""The router's state and choices behind its HTTP routes (app.py): its settings (`RouterConfig`), the
engines' served model names, the decision core (decision.Decider) with the router's logging and
metrics, engines passed over, and the pool that parses and tokenizes prompts off the event loop."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from kvstore.engine.errors import InvalidRequest, ModelNotFound
from kvstore.engine.gateway import (
    Busy,
    FrontDoor,
    between_bytes,
    redact,
)
from kvstore.engine.router.calibrate import Calibrator
from kvstore.engine.router.decision import Decider, EngineLoad
from kvstore.engine.router.index import PrefixIndex
from kvstore.engine.router.metrics import RouterMetrics
from kvstore.engine.router.scoring import Choice, Request
from kvstore.engine.router.subscriber import EventSubscriber, FeedCollector, FeedOptions, Source
from kvstore.engine.router.tokens import Prompt, PromptTokens
from kvstore.engine.server_middleware import (
    MAX_BODY_BYTES,
)

from kvstore.events import curve_server_key
from kvstore.front_door.budget import BodyBudget

logger = logging.getLogger(__name__)
DOWN_S = 5.0  # an engine that refused a connection, or began no answer in time, is passed over this long
MODELS_TIMEOUT_S = 2.0  # an engine's GET /v1/models
MODELS_REFRESH_S = 1.0  # a request naming an unknown model re-reads the engines' names at most this often


@dataclass
class RouterConfig:
    engines: list[str]
    engine_events: list[str]
    engine_replay: list[str | None]
    store_events: list[str] = field(default_factory=list)
    store_replay: list[str | None] = field(default_factory=list)
    policy: str = "ttft"
    max_share: float | None = None  # ttft: a share cap on top of the hot-spot cost (None: none)
    share_window: int = (
        64  # completed requests per engine a share (hot-spot cost, --max-share) looks back over
    )
    calibrate_s: float = 2.0  # between scrapes of the engines' /metrics (0: never)
    timeout_s: float = 600.0  # the longest silence of an engine answering (between bytes)
    topic: str = ""
    model: str = ""  # the router's --model: an alias of the engines' served name ("" for none)
    events: FeedOptions = field(default_factory=FeedOptions)  # tokens, frame and index caps, checks
    first_byte_timeout_s: float = 30.0  # a streamed answer's first bytes (its first token)
    health_interval_s: float = 2.0  # between health probes of each engine (0: never)
    health_timeout_s: float = 2.0  # for an engine to answer GET /health
    prep_workers: int = 2  # threads parsing and tokenizing bodies
    prep_queue: int = 64  # bodies waiting for them; beyond, a 503
    body_budget_bytes: int = 256 * 2**20  # request body bytes read or routed at once (2x each); beyond, a 503
    door: FrontDoor = field(default_factory=FrontDoor)

    def __post_init__(self) -> None:
        urls = [u.rstrip("/") for u in self.engines]
        if not urls:
            raise ValueError("the router needs at least one --engine URL")
        self.engines = [redact(u) for u in urls]  # names: what headers, state, metrics and logs show
        self.address = dict(zip(self.engines, urls, strict=True))  # name -> URL (with its credentials)
        if len(self.address) != len(urls):
            raise ValueError("two --engine URLs name the same engine")
        if (
            min(self.timeout_s, self.first_byte_timeout_s, self.health_timeout_s) <= 0
            or self.health_interval_s < 0
        ):
            raise ValueError("--timeout, --first-byte-timeout and --health-timeout must be positive")
        if self.prep_workers < 1 or self.prep_queue < 0:
            raise ValueError("--prep-workers must be at least 1, --prep-queue at least 0")
        if self.body_budget_bytes < 2 * MAX_BODY_BYTES:
            raise ValueError(f"--max-body-bytes-in-flight must be at least {2 * MAX_BODY_BYTES} (two bodies)")
        if len(self.engine_events) != len(self.engines):
            raise ValueError("give one --engine-events endpoint per --engine, in the same order")
        self.engine_replay = (list(self.engine_replay) + [None] * len(self.engines))[: len(self.engines)]
        self.store_replay = (list(self.store_replay) + [None] * len(self.store_events))[
            : len(self.store_events)
        ]
        self.timeout = between_bytes(self.timeout_s)


@dataclass
class Prepared:
    """What the router reads of a body (in its prep pool): never the parsed body itself."""

    model: Any
    stream: bool
    prompt: Prompt | None  # the leading tokens routed on, and the prompt's length
    keys: list[bytes]  # the chunk keys of those tokens
    aliased: dict[str, bytes]  # served name -> the body with it in place of the router's alias


class Prep:
    """The bounded pool that parses, checks and tokenizes bodies off the event loop: `workers`
    threads, `queue` bodies waiting; a body past them is a 503 at once."""

    def __init__(self, workers: int, queue: int) -> None:
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="router-prep")
        self.limit = workers + queue
        self.admitted = 0

    async def run(self, fn: Any, *args: Any) -> Any:
        if self.admitted >= self.limit:
            raise Busy(f"{self.admitted} request bodies are being routed already; retry in a moment")
        self.admitted += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        finally:
            self.admitted -= 1

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class Router:
    """The decision state: index, costs and the decision core (kvstore.engine.router.decision: loads,
    recent decisions, the turn; the simulator's too). Used from the event loop only, except the index
    (the event thread feeds it)."""

    def __init__(self, config: RouterConfig, tokens: PromptTokens) -> None:
        self.config = config
        self.tokens = tokens
        self.index = PrefixIndex(config.events.max_engine_blocks, config.events.max_store_keys)
        self.metrics = RouterMetrics(config.engines, config.policy)
        self.calibrator = Calibrator()
        self.decider = Decider(config.engines, config.policy, config.share_window, config.max_share)
        self.loads: dict[str, EngineLoad] = self.decider.loads
        self.gone: dict[str, asyncio.Future] = {}  # engine -> done when its probe fails (see `abandon`)
        self.prep = Prep(config.prep_workers, config.prep_queue)
        self.budget = BodyBudget(config.body_budget_bytes)
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
                async with session.get(self.config.address[url] + "/v1/models", timeout=timeout) as resp:
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
        prompt_tokens: int | None = None,
        keys: list[bytes] | None = None,
    ) -> Choice:
        """Choose an engine (of `among`, every engine by default) for a prompt starting with
        `token_ids` (`prompt_tokens` long in all, its chunk `keys` when computed already). It counts
        in its engine's share once sent (`add_load`), in the metrics once the engine accepts it (`answered`)."""
        if not token_ids:
            return self.decider.decide(Request(1), self.calibrator.costs, None, policy, now, among)
        keys = self.tokens.chunk_keys(token_ids) if keys is None else keys
        store = self.index.store_chunks(keys) * self.tokens.chunk_size
        request = Request(max(prompt_tokens or 0, len(token_ids)), store)

        def local(url: str) -> int:
            return self.index.local_tokens(url, token_ids)

        return self.decider.decide(request, self.calibrator.costs, local, policy, now, among)

    def answered(self, choice: Choice, status: int) -> None:
        """The engine answered `choice`'s request with `status`: below 400 it is a routed request
        (decisions, prompt tokens by source, predicted TTFT); an error answer is counted as one."""
        if status < 400:
            self.metrics.decided(choice)
        else:
            self.metrics.engine_error(choice.engine, status)

    def add_load(self, choice: Choice) -> int:
        """Count `choice` in its engine's load: one more in flight (in its share too), and its tokens
        to compute waiting (not those it loads from the store: a load runs beside the engine's steps,
        queueing no one). Returns the waiting tokens added, which the caller takes off at the first
        token; `finished` takes the request off again."""
        return self.decider.add_load(choice)

    def finished(self, choice: Choice, status: int | None) -> None:
        """`choice`'s request is over: it leaves the engine's load; an answer below 400 joins the share
        cap's recent completions (an error, a failover, a hang did no work worth counting)."""
        self.decider.finished(choice.engine, choice.policy, status is not None and status < 400)

    # ---- engines up and down ---------------------------------------------------------------------
    def mark_down(self, url: str, why: str, for_s: float = math.inf, abandon: bool = False) -> None:
        """Pass `url` over for `for_s` seconds (inf: till its probe answers); `abandon`: the requests
        waiting for it to begin an answer go elsewhere now (a probe that got no answer)."""
        now = time.monotonic()
        if self.decider.mark_down(url, why, now + for_s, now):
            logger.warning("engine %s passed over: %s", url, why)
        if abandon:
            gone = self.gone.pop(url, None)
            if gone is not None and not gone.done():
                gone.set_result(None)

    def mark_up(self, url: str) -> None:
        """Its probe answered: chosen again (a timed pass-over still runs out first)."""
        if self.decider.mark_up(url):
            logger.warning("engine %s is back (its health probe answers)", url)

    def abandon(self, url: str) -> asyncio.Future:
        """Done when `url`'s probe fails: what a request waiting for its first bytes also waits on."""
        gone = self.gone.get(url)
        if gone is None or gone.done():
            gone = self.gone[url] = asyncio.get_running_loop().create_future()
        return gone

    def decision_record(self, choice: Choice) -> dict[str, Any]:
        """What the router knew when it chose: the estimate, the prompt's split, every engine's load
        (before this request was added) and estimate, the engines passed over as hot."""
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
            "routing": {"prep_admitted": self.prep.admitted, "body_bytes": self.budget.used},
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
        down = {"down_until": min(load.down_until, 1e18)}  # JSON has no infinity
        return {**vars(load), **down, "up": load.down_until <= now, **self.metrics.summary(url)}
