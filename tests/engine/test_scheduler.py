"""Scheduler invariants, driven by a deterministic stand-in for the model: the next token is a hash
of the whole token history, so any scheduling bug (lost tokens, wrong order, a sample taken from a
partial prefill) changes the outputs."""

from __future__ import annotations

import zlib

import pytest
from kvstore.engine.block_manager import BlockManager
from kvstore.engine.sampling_params import SamplingParams
from kvstore.engine.scheduler import Scheduler, SchedulerConfig
from kvstore.engine.sequence import Sequence, SequenceStatus

BS = 4
EOS = 0


def next_token(tokens: list[int]) -> int:
    return 1 + zlib.crc32(bytes(str(tokens), "ascii")) % 97


def make(num_blocks: int = 64, budget: int = 32, max_seqs: int = 8, max_len: int = 256, cache: bool = True):
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=cache)
    return Scheduler(SchedulerConfig(budget, max_seqs, max_len), bm, eos_token_ids={EOS})


def seq(rid: str, n: int, start: int = 1, **params) -> Sequence:
    params.setdefault("max_tokens", 6)
    params.setdefault("ignore_eos", True)
    return Sequence(rid, [(start + i) % 90 + 1 for i in range(n)], SamplingParams(**params))


def step(sched: Scheduler, log: list | None = None):
    out = sched.schedule()
    cfg = sched.config
    assert out.num_batched_tokens <= cfg.max_num_batched_tokens
    assert len(out.scheduled) <= cfg.max_num_seqs
    assert len({id(s.seq) for s in out.scheduled}) == len(out.scheduled), "a sequence twice in a step"
    sampled = []
    for s in out.scheduled:
        q = s.seq
        assert q.num_computed_tokens + s.num_new_tokens <= q.num_tokens
        assert len(q.block_table) * BS >= q.num_computed_tokens + s.num_new_tokens
        sampled.append(next_token(q.all_token_ids) if s.samples else None)
    if log is not None:
        log.append(out)
    sched.update_from_output(out, sampled)
    sched.block_manager.check_invariants(sched.running)
    return out


def run(sched: Scheduler, seqs: list[Sequence], log: list | None = None, max_steps: int = 2000) -> None:
    for s in seqs:
        sched.add_sequence(s)
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        step(sched, log)
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks, "leaked blocks"


def reference(s: Sequence) -> list[int]:
    tokens = list(s.prompt_token_ids)
    for _ in range(s.sampling_params.max_tokens):
        tokens.append(next_token(tokens))
    return tokens[s.num_prompt_tokens :]


def test_continuous_batching_matches_sequential_reference() -> None:
    sched = make(budget=16, max_seqs=3)
    seqs = [seq(f"r{i}", 3 + 5 * i, start=7 * i, max_tokens=4 + i) for i in range(6)]
    log: list = []
    run(sched, seqs, log)
    for s in seqs:
        assert s.output_token_ids == reference(s)
        assert s.status is SequenceStatus.FINISHED_LENGTH
    assert max(len(o.scheduled) for o in log) == 3
    assert all(len(o.scheduled) <= 3 for o in log)


def test_chunked_prefill_splits_a_long_prompt_and_mixes_with_decodes() -> None:
    sched = make(budget=8)
    short, long = seq("short", 3, max_tokens=10), seq("long", 30, start=40)
    log: list = []
    sched.add_sequence(short)
    step(sched, log)  # short prefilled alone
    run(sched, [long], log)
    chunks = [x.num_new_tokens for o in log for x in o.scheduled if x.seq is long]
    assert sum(chunks[: len(chunks) - long.sampling_params.max_tokens + 1]) == 30
    assert max(chunks) <= 8 and len(chunks) >= 5
    mixed = [o for o in log if {x.seq.request_id for x in o.scheduled} == {"short", "long"}]
    assert any(
        any(x.num_new_tokens == 1 for x in o.scheduled) and any(x.num_new_tokens > 1 for x in o.scheduled)
        for o in mixed
    )
    assert long.output_token_ids == reference(long) and short.output_token_ids == reference(short)


