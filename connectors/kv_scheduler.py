"""The scheduler side of the kvstore connector: what to load from the store, what to save to it.

Per request it keeps the chained chunk keys of its tokens (extended as it grows) and a save
watermark: chunks below it are in the store already (the lookup said so) or have been handed to the
worker for saving. Each step, every chunk that became full is scheduled for saving exactly once;
that covers prompt chunks and generated chunks. When a request finishes, its trailing partial chunk
(block-aligned) is saved too, under Spec 1's partial key, so that the next turn of a conversation loads it
(`kvstore.connectors.prefix`); a saved chunk replaces the shorter partials of the same chunk it supersedes
(except, per block size the save is not a multiple of, the longest one: engines with coarser blocks
sharing the store still find theirs).
A preempted request's full chunks are in the store already; `request_preempted` saves its partial
chunk as well (copied out before the blocks are reused), so it resumes by loading, not recomputing.

`build_connector_meta` reads the engine's scheduler output duck-typed: `.scheduled` is a list of
items with `.seq` (the request: `request_id`, `all_token_ids`, `block_table`, `num_computed_tokens`
before this step) and `.num_new_tokens` (tokens computed this step).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvstore.connectors.base import ConnectorRequest
from kvstore.connectors.chunks import ChunkKeys, key_extra
from kvstore.connectors.config import KVTransferConfig
from kvstore.connectors.meta import LoadSpec, SaveSpec, StepTransfers
from kvstore.connectors.prefix import PrefixHit, PrefixQuery, plan_prefix_query
from kvstore.connectors.store_handle import StoreHandle, is_unreachable

from kvstore.errors import KVStoreError
from kvstore.keys import stage_key

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Lookup:
    """The answer of the last lookup for a request (a cache, so that asking twice is free: vLLM asks
    again every step a waiting request is not admitted). It is used up by update_state_after_alloc,
    dropped when the request finishes, and answers again only the same question (the same computed
    prefix of the same tokens); a failed lookup is not kept."""

    num_computed: int
    num_tokens: int
    wanted_chunks: int  # chunks that could add tokens below the cap
    hit: PrefixHit  # leading chunks present (the engine's or the store's), then maybe a partial
    external: int
    miss_reason: str = "not_stored"  # why the full chunk after the hits is missing (metrics' reasons)


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
        self._with_saves: set[str] = set()  # requests with chunks handed to the worker for saving
        self._allocated: set[str] = set()  # requests update_state_after_alloc has seen (vLLM calls it again
        # for a request whose load was asynchronous, once the load is done)
        self._loads: list[LoadSpec] = []
        self._finished_saves: list[SaveSpec] = []  # partial chunks of finished requests, for the next meta
        self._preempt_saves: list[SaveSpec] = []  # partial chunks of requests preempted this step
        stages = config.pp_stages
        # pipeline parallel: a chunk is stored once per stage (kvstore.keys.stage_key); asked for all
        self._expand = (lambda key: [stage_key(key, a, b) for a, b in stages]) if stages else None

    def chunk_keys_of(self, request_id: str) -> ChunkKeys | None:
        """The chunk keys of a live request, as far as they were computed."""
        return self._keys.get(request_id)

    def reset_lookups(self) -> None:
        """Forget the cached lookup answers: the next ask goes to the store."""
        self._lookups.clear()

    def _chunk_keys(self, request: ConnectorRequest) -> ChunkKeys:
        ck = self._keys.get(request.request_id)
        if ck is None:
            extra = key_extra(request)  # cache salt / LoRA: never shared with other requests
            ck = self._keys[request.request_id] = ChunkKeys(self.config.layout, self.config.namespace, extra)
        ck.update(request.all_token_ids)
        return ck

    # ---- lookups ------------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        cs, bs = self.chunk_size, self.block_size
        assert num_computed_tokens % bs == 0, "local prefix hits are whole blocks"
        tokens = request.all_token_ids
        look = self._lookups.get(request.request_id)
        if look is not None and (look.num_computed, look.num_tokens) == (num_computed_tokens, len(tokens)):
            return look.external, self.config.load_async and look.external > 0
        cap = (len(tokens) - 1) // bs * bs  # the last token is always recomputed for its logits
        keys = self._chunk_keys(request)
        query = plan_prefix_query(
            keys, tokens, num_computed_tokens, cap, bs, self.config.partial_chunks, self._expand
        )
        wanted = query.first_chunk + len(query.full_keys)
        n = len(tokens)
        look = _Lookup(num_computed_tokens, n, wanted, PrefixHit(query.first_chunk, None, cs), 0)
        if query.full_keys or query.partials:
            hit, reason = self._ask(query)
            external = max(0, min(hit.num_tokens, cap) - num_computed_tokens)
            look = _Lookup(num_computed_tokens, n, wanted, hit, external, reason)
        self._lookups[request.request_id] = look
        if look.miss_reason == "unreachable":  # asked again next time: the store may be back
            look = self._lookups[request.request_id] = replace(look, num_tokens=-1)
        return look.external, self.config.load_async and look.external > 0

    def _ask(self, query: PrefixQuery) -> tuple[PrefixHit, str]:
        """(what the store has, why the next full chunk is missing); never raises: a failure is a miss."""
        miss = PrefixHit(query.first_chunk, None, self.chunk_size)
        if not self.handle.reachable():
            return miss, "unreachable"
        t0 = time.perf_counter()
        try:
            hit, reason = self.handle.lookup(self.config.lookup_timeout_s, query.ask)
        except KVStoreError as e:  # never fail a request over the store: it is a miss
            if is_unreachable(e):
                self.handle.mark_unreachable(e)
            else:
                logger.error("KV store lookup failed: %r", e)
            return miss, "unreachable"
        finally:
            self.metrics.lookup_seconds.observe(time.perf_counter() - t0)
        return hit, reason or "not_stored"

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        rid = request.request_id
        look = self._lookups.pop(rid, None)
        if look is None and num_external_tokens == 0 and rid in self._allocated:
            return  # an async load's request, allocated again once its load is done: counted already
        self._allocated.add(rid)
        preempted = getattr(request, "num_preemptions", 0) > 0
        self.metrics.record_lookup(len(request.all_token_ids), num_external_tokens, preempted)
        if look is None:
            assert num_external_tokens == 0, "update_state_after_alloc without get_num_new_matched_tokens"
            return
        assert num_external_tokens <= look.external, (num_external_tokens, look)
        hit = look.hit
        self.metrics.miss(look.miss_reason, look.wanted_chunks - hit.full_chunks)
        # Chunks the engine had itself are assumed stored (they were saved when first computed):
        # re-checking them would copy every locally cached chunk out of the cache each request.
        self._saved[rid] = max(self._saved.get(rid, 0), hit.full_chunks)
        if num_external_tokens == 0:
            return
        cs = self.chunk_size
        start, end = look.num_computed, look.num_computed + num_external_tokens
        assert end % self.block_size == 0 and len(block_ids) * self.block_size >= end
        c0, c1 = start // cs, -(-end // cs)
        keys = list(self._chunk_keys(request).keys[c0 : min(c1, hit.full_chunks)])
        sizes = [cs] * len(keys)
        if c1 > hit.full_chunks:  # the load ends inside the stored partial chunk
            assert hit.partial is not None and c1 == hit.full_chunks + 1, (c0, c1, hit)
            keys.append(hit.partial.key)
            sizes.append(hit.partial.num_tokens)
            self.metrics.partial_chunks.labels("loaded").inc()
        self._loads.append(LoadSpec(rid, tuple(keys), c0, tuple(block_ids), start, end, tuple(sizes)))

    # ---- saves --------------------------------------------------------------------------------
    def _replaced_partials(
        self, keys: ChunkKeys, tokens: Sequence[int], chunk: int, num_tokens: int
    ) -> tuple:
        """Partial keys of `chunk` that a save of its first `num_tokens` tokens supersedes for every
        engine sharing the store. An engine reuses whole blocks only, so one whose block size does not
        divide `num_tokens` (vLLM's 128 beside kvstore-engine's 16) cannot use this save: for each block
        size that could be (a divisor of the chunk size), its longest shorter partial stays."""
        if not self.config.partial_chunks:
            return ()
        cs = self.chunk_size
        kept = {num_tokens // b * b for b in range(1, cs + 1) if cs % b == 0 and num_tokens % b}
        lengths = [n for n in range(self.block_size, num_tokens, self.block_size) if n not in kept]
        return tuple(keys.partial_keys(tokens, chunk, lengths))

    def build_connector_meta(self, scheduler_output: Any) -> StepTransfers:
        step = StepTransfers(loads=self._loads, saves=self._finished_saves, preempt_saves=self._preempt_saves)
        self._loads, self._finished_saves, self._preempt_saves = [], [], []
        if not self.config.saves:
            return step
        cs, bpc = self.chunk_size, self.chunk_size // self.block_size
        for item in getattr(scheduler_output, "scheduled", ()):
            seq = item.seq
            done = seq.num_computed_tokens + item.num_new_tokens  # tokens whose KV exists after the step
            keys = self._chunk_keys(seq)
            full = min(done // cs, len(keys.keys))
            rid = seq.request_id
            for c in range(self._saved.get(rid, 0), full):
                blocks = tuple(seq.block_table[c * bpc : (c + 1) * bpc])
                assert len(blocks) == bpc, f"request {rid} lacks blocks for chunk {c}"
                tokens = seq.all_token_ids
                replaces = self._replaced_partials(keys, tokens, c, cs)
                hint = tuple(tokens[c * cs : (c + 1) * cs]), keys.keys[c - 1] if c else None
                step.saves.append(SaveSpec(rid, keys.keys[c], c, blocks, False, replaces, *hint))
                self._with_saves.add(rid)
            self._saved[rid] = max(self._saved.get(rid, 0), full)
        return step

    def _partial_save(
        self, request: ConnectorRequest, block_ids: Sequence[int], saved: int
    ) -> SaveSpec | None:
        """The trailing partial chunk of a finished request, block-aligned, if it holds anything new."""
        cs, bs = self.chunk_size, self.block_size
        done = getattr(request, "num_computed_tokens", 0)
        chunk = done // cs
        n = (done - chunk * cs) // bs * bs
        if n == 0 or chunk < saved:  # nothing, or the whole chunk is stored already
            return None
        keys = self._chunk_keys(request)
        if chunk > len(keys.keys):  # KV of tokens it does not have: cannot happen, but never guess
            return None
        tokens = request.all_token_ids
        (key,) = keys.partial_keys(tokens, chunk, [n])
        blocks = tuple(block_ids[chunk * cs // bs : (chunk * cs + n) // bs])
        assert len(blocks) == n // bs, (len(blocks), n)
        replaces = self._replaced_partials(keys, tokens, chunk, n)
        hint = tuple(tokens[chunk * cs : chunk * cs + n]), keys.keys[chunk - 1] if chunk else None
        return SaveSpec(request.request_id, key, chunk, blocks, True, replaces, *hint)

    def request_preempted(self, request: ConnectorRequest, block_ids: Sequence[int]) -> None:
        """`request` is preempted: its blocks are about to be freed, `num_computed_tokens` still counts
        its KV. Its trailing partial chunk goes out with this step's metadata, copied out before
        anything can overwrite the blocks (the full chunks before it were saved as they filled)."""
        rid = request.request_id
        if not (self.config.saves and self.config.partial_chunks and rid in self._keys):
            return
        spec = self._partial_save(request, block_ids, self._saved.get(rid, 0))
        if spec is not None:
            self._preempt_saves.append(spec)

    def request_finished(
        self, request: ConnectorRequest, block_ids: Sequence[int]
    ) -> tuple[bool, dict | None]:
        """True (keep the blocks until get_finished reports the request) when chunks of it were handed
        to the worker or its partial chunk is queued for the next metadata."""
        rid = request.request_id
        saved = self._saved.pop(rid, 0)
        spec = None
        if self.config.saves and self.config.partial_chunks and rid in self._keys:
            spec = self._partial_save(request, block_ids, saved)
            if spec is not None:
                self._finished_saves.append(spec)
        self._keys.pop(rid, None)
        self._lookups.pop(rid, None)
        self._allocated.discard(rid)
        delay = spec is not None or rid in self._with_saves
        self._with_saves.discard(rid)
        params = {"stored_chunks": saved, "chunk_size": self.chunk_size} if saved else None
        return delay, params
