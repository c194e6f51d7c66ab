"""The scheduler side of the kvstore connector: what to load from the store, what to save to it.

Per request it keeps the chained chunk keys of its tokens (extended as it grows) and a save
watermark: chunks below it are in the store already (the lookup said so) or have been handed to the
worker for saving. Each step, every chunk that became full is scheduled for saving exactly once;
that covers prompt chunks, generated chunks, and the KV of a request about to be preempted (its full
chunks are already on their way to the store when its blocks are freed, so it resumes by loading
rather than recomputing).

`build_connector_meta` reads the engine's scheduler output duck-typed: `.scheduled` is a list of
items with `.seq` (the request: `request_id`, `all_token_ids`, `block_table`, `num_computed_tokens`
before this step) and `.num_new_tokens` (tokens computed this step).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from connectors.base import ConnectorRequest
from connectors.chunks import ChunkKeys, key_extra
from connectors.config import KVTransferConfig
from connectors.meta import LoadSpec, SaveSpec, StepTransfers
from connectors.store_handle import StoreHandle, is_unreachable
from kvstore.errors import KVStoreError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Lookup:
    """The answer of the last lookup for a request (a cache, so that asking twice is free)."""

    num_computed: int
    first_chunk: int  # chunks below it are in the engine's own prefix cache: not asked for
    wanted_chunks: int  # chunks that could add tokens below the cap
    hit_chunks: int  # leading chunks present (engine's or store's)
    external: int
    unreachable: bool = False
    miss_reason: str = "not_stored"  # the store's reason the chunk after the hits is missing


class KVStoreScheduler:
    def __init__(self, config: KVTransferConfig, handle: StoreHandle) -> None:
        assert config.layout is not None, "KVTransferConfig.for_engine(...) sets the layout"
        self.config = config
        self.handle = handle
        self.metrics = handle.metrics
        self.chunk_size = config.chunk_size
        self.block_size = config.block_size
        self._keys: dict[str, ChunkKeys] = {}
        self._lookups: dict[str, _Lookup] = {}
        self._saved: dict[str, int] = {}
        self._with_saves: set[str] = set()
        self._loads: list[LoadSpec] = []

    def _chunk_keys(self, request: ConnectorRequest) -> list[str]:
        ck = self._keys.get(request.request_id)
        if ck is None:
            extra = key_extra(request)  # cache salt / LoRA: never shared with other requests
            ck = self._keys[request.request_id] = ChunkKeys(self.config.layout, self.config.namespace, extra)
        return ck.update(request.all_token_ids)

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        cs, bs = self.chunk_size, self.block_size
        assert num_computed_tokens % bs == 0, "local prefix hits are whole blocks"
        cap = (
            (len(request.all_token_ids) - 1) // bs * bs
        )  # the last token is always recomputed for its logits
        keys = self._chunk_keys(request)
        wanted = min(len(keys), -(-cap // cs))  # chunks that hold tokens below the cap
        first = num_computed_tokens // cs  # chunks the engine already has need no lookup
        look = _Lookup(num_computed_tokens, first, wanted, first, 0)
        if wanted > first:
            look = self._lookup(keys, look, cap)
        self._lookups[request.request_id] = look
        return look.external, self.config.load_async and look.external > 0

    def _lookup(self, keys: list[str], look: _Lookup, cap: int) -> _Lookup:
        if not self.handle.reachable():
            return _Lookup(look.num_computed, look.first_chunk, look.wanted_chunks, look.first_chunk, 0, True)
        t0 = time.perf_counter()
        try:
            found, reason = self.handle.lookup(keys[look.first_chunk : look.wanted_chunks])
            hit = look.first_chunk + found
        except KVStoreError as e:  # never fail a request over the store: it is a miss
            if is_unreachable(e):
                self.handle.mark_unreachable(e)
            else:
                logger.error("lookup_prefix failed: %r", e)
            return _Lookup(look.num_computed, look.first_chunk, look.wanted_chunks, look.first_chunk, 0, True)
        finally:
            self.metrics.lookup_seconds.observe(time.perf_counter() - t0)
        external = max(0, min(hit * self.chunk_size, cap) - look.num_computed)
        return _Lookup(look.num_computed, look.first_chunk, look.wanted_chunks, hit, external, False,
                       reason or "not_stored")  # fmt: skip

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        rid = request.request_id
        look = self._lookups.pop(rid, None)
        preempted = getattr(request, "num_preemptions", 0) > 0
        self.metrics.record_lookup(len(request.all_token_ids), num_external_tokens, preempted)
        if look is None:
            assert num_external_tokens == 0, "update_state_after_alloc without get_num_new_matched_tokens"
            return
        assert num_external_tokens <= look.external, (num_external_tokens, look)
        self.metrics.miss(
            "unreachable" if look.unreachable else look.miss_reason, look.wanted_chunks - look.hit_chunks
        )
        # Chunks the engine had itself are assumed stored (they were saved when first computed):
        # re-checking them would copy every locally cached chunk out of the cache each request.
        self._saved[rid] = max(self._saved.get(rid, 0), look.hit_chunks)
        if num_external_tokens == 0:
            return
        start, end = look.num_computed, look.num_computed + num_external_tokens
        assert end % self.block_size == 0 and len(block_ids) * self.block_size >= end
        c0, c1 = start // self.chunk_size, -(-end // self.chunk_size)
        keys = self._chunk_keys(request)[c0:c1]
        self._loads.append(LoadSpec(rid, tuple(keys), c0, tuple(block_ids), start, end))

    def build_connector_meta(self, scheduler_output: Any) -> StepTransfers:
        step = StepTransfers(loads=self._loads)
        self._loads = []
        if not self.config.saves:
            return step
        cs, bpc = self.chunk_size, self.chunk_size // self.block_size
        for item in getattr(scheduler_output, "scheduled", ()):
            seq = item.seq
            done = seq.num_computed_tokens + item.num_new_tokens  # tokens whose KV exists after the step
            keys = self._chunk_keys(seq)
            full = min(done // cs, len(keys))
            rid = seq.request_id
            for c in range(self._saved.get(rid, 0), full):
                blocks = tuple(seq.block_table[c * bpc : (c + 1) * bpc])
                assert len(blocks) == bpc, f"request {rid} lacks blocks for chunk {c}"
                step.saves.append(SaveSpec(rid, keys[c], c, blocks))
                self._with_saves.add(rid)
            self._saved[rid] = max(self._saved.get(rid, 0), full)
        return step

    def request_finished(
        self, request: ConnectorRequest, block_ids: Sequence[int]
    ) -> tuple[bool, dict | None]:
        rid = request.request_id
        saved = self._saved.pop(rid, 0)
        self._keys.pop(rid, None)
        self._lookups.pop(rid, None)
        delay = rid in self._with_saves
        self._with_saves.discard(rid)
        params = {"stored_chunks": saved, "chunk_size": self.chunk_size} if saved else None
        return delay, params