def test_preemption_recomputes_newest_and_outputs_do_not_change() -> None:
    # 10 blocks of 4 = 40 slots; three sequences growing to 18 tokens each cannot all stay.
    sched = make(num_blocks=10, budget=64, max_len=64)
    seqs = [seq(f"r{i}", 10, start=20 * i, max_tokens=8) for i in range(3)]
    log: list = []
    run(sched, seqs, log)
    preempted = [p.request_id for o in log for p in o.preempted]
    assert preempted, "the test must actually preempt"
    assert preempted[0] == "r2", "the newest running sequence is the victim"
    assert sched.num_preemptions == len(preempted)
    for s in seqs:
        assert s.output_token_ids == reference(s)


def test_preemption_frees_every_block() -> None:
    sched = make(num_blocks=10, budget=64, max_len=64, cache=False)
    for i in range(3):
        sched.add_sequence(seq(f"r{i}", 10, start=20 * i, max_tokens=8))
    while True:
        out = step(sched)
        if out.preempted:
            break
    for victim in out.preempted:
        assert victim.block_table == [] and victim.num_computed_tokens == 0
        assert (
            victim.status is SequenceStatus.WAITING and sched.waiting[0] is victim or victim in sched.waiting
        )
    held = sum(len(s.block_table) for s in sched.running)
    assert sched.block_manager.num_free_blocks == 10 - held


def test_recomputed_tokens_are_not_counted_as_prefix_hits() -> None:
    sched = make(num_blocks=10, budget=64, max_len=64)
    run(sched, [seq(f"r{i}", 10, start=20 * i, max_tokens=8) for i in range(3)])
    bm = sched.block_manager
    assert sched.num_preemptions > 0
    assert bm.prefix_cache_queries == 30 and bm.prefix_cache_hits == 0


def test_prefix_hit_skips_full_blocks_but_recomputes_last_token() -> None:
    sched = make()
    a = seq("a", 12)
    run(sched, [a])
    b = seq("b", 12)  # same prompt: 3 full blocks, but the last token must be recomputed
    log: list = []
    run(sched, [b], log)
    first = log[0].scheduled[0]
    assert b.num_cached_tokens == 8 and first.num_new_tokens == 4
    assert b.output_token_ids == a.output_token_ids
    assert sched.block_manager.prefix_cache_hits == 8


def test_abort_in_prefill_and_decode_leaks_nothing() -> None:
    sched = make(budget=4)
    a, b, c = seq("a", 20), seq("b", 3, max_tokens=50), seq("c", 5)
    for s in (a, b, c):
        sched.add_sequence(s)
    step(sched)
    step(sched)
    assert a.status is SequenceStatus.RUNNING and a.num_computed_tokens < a.num_tokens
    assert sched.abort("a") is a and a.status is SequenceStatus.FINISHED_ABORTED
    for _ in range(6):
        step(sched)
    assert b.num_output_tokens > 0 and not b.is_finished
    sched.abort("b")
    sched.abort("c")
    assert sched.abort("missing") is None
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    sched.block_manager.check_invariants([])


@pytest.mark.parametrize(
    ("params", "reason", "length"),
    [
        ({"max_tokens": 3}, SequenceStatus.FINISHED_LENGTH, 3),
        ({"max_tokens": 20, "ignore_eos": False}, SequenceStatus.FINISHED_STOPPED, None),
        ({"max_tokens": 20, "ignore_eos": False, "min_tokens": 20}, SequenceStatus.FINISHED_LENGTH, 20),
        ({"max_tokens": 20, "stop_token_ids": ["STOP"]}, SequenceStatus.FINISHED_STOPPED, None),
    ],
)
def test_stop_conditions(params: dict, reason: SequenceStatus, length: int | None) -> None:
    s0 = seq("probe", 5, max_tokens=20)
    stop_at = reference(s0)[1]
    params = dict(params)
    if params.get("stop_token_ids") == ["STOP"]:
        params["stop_token_ids"] = [stop_at]
    sched = make()
    sched.eos_token_ids = {stop_at} if params.get("ignore_eos") is False else {EOS}
    s = seq("s", 5, **params)
    run(sched, [s])
    assert s.status is reason
    assert s.num_output_tokens == (length if length is not None else 2)
    if reason is SequenceStatus.FINISHED_STOPPED and "stop_token_ids" in params:
        assert s.stop_reason == stop_at


