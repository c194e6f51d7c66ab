"""The kvstore connector against a real in-process store: what it matches, loads and saves."""

from __future__ import annotations

import pytest
import torch
from kvstore.connectors.base import KVConnectorRole
from kvstore.connectors.config import KVTransferConfig
from kvstore.connectors.kvstore import KVStoreConnector

from kvstore.errors import CodecError, InvalidArgument
from tests.connectors.sim import HEAD_DIM, KV_HEADS, LAYERS, Req, make_config, prompt, truth_kv
from tests.waiting import wait_until


def kv_equal(engine, req: Req, lo: int, hi: int) -> bool:
    return torch.equal(engine.read(req, lo, hi), truth_kv(req.all_token_ids, lo, hi, engine.dtype))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_store_hit_in_another_engine_is_bit_exact(engines, dtype: str) -> None:
    config = make_config(dtype, local_cpu_capacity="64MiB")
    a, b = engines(config, seed=1), engines(config, seed=2)
    tokens = prompt(600, seed=1)
    assert a.prefill(Req("r1", tokens)) == 0
    a.worker.flush()
    req = Req("r2", tokens)
    assert b.admit(req) == 512  # two full chunks; the 88-token tail is computed
    assert b.step([(req, 600 - 512)]) == set()
    assert kv_equal(b, req, 0, 600)
    snap = b.worker.metrics.snapshot()  # one store, one set of metrics, shared by a and b
    assert snap["vllm:external_prefix_cache_queries_total"] == 1200
    assert snap["vllm:external_prefix_cache_hits_total"] == 512
    assert snap["kvstore_connector_loaded_tokens_total"] == 512
    assert snap["kvstore_connector_saved_chunks_total"] == 2
    assert snap["kvstore_connector_chunk_misses_total{reason=not_stored}"] == 2  # a's cold lookup


def test_match_is_block_aligned_and_leaves_the_last_token(engines) -> None:
    config = make_config(local_cpu_capacity="64MiB")
    a, b = engines(config, seed=1), engines(config, seed=2)
    tokens = prompt(512, seed=2)
    a.prefill(Req("r1", tokens))
    a.worker.flush()
    req = Req("r2", tokens)
    # 512 tokens, both chunks stored: the last token is recomputed, so 511 -> 496 (31 blocks)
    assert b.scheduler.get_num_new_matched_tokens(req, 0) == (496, False)
    # the engine already holds 10 blocks itself: the store adds the rest of the capped range
    assert b.scheduler.get_num_new_matched_tokens(req, 160) == (336, False)
    assert b.admit(req, local_computed=160) == 336
    b.write(req, 0, 160, truth_kv(tokens, 0, 160, b.dtype))  # the engine's own prefix-cache blocks
    b.step([(req, 512 - 496)])
    assert kv_equal(b, req, 0, 512) and not b.load_errors
    short = Req("r3", tokens[:256])  # one chunk stored but the cap (255 -> 240) cuts into it
    assert b.scheduler.get_num_new_matched_tokens(short, 0) == (240, False)
    assert b.scheduler.get_num_new_matched_tokens(Req("r4", tokens[:200]), 0) == (0, False)


def test_lookup_is_one_round_trip_without_side_effects(engines, spy_store) -> None:
    config = make_config(local_cpu_capacity="64MiB")
    a = engines(config)
    spy = spy_store(a)
    tokens = prompt(700, seed=3)
    a.prefill(Req("r1", tokens))
    a.worker.flush()
    req = Req("r2", tokens)
    before = a.scheduler.metrics.snapshot()
    spy.calls.clear()
    answers = [a.scheduler.get_num_new_matched_tokens(req, 0) for _ in range(3)]
    assert answers == [(512, False)] * 3
    assert spy.calls == {"lookup_and_exists": 1}, "full chunks and partial candidates in one call, once"
    after = a.scheduler.metrics.snapshot()
    changed = {k for k in after if after[k] != before[k] and "lookup_seconds" not in k}
    assert changed == set(), "asking is free of side effects: nothing is counted until allocation"
    spy.calls.clear()
    assert a.scheduler.get_num_new_matched_tokens(req, 688) == (0, False)
    assert spy.calls == {}, "nothing to gain beyond the engine's own 688 tokens (the cap): no round trip"


