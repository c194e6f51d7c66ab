"""Continuous batching with chunked prefill and preemption by recompute (vLLM V1's scheduler).

Each step has a token budget (`max_num_batched_tokens`). Running sequences are served first, oldest
first: a decode takes one token, an unfinished prefill takes the next chunk that fits. When blocks
run out, the newest running sequence is preempted: its blocks are freed (they keep their hashes, so
the prefix cache often revives them) and it goes back to the front of the waiting queue to be
recomputed. Waiting sequences are admitted while budget, `max_num_seqs` and blocks allow.

Where a KV connector (docs/design.md §5) plugs in, marked below: `get_num_new_matched_tokens` after
the local prefix lookup, `update_state_after_alloc` after allocation, `build_connector_meta` at the
end of `schedule`, `request_finished` in `_finish` and `request_preempted` in `_preempt`, each before
blocks are freed (with a store, a preempted sequence resumes by loading its KV). When the connector
loads asynchronously, an admitted sequence waits in `loading` (WAITING_FOR_REMOTE_KVS) holding its
blocks, while the others keep running; `finish_loads` moves it to `running` once its KV has arrived.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvstore.connectors.base import KVConnectorBase
from kvstore.engine.block_manager import BlockManager, cdiv
from kvstore.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


# What a store hit leaves each running sequence to grow into, at most (see _growth_reserve). Measured
# on the short-turn chat (bench_ttft.py, bf16, 2 A/B pairs): one block each, 31-35 preemptions per run;
# up to 8 blocks, 24 and the run 4-6% faster.
HIT_RESERVE_BLOCKS = 8


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int = 2048


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence, so its last logits are sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)  # given up (aborted, `error` set) this step
    kv_connector_metadata: Any = None  # what the KV connector's worker side loads and saves this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        eos_token_ids: set[int] | None = None,
        connector: KVConnectorBase | None = None,
    ) -> None:
        assert config.max_num_batched_tokens > 0 and config.max_num_seqs > 0
        self.config = config
        self.block_manager = block_manager
        self.eos_token_ids = set(eos_token_ids or ())
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.connector = connector  # scheduler side of the KV connector (--kv-backend), or None
        self.saving: dict[str, Sequence] = {}  # finished, blocks held until their KV save is done
        self.loading: dict[str, Sequence] = {}  # admitted, blocks held, KV arriving from the connector
        self._load_targets: dict[str, int] = {}  # request -> num_computed_tokens once its load lands
        self._load_errors: set[int] = set()  # failed-load blocks reported while requests were loading
        self._finished_saving: set[str] = set()  # finished since the last take_finished_req_ids()
        # (request, its local hit, block_manager.num_frees, budget) of the last store hit that did not fit
        self._blocked_hit: tuple[str, int, int, int] | None = None

    def add_sequence(self, seq: Sequence) -> None:
        assert seq.status is SequenceStatus.WAITING and not seq.block_table
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.loading)  # vLLM counts WAITING_FOR_REMOTE_KVS as waiting

    # ---- scheduling ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            assert num_new > 0, "a running sequence always has a token to compute"
            while not bm.allocate_slots(seq, num_new):
                victim = self.running.pop()  # the newest; never one already scheduled this step
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSequence(seq, num_new))
                budget -= num_new
                i += 1
                continue
            break

        # No admissions in a step that had to preempt: memory is the bottleneck.
        while (
            self.waiting
            and budget > 0
            and len(self.running) + len(self.loading) < self.config.max_num_seqs
            and not out.preempted
        ):
            seq = self.waiting[0]
            # prompt logprobs need every prompt position's logits: no hit from the cache or the store
            whole_prompt = seq.sampling_params.prompt_logprobs is not None
            computed = [] if whole_prompt else bm.get_computed_blocks(seq)
            num_computed = len(computed) * bm.block_size
            num_external, load_async = 0, False  # tokens the KV store has beyond the engine's own cache
            if self.connector is not None and not self._worth_a_lookup(seq, num_computed, computed, budget):
                break  # it cannot fit now whatever the store has: no lookup each step while it waits
            if self.connector is not None:
                num_external, load_async = self.connector.get_num_new_matched_tokens(seq, num_computed)
                if whole_prompt:  # asked all the same: the connector still saves what this one computes
                    num_external, load_async = 0, False
            num_new = 0 if load_async else min(seq.num_tokens - num_computed - num_external, budget)
            # a store hit claims its whole prefix in one step: it must leave the running sequences room
            # to grow, or it only preempts them (and they recompute)
            reserve = self._growth_reserve() if num_external else 0
            if not bm.allocate_slots(seq, num_external + num_new, computed, reserve):
                if num_external:
                    self._blocked_hit = (seq.request_id, num_computed, bm.num_frees, budget)
                break
            if self.connector is not None:  # loaded by the runner before this step's forward
                self.connector.update_state_after_alloc(seq, seq.block_table, num_external)
            self.waiting.popleft()
            bm.record_prefix_lookup(seq, num_computed)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_computed + num_external
            if load_async:  # nothing to compute before its KV arrives; the others go on meanwhile
                seq.num_computed_tokens = num_computed
                seq.status = SequenceStatus.WAITING_FOR_REMOTE_KVS
                self.loading[seq.request_id] = seq
                self._load_targets[seq.request_id] = num_computed + num_external
                continue
            seq.num_computed_tokens = num_computed + num_external
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new

        if out.is_empty and self.waiting and not self.running and not self.saving and not self.loading:
            seq = self.waiting[0]  # nothing else holds blocks: it can never fit; fail it, not the engine
            seq.error = (
                f"request {seq.request_id} ({seq.num_tokens} tokens) does not fit in the KV cache "
                f"({bm.num_blocks} blocks of {bm.block_size}); raise the KV cache size or lower max_model_len"
            )
            self._finish(seq, SequenceStatus.FINISHED_ABORTED)
            out.failed.append(seq)
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    def _worth_a_lookup(self, seq: Sequence, num_computed: int, computed: list[int], budget: int) -> bool:
        """Whether an answer of the store lookup could let the waiting `seq` in this step. A lookup
        costs a round trip (or a thread hop), and a sequence waiting for memory would repeat it every
        step: measured 1,011 lookups for 143 admissions on the short-turn chat, ~0.6 ms each.

        No when a miss (its next chunk of at most `budget` tokens) and the smallest hit (one block
        more, and the growth reserve) both cannot fit; and no when its last lookup found a hit that did
        not fit and nothing was freed since (each block given out since shrank the reserve by at most
        one) with at least that budget: only a store eviction meanwhile could change that answer, and
        the next free asks again."""
        bm = self.block_manager
        blocked = self._blocked_hit
        if (
            blocked is not None
            and blocked[:3] == (seq.request_id, num_computed, bm.num_frees)
            and budget >= blocked[3]
        ):
            return False
        rest = seq.num_tokens - num_computed
        return bm.can_allocate(seq, min(rest, budget), computed) or bm.can_allocate(
            seq, bm.block_size, computed, self._growth_reserve()
        )

    def _growth_reserve(self) -> int:
        """Free blocks a store hit must leave: each running sequence's blocks up to the end of its
        max_tokens, at least one (its next) and at most HIT_RESERVE_BLOCKS; one per loading one."""
        bs = self.block_manager.block_size
        total = len(self.loading)
        for seq in self.running:
            remaining = seq.sampling_params.max_tokens - seq.num_output_tokens
            end = min(seq.num_tokens + remaining, self.config.max_model_len)
            total += min(max(1, cdiv(end, bs) - len(seq.block_table)), HIT_RESERVE_BLOCKS)
        return total

    def _preempt(self, seq: Sequence) -> None:
        if self.connector is not None:  # it may keep what the blocks hold before they are reused
            self.connector.request_preempted(seq, seq.block_table)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        logger.debug("preempted %s (%d tokens) for recompute", seq.request_id, seq.num_tokens)

    # ---- results ------------------------------------------------------------------------------
    def update_from_output(
        self, out: SchedulerOutput, sampled: list[int | None], invalid_block_ids: set[int] | None = None
    ) -> list[Sequence]:
        """Advance every scheduled sequence; append sampled tokens where a chunk reached the end.
        Returns the sequences that got a new token (finished ones included).

        `invalid_block_ids`: blocks the KV connector failed to load this step. A sequence holding one
        goes back to its first bad block and recomputes from there; this step's sample is void."""
        assert len(sampled) == len(out.scheduled)
        if invalid_block_ids and self.loading:  # some may belong to a load still in flight
            self.finish_loads(set(), invalid_block_ids)
        updated = []
        for sched, token in zip(out.scheduled, sampled, strict=True):
            seq = sched.seq
            reached_end = sched.samples
            if invalid_block_ids and self._rewind_to_bad_block(seq, invalid_block_ids):
                self.block_manager.cache_full_blocks(seq)
                continue
            seq.num_computed_tokens += sched.num_new_tokens
            self.block_manager.cache_full_blocks(seq)
            if not reached_end:
                continue  # a prefill chunk that is not the last one: its sample is meaningless
            assert token is not None
            seq.append_token(token)
            updated.append(seq)
            if seq.structured_output is not None and not seq.structured_output.accept_token(token):
                # the mask allowed only grammar tokens, so this is a bug: never return broken output silently
                seq.error = (
                    f"sampled token {token} breaks its {seq.structured_output.params.kind.value} constraint"
                )
                logger.error("%s: %s; aborting it", seq.request_id, seq.error)
                self._finish(seq, SequenceStatus.FINISHED_ABORTED)
                continue
            status = self._check_stop(seq, token)
            if status is not None:
                self._finish(seq, status)
        return updated

    def _rewind_to_bad_block(self, seq: Sequence, invalid_block_ids: set[int]) -> bool:
        bad = next((i for i, b in enumerate(seq.block_table) if b in invalid_block_ids), None)
        if bad is None or bad * self.block_manager.block_size >= seq.num_computed_tokens:
            return False
        good = bad * self.block_manager.block_size
        logger.info("%s: KV load failed at token %d; recomputing from there", seq.request_id, good)
        seq.num_computed_tokens = good
        seq.num_cached_tokens = min(seq.num_cached_tokens, good)
        return True

    def _check_stop(self, seq: Sequence, token: int) -> SequenceStatus | None:
        p = seq.sampling_params
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                seq.stop_reason = None
                return SequenceStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                seq.stop_reason = token
                return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Finish a sequence from outside (stop strings, aborts). Idempotent."""
        if not seq.is_finished:
            self._finish(seq, status)

    def abort(self, request_id: str) -> Sequence | None:
        for seq in [*self.running, *self.waiting, *self.loading.values()]:
            if seq.request_id == request_id:
                self._finish(seq, SequenceStatus.FINISHED_ABORTED)
                return seq
        return None

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        assert status.finished
        delay = False
        if self.connector is not None:
            delay, _ = self.connector.request_finished(seq, seq.block_table)
        loading = seq.request_id in self.loading  # the connector still writes into its blocks
        if delay:  # a save of its KV is in flight: the blocks wait for finish_saves()
            self.saving[seq.request_id] = seq
            self._finished_saving.add(seq.request_id)
        elif not loading:  # else finish_loads frees them once the load is over
            self.block_manager.free(seq)
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
        elif not loading:
            self.waiting.remove(seq)

    # ---- KV connector: finished requests whose save was in flight ------------------------------
    def take_finished_req_ids(self) -> set[str]:
        """Requests finished since the last call whose blocks wait for a save (for get_finished)."""
        ids, self._finished_saving = self._finished_saving, set()
        return ids

    def finish_loads(self, request_ids: set[str], invalid_block_ids: set[int] = frozenset()) -> None:
        """The connector reports these loads done; `invalid_block_ids`: blocks that failed to load.
        Each sequence continues from its first bad block (or from the end of its load)."""
        held = {b for seq in self.loading.values() for b in seq.block_table} if invalid_block_ids else ()
        self._load_errors |= {b for b in invalid_block_ids if b in held}
        bs = self.block_manager.block_size
        for rid in request_ids:
            seq = self.loading.pop(rid, None)
            if seq is None:
                continue
            target = self._load_targets.pop(rid)
            bad = next((i for i, b in enumerate(seq.block_table) if b in self._load_errors), None)
            self._load_errors.difference_update(seq.block_table)
            if seq.is_finished:  # aborted while loading: its blocks were kept for the loader until now
                if seq.request_id not in self.saving:
                    self.block_manager.free(seq)
                continue
            if bad is not None and bad * bs < target:
                logger.info("%s: KV load failed at token %d; recomputing from there", rid, bad * bs)
                target = max(seq.num_computed_tokens, bad * bs)
                seq.num_cached_tokens = min(seq.num_cached_tokens, target)
            seq.num_computed_tokens = target
            self.block_manager.cache_full_blocks(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        if not self.loading:
            self._load_errors.clear()

    def finish_saves(self, request_ids: set[str]) -> None:
        """The connector reports these saves done: their blocks can be freed now."""
        for rid in request_ids:
            seq = self.saving.pop(rid, None)
            if seq is not None and rid not in self.loading:  # else finish_loads frees it
                self.block_manager.free(seq)