def test_max_model_len_finishes_with_length() -> None:
    sched = make(max_len=12)
    s = seq("s", 10, max_tokens=50)
    run(sched, [s])
    assert s.status is SequenceStatus.FINISHED_LENGTH and s.num_tokens == 12


def test_request_that_can_never_fit_fails_alone_instead_of_hanging() -> None:
    sched = make(num_blocks=2, max_len=64)
    big = seq("big", 20)
    sched.add_sequence(big)
    out = sched.schedule()
    assert out.is_empty and out.failed == [big] and "does not fit" in big.error
    assert big.finish_reason == "abort" and not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 2


class PrefixFromStore:
    """The scheduler side of a KV connector whose store holds every prompt but its last token (the
    KV is never written here: this drives admission only)."""

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed: int) -> tuple[int, bool]:
        if seq.num_preemptions or seq.num_computed_tokens:
            return 0, False
        return max(0, (seq.num_prompt_tokens - 1) // BS * BS - num_computed), False

    def update_state_after_alloc(self, seq: Sequence, block_table: list[int], num_external: int) -> None:
        pass

    def build_connector_meta(self, out) -> None:
        return None

    def request_finished(self, seq: Sequence, block_table: list[int]) -> tuple[bool, None]:
        return False, None


def test_a_store_hit_is_not_admitted_into_the_room_the_running_ones_grow_into():
    """A store hit claims its whole prefix in one step. Admitted into the last free blocks, it would
    only preempt the running sequences at their next block (which then recompute): it waits until
    each running sequence has room for one more block."""
    bm = BlockManager(12, BS, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(64, 8, 256), bm, eos_token_ids={EOS}, connector=PrefixFromStore())
    a, b = seq("a", 16, max_tokens=8), seq("b", 16, start=40, max_tokens=8)  # 4 blocks each, growing to 6
    hit = seq("hit", 13, start=70, max_tokens=4)  # 12 tokens from the store: 4 blocks with its last token
    log: list = []
    run(sched, [a, b, hit], log)
    assert sched.num_preemptions == 0
    assert a.is_finished and b.is_finished and hit.is_finished
    first = next(i for i, out in enumerate(log) if any(s.seq is hit for s in out.scheduled))
    assert first > 0, "admitted beside a and b although it would take the blocks they grow into"


def test_a_store_hit_leaves_room_for_the_running_ones_to_reach_max_tokens():
    """Room for one more block each would admit the hit here, and a and b (growing from 4 to 6 blocks)
    would preempt it or each other two steps later; the hit waits for room to their max_tokens."""
    bm = BlockManager(14, BS, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(64, 8, 256), bm, eos_token_ids={EOS}, connector=PrefixFromStore())
    a, b = seq("a", 16, max_tokens=8), seq("b", 16, start=40, max_tokens=8)
    hit = seq("hit", 13, start=70, max_tokens=4)
    log: list = []
    run(sched, [a, b, hit], log)
    assert sched.num_preemptions == 0
    first = next(i for i, out in enumerate(log) if any(s.seq is hit for s in out.scheduled))
    assert first >= 7, first  # a and b finish their 8 tokens first


def test_the_growth_reserve_is_capped():
    """A running sequence with a long max_tokens reserves at most HIT_RESERVE_BLOCKS: a hit that fits
    beside that is admitted while it runs."""
    from kvstore.engine.scheduler import HIT_RESERVE_BLOCKS

    bm = BlockManager(5 + HIT_RESERVE_BLOCKS + 4, BS, enable_prefix_caching=False)
    assert bm.num_blocks - 5 - 4 < (16 + 200) // BS - 4  # uncapped, long's growth would not fit
    sched = Scheduler(SchedulerConfig(64, 8, 256), bm, eos_token_ids={EOS}, connector=PrefixFromStore())
    long = seq("long", 16, max_tokens=200)  # would grow by 50 blocks
    hit = seq("hit", 13, start=70, max_tokens=4)
    for s in (long, hit):
        sched.add_sequence(s)
    log: list = []
    for _ in range(3):
        step(sched, log)
    assert any(s.seq is hit for out in log for s in out.scheduled)
    assert long in sched.running and sched.num_preemptions == 0