def test_generated_chunks_are_saved_and_a_preempted_request_reloads(engines, spy_store) -> None:
    config = make_config(local_cpu_capacity="64MiB")
    eng = engines(config)
    req = Req("r1", prompt(250, seed=4))
    eng.prefill(req)
    gen = prompt(300, seed=5)
    while len(req.all_token_ids) < 530:  # decode: one new token per step, chunks fill at 256 and 512
        req.all_token_ids.append(gen[len(req.all_token_ids) - 250])
        eng.step([(req, 1)])
    eng.worker.flush()
    snap = eng.worker.metrics.snapshot()
    assert snap["kvstore_connector_saved_chunks_total"] == 2
    # preemption: blocks freed (here: dropped), KV recomputed from the store on resume
    req.block_table, req.num_computed_tokens, req.num_preemptions = [], 0, 1
    assert eng.admit(req) == 512
    spy = spy_store(eng)
    eng.step([(req, 530 - 512)])
    eng.worker.flush()
    assert kv_equal(eng, req, 0, 530)
    snap = eng.worker.metrics.snapshot()
    assert snap["kvstore_connector_preempted_hits_total"] == 512
    assert snap["kvstore_connector_preempted_queries_total"] == 530
    assert snap["vllm:external_prefix_cache_hits_total"] == 0, "a resumed request's own KV is no hit"
    # loaded chunks are not saved again: no save is even planned (a planned one would reach the store
    # as an existence check and count as skipped, so the saved count alone cannot tell)
    assert "batch_put" not in spy.calls and "batch_exists" not in spy.calls, spy.calls
    assert snap["kvstore_connector_saved_chunks_total"] == 2
    assert snap["kvstore_connector_skipped_saves_total"] == 0


def test_a_preempted_request_keeps_its_partial_chunk_though_the_step_reuses_its_blocks(engines) -> None:
    config = make_config(local_cpu_capacity="64MiB")
    eng = engines(config)
    req = Req("r1", prompt(300, seed=4))
    eng.prefill(req)  # chunk 0 saved as it filled; tokens 256..300 only in the engine's blocks
    gen = prompt(10, seed=5)
    for t in gen:  # decode to 310 computed tokens (the 311th is sampled, not computed)
        req.all_token_ids.append(t)
        eng.step([(req, 1)])
    req.all_token_ids.append(7)
    old_blocks = list(req.block_table)
    eng.preempt(req)
    other = Req("r2", prompt(400, seed=6))  # takes the freed blocks and writes its own KV into them
    eng.admit(other, use_external=False)
    assert set(old_blocks) <= set(other.block_table)
    eng.step([(other, 400)])
    eng.worker.flush()
    snap = eng.worker.metrics.snapshot()
    assert snap["kvstore_connector_partial_chunks_total{event=saved}"] == 1
    # resume: chunk 0 and the 48-token partial (310 computed, block-aligned: 304 -> 48 of chunk 1)
    assert eng.admit(req) == 304
    eng.step([(req, 311 - 304)])
    assert kv_equal(eng, req, 0, 311), "the partial holds the preempted KV, not what reused its blocks"
    # without partial chunks a preemption saves nothing beyond the full chunks
    plain = engines(make_config(local_cpu_capacity="64MiB", partial_chunks=False), seed=3)
    req3 = Req("r3", prompt(300, seed=8))
    plain.prefill(req3)
    plain.preempt(req3)
    plain.step([])
    plain.worker.flush()
    snap = plain.worker.metrics.snapshot()  # the same store as eng's: the same metrics
    assert snap["kvstore_connector_partial_chunks_total{event=saved}"] == 1
    assert plain.admit(req3) == 256


