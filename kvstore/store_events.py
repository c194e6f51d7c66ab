"""A kvstore-server's KV events: its tiers' stored and removed chunks as vLLM KV events (kvstore.events
has the wire format, the publisher and its options), with the token ids their writers gave
(kvstore.token_hints) so that an indexer keyed by tokens (Dynamo's, llm-d's) indexes them."""

from __future__ import annotations

import logging
import threading
from array import array
from collections.abc import Mapping
from itertools import count
from typing import Any

from kvstore.events import (
    KVEventsConfig,
    ZmqEventPublisher,
    all_blocks_cleared,
    block_removed,
    block_stored,
    parse_kv_events_config,
)
from kvstore.tier_registry import is_shared, medium_of
from kvstore.token_hints import Hint, HintTable

logger = logging.getLogger("kvstore.events")  # one logger for the events, as before the split


class StoreEvents:
    """A tiered store's KV events: each tier is a medium (TIER_MEDIUM), each chunk key a block hash.

    Attached as the store's `metrics.events` sink (kvstore.tier_calls reports every put's stored and
    evicted keys and every delete that removed a key, per tier). The first batch is AllBlocksCleared
    followed by what the local tiers already hold (a disk tier after a warm restart), so a subscriber,
    or a router replaying, starts from the truth.

    A server does not know a chunk's tokens unless its writer said them (kvstore.token_hints: `hint`
    keeps them, the put's handler gives them before it stores): a chunk with a hint is published with
    its token ids, `block_size` its token count and, as parent, the chunk before it, so an indexer that
    keys blocks by their tokens (Dynamo's, llm-d's) indexes it. One without (no hint given, or lost to
    a restart or the table's bound) has no token_ids, no parent and block_size 0, as vLLM's decoder
    reads and such an indexer ignores. Chunks a put stores in order, each the parent of the next, go
    in one BlockStored (a chain, as an engine publishes a prompt's blocks).

    What a tier drops without the store seeing it (TTL expiry, which a tier notices lazily; evictions
    Redis or Valkey makes on its own under maxmemory) is found by reconciliation: every `reconcile_s`
    the chunks announced as stored (the latest TRACKED_PER_TIER per tier) are checked, in batches, and
    those gone are published as BlockRemoved. A batch the tier could not answer (Redis down) is skipped.
    """

    SNAPSHOT_BATCH = 1024  # keys per BlockStored of the start-up snapshot
    CHECK_BATCH = 1024  # keys per existence check of the reconciliation
    TRACKED_PER_TIER = 262_144  # announced keys reconciliation remembers per tier (the latest)

    def __init__(self, store: Any, config: KVEventsConfig, token: str | None = None) -> None:
        self.publisher = ZmqEventPublisher(config, token=token)
        self.store = store
        self.reconciled = 0  # chunks found gone by reconciliation
        self.hints = HintTable()  # the token ids writers gave with their puts (kvstore.token_hints)
        self._lock = threading.Lock()  # announced + the order of what is published
        self._gen = count(1)
        self._announced: dict[str, dict[str, int]] = {t.name: {} for t in store.tiers}  # key -> generation
        self.publisher.publish([all_blocks_cleared()])
        for tier in store.tiers:
            if is_shared(tier):  # declared shared by many servers (redis, fs), possibly huge: not listed
                continue
            keys = list(tier.keys())
            for i in range(0, len(keys), self.SNAPSHOT_BATCH):
                self(tier.name, keys[i : i + self.SNAPSHOT_BATCH], [])
        store.metrics.events = self
        self._stop = threading.Event()
        self._reconciler: threading.Thread | None = None
        if config.reconcile_s > 0:
            self._reconciler = threading.Thread(
                target=self._reconcile_loop,
                args=(config.reconcile_s,),
                name="kv-events-reconcile",
                daemon=True,
            )
            self._reconciler.start()

    @classmethod
    def attach(
        cls, store: Any, value: str | Mapping[str, Any] | None, token: str | None = None
    ) -> StoreEvents | None:
        """The store's events as `--kv-events-config` asks (None when off); `token`: the server's own."""
        config = parse_kv_events_config(value)
        return cls(store, config, token) if config.enabled else None

    def hint(self, hints: dict[str, Hint]) -> None:
        """Token hints of chunks about to be stored (kvstore.token_hints.checked_hints)."""
        if hints:
            self.hints.add(hints)

    def _stored(self, tier: str, keys: list[str]) -> list[Any]:
        """The BlockStored events of `keys`: a run of chunks with hints of one size, each the parent of
        the next, is one event; chunks without a hint go in one event of their own, as before."""
        medium = medium_of(tier)  # the tier's declaration (kvstore.tier_registry)
        plain: list[bytes] = []
        events: list[Any] = []
        run: list[tuple[bytes, Hint]] = []

        def close_run() -> None:
            if run:
                tokens = array("I")
                for _, h in run:
                    tokens.extend(h.tokens)
                size = len(run[0][1].tokens)
                events.append(
                    block_stored([k for k, _ in run], run[0][1].parent, tokens.tolist(), size, medium)
                )
                run.clear()

        for key in keys:
            raw = bytes.fromhex(key)
            hint = self.hints.get(key)
            if hint is None:
                plain.append(raw)
                continue
            if run and (hint.parent != run[-1][0] or len(hint.tokens) != len(run[-1][1].tokens)):
                close_run()
            run.append((raw, hint))
        close_run()
        if plain:
            events.append(block_stored(plain, None, [], 0, medium))
        return events

    def __call__(self, tier: str, stored: list[str], removed: list[str]) -> None:
        events = []
        if removed:
            events.append(block_removed([bytes.fromhex(k) for k in removed], medium_of(tier)))
        if stored:
            events.extend(self._stored(tier, stored))
        with self._lock:
            announced = self._announced.setdefault(tier, {})
            for k in removed:
                announced.pop(k, None)
            for k in stored:
                announced.pop(k, None)
                announced[k] = next(self._gen)
            while len(announced) > self.TRACKED_PER_TIER:
                del announced[next(iter(announced))]
            self.publisher.publish(events)

    def reconcile(self) -> int:
        """Check once that the announced chunks are still held; publish BlockRemoved for those gone.
        Returns how many were found gone."""
        gone_total = 0
        for tier in self.store.tiers:
            with self._lock:
                pairs = list(self._announced.get(tier.name, {}).items())
            for i in range(0, len(pairs), self.CHECK_BATCH):
                if self._stop.is_set():
                    return gone_total
                batch = pairs[i : i + self.CHECK_BATCH]
                held = self._held(tier, [k for k, _ in batch])
                if held is None:
                    continue  # the tier could not answer: nothing is known gone
                with self._lock:
                    announced = self._announced.get(tier.name, {})
                    gone = [
                        k
                        for (k, gen), h in zip(batch, held, strict=True)
                        if not h and announced.get(k) == gen
                    ]
                    for k in gone:
                        del announced[k]
                    if gone:
                        medium = medium_of(tier.name, tier)
                        self.publisher.publish([block_removed([bytes.fromhex(k) for k in gone], medium)])
                gone_total += len(gone)
        self.reconciled += gone_total
        return gone_total

    @staticmethod
    def _held(tier: Any, keys: list[str]) -> list[bool] | None:
        """Which of `keys` the tier holds; None when it could not tell (a failure or a fast fail counted
        meanwhile: a Redis that is down answers every key as missing)."""
        stats = getattr(tier, "stats", None)

        def failures() -> tuple[float, float]:
            return (stats.errors, stats.extra.get("fast_fails", 0)) if stats is not None else (0, 0)

        before = failures()
        try:
            many = getattr(tier, "contains_many", None)
            held = list(many(keys)) if many is not None else [tier.contains(k) for k in keys]
        except Exception as e:  # a tier that raises: nothing is known gone
            logger.debug("KV events: reconciling tier %s: %r", tier.name, e)
            return None
        return held if failures() == before else None

    def _reconcile_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                gone = self.reconcile()
                if gone:
                    logger.info("KV events: %d chunk(s) gone without an event (TTL, Redis eviction)", gone)
            except Exception:
                logger.exception("KV events: reconciliation failed")

    def shutdown(self) -> None:
        """Detach from the store (which may outlive the server) and close the sockets."""
        self._stop.set()
        if self.store.metrics.events is self:
            self.store.metrics.events = None
        if self._reconciler is not None:
            self._reconciler.join(5)
        self.publisher.shutdown()
