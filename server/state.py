"""What every handler shares: the store, the configs, metrics, history, and how store calls run."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import web
from kvstore.server.config import ServerConfig
from kvstore.server.history import StatsHistory
from kvstore.server.metrics import ServerMetrics

from kvstore.config import StoreConfig
from kvstore.front_door.budget import BodyBudget
from kvstore.tier_registry import tier_spec

if TYPE_CHECKING:  # imported for its type only: it imports torch, and `kvstore-server --help` stays fast
    from kvstore.store import TieredStore

T = TypeVar("T")


@dataclass
class ServerState:
    store: TieredStore  # the store every handler calls (server/runner.py open_store)
    store_config: StoreConfig
    config: ServerConfig
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    history: StatsHistory | None = None
    executor: ThreadPoolExecutor | None = None

    def __post_init__(self) -> None:
        self.budget = BodyBudget(self.config.max_body_bytes_in_flight)
        self.metrics.body_bytes = lambda: self.budget.used
        if self.history is None:
            self.history = StatsHistory(self.config.history_size, self.config.engine_metrics)
        # Memory-only stores answer in microseconds: calling them inline beats a thread hop. A store with
        # a tier that is durable or shared (disk, Redis, fs: kvstore.tier_registry) may block, so its
        # calls run on threads and the event loop keeps serving.
        self.inline = all(tier_spec(name).in_memory for name in self.store_config.tiers)
        if not self.inline and self.executor is None:
            self.executor = ThreadPoolExecutor(self.config.store_threads, thread_name_prefix="kvstore-store")

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        if self.inline:
            return fn(*args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args))

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True)


STATE = web.AppKey("state", ServerState)
SAMPLER = web.AppKey("sampler", asyncio.Task)
DATAPLANE: Any = web.AppKey("dataplane", object)  # kvstore.server.dataplane.DataPlane, or None when it is off
# Body bytes received / sent, for the metrics middleware (typed keys since aiohttp 3.12; plain before).
_RequestKey = getattr(web, "RequestKey", None)
BYTES_IN: Any = _RequestKey("bytes_in", int) if _RequestKey else "kvstore_bytes_in"
BYTES_OUT: Any = _RequestKey("bytes_out", int) if _RequestKey else "kvstore_bytes_out"