def test_finished_request_frees_its_blocks_once_copied_out_while_the_save_still_runs(
    engines, spy_store
) -> None:
    config = make_config(local_cpu_capacity="64MiB")
    a, b = engines(config, seed=1), engines(config, seed=2)
    spy = spy_store(a)
    spy.release.clear()  # the store hangs on batch_put
    tokens = prompt(300, seed=6)
    req = Req("r1", tokens)
    a.prefill(req)
    assert a.finish(req) is True, "its partial chunk (tokens 256..288) is not copied out yet"
    a.step([])  # the engine hands the partial chunk over: copied out, the blocks are free
    assert a.worker.get_finished({"r1"}) == ({"r1"}, None)
    assert a.worker.get_finished(set()) == (None, None), "reported once"
    for cache in a.caches:  # the engine reuses the blocks: the hung save must not see this
        cache.fill_(float("nan"))
    spy.release.set()
    a.worker.flush()
    req2 = Req("r2", tokens)
    assert b.admit(req2) == 288  # chunk 0 and the 32-token partial of chunk 1; 288 = the cap
    b.step([(req2, 300 - 288)])
    assert kv_equal(b, req2, 0, 300)
    idle = Req("r3", prompt(10, seed=7))  # less than a block: nothing to save, nothing to wait for
    a.admit(idle)
    a.step([(idle, 10)])
    assert a.finish(idle) is False


def test_a_prefill_instance_keeps_the_blocks_until_the_store_has_the_kv(engines, spy_store) -> None:
    a = engines(make_config(local_cpu_capacity="64MiB", kv_role="prefill"), seed=1)
    spy = spy_store(a)
    spy.release.clear()
    req = Req("r1", prompt(300, seed=6))
    a.prefill(req)
    assert a.finish(req) is True
    a.step([])
    assert a.worker.get_finished({"r1"}) == (None, None), "its saves are still in flight"
    spy.release.set()
    a.worker.flush()
    assert a.worker.get_finished(set()) == ({"r1"}, None)


def test_decode_role_loads_but_never_saves(engines, spy_store) -> None:
    producer = engines(make_config(local_cpu_capacity="64MiB", kv_role="prefill"), seed=1)
    consumer = engines(make_config(local_cpu_capacity="64MiB", kv_role="decode"), seed=2)
    tokens = prompt(520, seed=8)
    producer.prefill(Req("p", tokens))
    producer.worker.flush()
    spy = spy_store(consumer)
    req = Req("d", tokens + [5])
    assert consumer.prefill(req) == 512
    consumer.worker.flush()
    assert kv_equal(consumer, req, 0, 521)
    assert spy.calls == {"lookup_and_exists": 1, "lease_blobs": 1}, "one lookup, one load, no save"
    assert consumer.finish(req) is False


def test_full_save_queue_drops_instead_of_blocking(engines, spy_store) -> None:
    eng = engines(make_config(local_cpu_capacity="64MiB", max_pending_saves=1))
    spy = spy_store(eng)
    spy.release.clear()
    req = Req("r1", prompt(800, seed=9))
    eng.prefill(req)  # three chunks: one copied out and queued, two dropped; the step did not block
    snap = eng.worker.metrics.snapshot()
    assert snap["kvstore_connector_dropped_saves_total{reason=queue_full}"] == 2
    assert snap["kvstore_connector_pending_saves"] == 1
    assert eng.finish(req) is True
    spy.release.set()
    eng.worker.flush()
    assert eng.worker.get_finished({"r1"}) == ({"r1"}, None)
    assert eng.worker.metrics.snapshot()["kvstore_connector_saved_chunks_total"] == 1


