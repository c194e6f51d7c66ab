"""vLLM's scheduler side in terms of `KVStoreScheduler`, the one that serves the bundled engine.

vLLM hands the connector its own objects: a `Request` (`request_id`, `all_token_ids`,
`num_preemptions`: read as they are), `KVCacheBlocks` per allocation, and each step a `SchedulerOutput`
(`scheduled_new_reqs`, `scheduled_cached_reqs`, `num_scheduled_tokens`). This adapter turns them into
what `KVStoreScheduler` reads — block id lists and `.scheduled` items with `.seq` and
`.num_new_tokens` — without importing vLLM (duck-typed, so it is tested without starting vLLM).

A preempted request: vLLM frees its blocks and zeroes its `num_computed_tokens` before the connector
hears of it (`SchedulerOutput.preempted_req_ids`, the next step), but the blocks keep their KV until
that step's forward, and vLLM's worker calls `handle_preemptions` before it. So each step remembers
every scheduled request's blocks and how many of its tokens have KV after the step; a preempted one's
partial chunk is handed to `KVStoreScheduler.request_preempted` from that record (as the bundled
engine does at its preemption) and copied out in `handle_preemptions`: it resumes by loading.

It also remembers which finished requests vLLM was told to keep (`request_finished` -> True): vLLM
frees their blocks when the worker reports them in `finished_sending`, and it must never hear of a
request it did not hold (it asserts on that), so the worker reports only those.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.connectors.kv_scheduler import KVStoreScheduler
from kvstore.connectors.meta import StepTransfers


@dataclass
class _Seq:
    """The fields of a request `KVStoreScheduler.build_connector_meta` reads."""

    request_id: str
    all_token_ids: Sequence[int]
    block_table: list[int]
    num_computed_tokens: int


@dataclass
class _Scheduled:
    seq: _Seq
    num_new_tokens: int


@dataclass
class _Step:
    scheduled: list[_Scheduled]


class VllmScheduler:
    def __init__(self, scheduler: KVStoreScheduler, block_ids_of: Callable[[str], Sequence[int]]) -> None:
        self.scheduler = scheduler
        self._block_ids_of = block_ids_of  # request id -> its block table (vLLM's KV cache manager)
        self._requests: dict[str, Any] = {}  # live requests by id: their token lists grow in place
        self._held: set[str] = set()
        # per running request: (its blocks, tokens with KV) after the last step it was scheduled in
        self._last: dict[str, tuple[list[int], int]] = {}
        self._events: list[Any] = []  # vLLM KV events of this connector's stores (vllm_stats)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._requests[request.request_id] = request
        groups = blocks.get_block_ids()  # one list per KV cache group (several: vLLM's hybrid manager)
        block_ids = list(groups[0]) if len(groups) == 1 else list(zip(*groups, strict=True))
        self.scheduler.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> tuple[StepTransfers, frozenset[str]]:
        """This step's loads and saves, and the finished requests whose blocks vLLM keeps for us."""
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self._preempted(rid)
        ids = [r.req_id for r in scheduler_output.scheduled_new_reqs]
        computed = [r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        ids += list(cached.req_ids)
        computed += list(cached.num_computed_tokens)
        items = []
        for rid, num_computed in zip(ids, computed, strict=True):
            request = self._requests.get(rid)
            if request is None:  # scheduled without passing update_state_after_alloc: nothing to save
                continue
            seq = _Seq(rid, request.all_token_ids, list(self._block_ids_of(rid)), num_computed)
            items.append(_Scheduled(seq, scheduler_output.num_scheduled_tokens[rid]))
            self._last[rid] = (seq.block_table, num_computed + items[-1].num_new_tokens)
        held, self._held = frozenset(self._held), set()
        transfers = self.scheduler.build_connector_meta(_Step(items))
        self._announce(transfers)
        return transfers, held

    def _announce(self, transfers: StepTransfers) -> None:
        """vLLM KV events for the chunks this step hands to the saver (when vLLM publishes events)."""
        saves = [*transfers.saves, *transfers.preempt_saves]
        if not saves:
            return
        from kvstore.connectors.vllm_stats import removed_events, stored_events  # noqa: PLC0415

        cs = self.scheduler.chunk_size
        parents: dict[str, str | None] = {}
        tokens: dict[str, list[int]] = {}
        for spec in saves:
            keys = self.scheduler.chunk_keys_of(spec.request_id)
            request = self._requests.get(spec.request_id)
            if keys is None or request is None:
                continue
            c = spec.chunk_index
            parents[spec.key] = keys.keys[c - 1] if c > 0 else None
            n = len(spec.block_ids) * self.scheduler.block_size
            tokens[spec.key] = list(request.all_token_ids[c * cs : c * cs + n])
        self._events += stored_events(saves, parents, tokens, cs)
        self._events += removed_events([k for spec in saves for k in spec.replaces])

    def take_events(self) -> list[Any]:
        events, self._events = self._events, []
        return events

    def reset(self) -> None:
        """Forget cached lookup answers (vLLM's reset of its prefix cache, with the connector's)."""
        self.scheduler.reset_lookups()

    def _preempted(self, rid: str) -> None:
        request, last = self._requests.get(rid), self._last.pop(rid, None)
        if request is None or last is None:
            return
        block_ids, done = last
        tokens = request.all_token_ids
        # no KV past the last token known (a rejected draft token's KV, an output not yet appended)
        done = min(done, len(tokens) - 1)
        self.scheduler.request_preempted(_Seq(rid, tokens, block_ids, done), block_ids)

    def request_finished(self, request: Any, block_ids: Sequence[int]) -> tuple[bool, dict | None]:
        self._requests.pop(request.request_id, None)
        self._last.pop(request.request_id, None)
        delay, params = self.scheduler.request_finished(request, block_ids)
        if delay:
            self._held.add(request.request_id)
        return delay, params
