"""Partial chunks (Spec 1's partial keys): a finished request's trailing partial chunk is stored, a
longer prompt with the same tokens loads it, a different tail never does, a full chunk always wins,
and a longer chunk replaces the shorter partials it supersedes."""

from __future__ import annotations

import torch

from kvstore.keys import partial_key
from tests.connectors.sim import Req, make_config, prompt, truth_kv

PARTIAL = "kvstore_connector_partial_chunks_total"


def finish(engine, req: Req) -> None:
    """What the engine does when a request ends: request_finished, then the step that hands over
    its partial chunk, then wait until the store has it."""
    engine.finish(req)
    engine.step([])
    engine.worker.flush()


def serve(engine, req: Req, decode: list[int] = ()) -> int:
    """Prefill `req` (loading what the store has), decode `decode` one token a step, finish it."""
    ext = engine.prefill(req)
    for tok in decode:
        req.all_token_ids.append(tok)
        engine.step([(req, 1)])
    finish(engine, req)
    return ext


def kv_equal(engine, req: Req) -> bool:
    n = len(req.all_token_ids)
    return torch.equal(engine.read(req, 0, n), truth_kv(req.all_token_ids, 0, n, engine.dtype))


def test_a_longer_prompt_reuses_the_partial_tail(engines) -> None:
    config = make_config(local_cpu_capacity="64MiB")
    a, b = engines(config, seed=1), engines(config, seed=2)
    turn1 = Req("t1", prompt(300, seed=1))
    serve(a, turn1, decode=prompt(20, seed=2))  # 320 tokens computed: chunk 0 + a 64-token partial
    assert a.worker.metrics.snapshot()[PARTIAL + "{event=saved}"] == 1
    turn2 = Req("t2", turn1.all_token_ids + prompt(40, seed=3))  # the next turn: history + a message
    assert b.admit(turn2) == 320, "chunk 0 and the whole partial tail come from the store"
    assert b.step([(turn2, 360 - 320)]) == set()
    assert kv_equal(b, turn2)
    snap = b.worker.metrics.snapshot()
    assert snap[PARTIAL + "{event=loaded}"] == 1
    assert snap["kvstore_connector_loaded_tokens_total"] == 320


def test_a_different_tail_is_a_miss_even_where_its_first_tokens_agree(engines) -> None:
    config = make_config(local_cpu_capacity="64MiB")
    a, b = engines(config, seed=1), engines(config, seed=2)
    turn1 = Req("t1", prompt(320, seed=4))
    serve(a, turn1)  # stored: chunk 0 and tokens 256..320 as a partial
    other = Req("o", turn1.all_token_ids[:300] + prompt(60, seed=5))  # agrees up to token 300 only
    assert b.admit(other) == 256, "the partial's key covers all 64 of its tokens: not served"
    b.step([(other, 360 - 256)])
    assert kv_equal(b, other) and not b.load_errors
    assert b.worker.metrics.snapshot()[PARTIAL + "{event=loaded}"] == 0


def test_a_partial_never_shadows_a_full_chunk(engines) -> None:
    config = make_config(local_cpu_capacity="64MiB")
    a, b = engines(config, seed=1), engines(config, seed=2)
    long = prompt(600, seed=6)
    serve(a, Req("long", long))  # full chunks 0 and 1 (and a partial of chunk 2)
    serve(a, Req("short", long[:300]))  # a 32-token partial of chunk 1: a prefix of the full chunk 1
    layout = config.layout
    assert a.scheduler.handle.store.exists(partial_key(long[:288], layout))
    req = Req("r", long[:560])
    assert b.admit(req) == 512, "the full chunk 1, not the shorter partial at the same place"
    b.step([(req, 560 - 512)])
    assert kv_equal(b, req)
    assert b.worker.metrics.snapshot()[PARTIAL + "{event=loaded}"] == 0


def test_a_longer_chunk_replaces_the_partials_it_supersedes(engines) -> None:
    config = make_config(local_cpu_capacity="64MiB")
    eng = engines(config)
    store, layout = eng.scheduler.handle.store, config.layout
    history = prompt(300, seed=7)
    serve(eng, Req("t1", history))
    first = partial_key(history[:288], layout)
    assert store.exists(first)

    history = history + prompt(40, seed=8)  # turn 2 ends at 340: a 80-token partial of chunk 1
    assert serve(eng, Req("t2", history)) == 288, "turn 2 loaded turn 1's partial"
    second = partial_key(history[:336], layout)
    assert store.exists(second) and not store.exists(first), "replaced, not kept as a near-duplicate"

    history = history + prompt(200, seed=9)  # turn 3 fills chunk 1: the full chunk replaces the partial
    serve(eng, Req("t3", history))
    assert not store.exists(second)
    snap = eng.worker.metrics.snapshot()
    assert snap[PARTIAL + "{event=saved}"] == 3 and snap[PARTIAL + "{event=replaced}"] == 2
    assert snap["kvstore_connector_saved_chunks_total"] == 2 + 3  # full chunks 0 and 1, three partials


def test_a_mixed_fleet_keeps_the_partial_each_block_size_can_use(engines) -> None:
    """vLLM (128-token blocks) and kvstore-engine (16) share a store: the fine engine's longer,
    16-aligned partial must not delete the 128-aligned one, the longest the coarse engine can use."""
    fine = make_config(local_cpu_capacity="64MiB")
    coarse = make_config(local_cpu_capacity="64MiB", block_size=128)
    vllm_like, engine_like = engines(coarse, num_blocks=16, seed=1), engines(fine, seed=2)
    store, layout = engine_like.scheduler.handle.store, fine.layout
    history = prompt(400, seed=10)  # chunk 0, then 144 tokens of chunk 1
    serve(vllm_like, Req("v1", history))  # its partial: the 128 tokens its blocks hold
    assert store.exists(partial_key(history[:384], layout))
    assert serve(engine_like, Req("k1", history)) == 384  # it loads vLLM's partial, stores its 144
    assert store.exists(partial_key(history, layout)) and store.exists(partial_key(history[:384], layout))
    turn = history + prompt(60, seed=11)
    assert engines(coarse, num_blocks=16, seed=3).admit(Req("v2", turn)) == 384, (
        "vLLM's partial is still there"
    )
    assert engines(fine, seed=4).admit(Req("k2", turn)) == 400, "and the longer one for kvstore-engine"
    # a full chunk serves every block size: it replaces both
    history = turn + prompt(60, seed=12)  # 520 tokens: chunk 1 is full
    serve(engine_like, Req("k3", history))
    assert not store.exists(partial_key(turn[:384], layout)) and not store.exists(
        partial_key(turn[:400], layout)
    )