def test_chunks_already_stored_are_not_encoded_again(engines) -> None:
    config = make_config(local_cpu_capacity="64MiB")
    a, b = engines(config, seed=1), engines(config, seed=2)
    tokens = prompt(600, seed=10)
    a.prefill(Req("r1", tokens))
    a.worker.flush()
    req = Req("r2", tokens)
    b.admit(req, use_external=False)  # b decides to recompute; its chunks then exist already
    b.step([(req, 600)])
    b.worker.flush()
    snap = b.worker.metrics.snapshot()
    assert snap["kvstore_connector_saved_chunks_total"] == 2
    assert snap["kvstore_connector_skipped_saves_total"] == 0, "the lookup said stored: not even copied"


@pytest.mark.parametrize("codec", ["fp8", "int4"])
def test_lossy_codecs_round_trip_close(engines, codec: str) -> None:
    config = make_config("float16", local_cpu_capacity="64MiB", codec=codec)
    a, b = engines(config, seed=1), engines(config, seed=2)
    tokens = prompt(300, seed=11)
    a.prefill(Req("r1", tokens))
    a.worker.flush()
    req = Req("r2", tokens)
    assert b.prefill(req) == 256
    got, want = b.read(req, 0, 256).float(), truth_kv(tokens, 0, 256, torch.float16).float()
    assert not torch.equal(got, want), "a lossy codec that is bit-exact is not the codec asked for"
    assert (got - want).abs().mean() < 0.1 * want.abs().mean()
    snap = b.worker.metrics.snapshot()
    assert snap["kvstore_connector_save_bytes_total"] < 256 * 2 * LAYERS * KV_HEADS * HEAD_DIM * 2 * 0.6


def test_a_codec_that_cannot_encode_the_layout_fails_at_registration() -> None:
    config = KVTransferConfig(codec="int4", local_cpu_capacity="16MiB").for_engine(
        model_name="m", model_config_hash="h", num_layers=2, num_kv_heads=1, head_dim=8,
        kv_dtype="float16", block_size=16,
    )  # fmt: skip
    worker = KVStoreConnector(KVConnectorRole.WORKER, config)
    try:
        with pytest.raises(CodecError):  # int4 groups of 64 channels cannot split head_dim 8
            worker.register_kv_caches([torch.zeros(2, 32, 16, 1, 8, dtype=torch.float16)] * 2)
        with pytest.raises(InvalidArgument):  # and a cache that is not the configured layout
            worker.register_kv_caches([torch.zeros(2, 32, 16, 1, 8)] * 3)
    finally:
        worker.shutdown()


def test_async_load_is_reported_by_get_finished(engines) -> None:
    config = make_config(local_cpu_capacity="64MiB", load_async=True)
    a, b = engines(config, seed=1), engines(config, seed=2)
    tokens = prompt(600, seed=12)
    a.prefill(Req("r1", tokens))
    a.worker.flush()
    req = Req("r2", tokens)
    assert b.scheduler.get_num_new_matched_tokens(req, 0) == (512, True)
    b.admit(req)
    b.step([])  # the load step: nothing is computed for r2 until its KV has arrived
    finished: list[set | None] = []
    wait_until(lambda: finished.append(b.worker.get_finished(set())[1]) or finished[-1] is not None, 30, 0.01)
    assert finished[-1] == {"r2"}
    b.step([(req, 600 - 512)])
    assert kv_equal(b, req, 0, 600) and not b.load_errors


@pytest.mark.parametrize(("tiers", "on_caller"), [(["cpu"], True), (["cpu", "disk"], False)])
def test_lookups_of_an_in_memory_store_run_on_the_callers_thread(tmp_path, tiers, on_caller: bool) -> None:
    """Only a store that cannot hang skips the deadline thread: an in-process store of memory tiers.
    A disk tier can stall on I/O, so its lookups keep the hop and the deadline."""
    import threading  # noqa: PLC0415

    from kvstore.connectors.store_handle import acquire_store, release_store  # noqa: PLC0415

    config = make_config(local_tiers=tiers, local_disk_path=str(tmp_path))
    handle = acquire_store(config)
    try:
        ran_on = handle.lookup(0.25, lambda store: threading.current_thread())
        assert (ran_on is threading.current_thread()) is on_caller
    finally:
        release_store(handle)
