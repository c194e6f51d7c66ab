"""The engine's scheduler driving a real KVStoreConnector (real local store), without a model: what
it admits, allocates and rewinds. Fast; the SmolLM2 tests cover the same path end to end."""

from __future__ import annotations

import pytest
import torch
from kvstore.connectors.base import KVConnectorRole
from kvstore.connectors.factory import create_connector
from kvstore.engine.block_manager import BlockManager
from kvstore.engine.sampling_params import SamplingParams
from kvstore.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvstore.engine.sequence import Sequence, SequenceStatus

from kvstore.blob import encode_blob
from kvstore.keys import KVLayout, root_key

BS = 16
LAYOUT = {"model_name": "sched", "model_config_hash": "0" * 32, "num_layers": 2, "num_kv_heads": 1,
          "head_dim": 8, "kv_dtype": "float32"}  # fmt: skip


@pytest.fixture
def scheduler_pair():
    base = {"store_url": "local", "block_size": BS, "layout": LAYOUT, "local_cpu_capacity": 2**26}
    made = []

    def make(num_blocks: int = 64, prefix_caching: bool = True, load_async: bool = False) -> Scheduler:
        config = {**base, "load_async": load_async}
        connector = create_connector("kvstore", KVConnectorRole.SCHEDULER, config)
        made.append(connector)
        root = root_key(KVLayout(**LAYOUT, chunk_size=BS))
        bm = BlockManager(num_blocks, BS, prefix_caching, root)
        return Scheduler(SchedulerConfig(max_num_batched_tokens=2048), bm, {0}, connector)

    yield make
    for c in made:
        c.shutdown()


def seq(rid: str, n: int) -> Sequence:
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(temperature=0.0, max_tokens=4))


def store_chunks(sched: Scheduler, n_tokens: int) -> None:
    """Put every full chunk of the prompt `seq(_, n_tokens)` in the store."""
    probe = seq("probe", n_tokens)
    for k in sched.connector.scheduler._chunk_keys(probe).keys:
        sched.connector.handle.store.put(k, encode_blob(torch.zeros(2, 2, 256, 1, 8)))
    sched.connector.request_finished(probe, [])


def test_admission_counts_store_tokens_as_computed_and_allocates_their_blocks(scheduler_pair) -> None:
    sched = scheduler_pair()
    store_chunks(sched, 600)
    s = seq("r1", 600)
    sched.add_sequence(s)
    out = sched.schedule()
    (item,) = out.scheduled
    assert s.num_computed_tokens == 512 and item.num_new_tokens == 600 - 512
    assert len(s.block_table) == -(-600 // BS)
    loads = out.kv_connector_metadata.payload["kvstore_transfers"].loads
    assert [(ld.start_token, ld.end_token) for ld in loads] == [(0, 512)]
    assert s.num_cached_tokens == 512


def test_a_failed_load_rewinds_to_the_first_bad_block_and_voids_the_sample(scheduler_pair) -> None:
    sched = scheduler_pair()
    store_chunks(sched, 300)
    s = seq("r1", 300)
    sched.add_sequence(s)
    out = sched.schedule()
    assert s.num_computed_tokens == 256  # chunk 0 comes from the store this step
    updated = sched.update_from_output(out, [7], {s.block_table[5]})  # ... and block 5 of it failed
    assert updated == [] and s.num_output_tokens == 0, "the sample of a step with bad KV is dropped"
    assert s.num_computed_tokens == 5 * BS, "back to the first bad block"
    out = sched.schedule()
    assert [(x.seq, x.num_new_tokens) for x in out.scheduled] == [(s, 300 - 5 * BS)]
    assert out.kv_connector_metadata.payload["kvstore_transfers"].loads == []


def test_finished_request_keeps_its_blocks_until_its_partial_chunk_is_handed_over(scheduler_pair) -> None:
    sched = scheduler_pair()
    s = seq("r1", 300)
    sched.add_sequence(s)
    out = sched.schedule()
    saves = out.kv_connector_metadata.payload["kvstore_transfers"].saves
    assert [sv.chunk_index for sv in saves] == [0]
    sched.update_from_output(out, [7])
    free_before = sched.block_manager.num_free_blocks
    sched.abort("r1")
    assert "r1" in sched.saving and sched.block_manager.num_free_blocks == free_before
    assert sched.take_finished_req_ids() == {"r1"} and sched.take_finished_req_ids() == set()
    (partial,) = sched.connector.build_connector_meta(SchedulerOutput()).payload["kvstore_transfers"].saves
    assert partial.partial and partial.chunk_index == 1
    assert partial.block_ids == tuple(s.block_table[16:18]), "tokens 256..288: two whole blocks"
    sched.finish_saves({"r1"})
    assert sched.saving == {} and sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    sched.block_manager.check_invariants([])


def test_an_async_load_waits_holding_its_blocks_while_the_others_run(scheduler_pair) -> None:
    sched = scheduler_pair(load_async=True)
    store_chunks(sched, 600)
    other = seq("other", 40)  # not in the store: computed at once
    s = seq("r1", 600)
    sched.add_sequence(other)
    sched.add_sequence(s)
    out = sched.schedule()
    assert [x.seq for x in out.scheduled] == [other], "r1 computes nothing until its KV has arrived"
    assert sched.loading == {"r1": s} and s.status is SequenceStatus.WAITING_FOR_REMOTE_KVS
    assert s.num_computed_tokens == 0 and len(s.block_table) == 512 // BS, "blocks for the load only"
    (load,) = out.kv_connector_metadata.payload["kvstore_transfers"].loads
    assert (load.start_token, load.end_token) == (0, 512)
    sched.update_from_output(out, [7])
    out = sched.schedule()  # the load is still running: r1 waits, `other` decodes
    assert [x.seq for x in out.scheduled] == [other] and sched.has_unfinished()
    sched.update_from_output(out, [8])
    sched.finish_loads({"r1"})
    assert sched.loading == {} and s.num_computed_tokens == 512
    out = sched.schedule()
    assert [(x.seq, x.num_new_tokens) for x in out.scheduled] == [(other, 1), (s, 600 - 512)]
    assert out.kv_connector_metadata.payload["kvstore_transfers"].loads == []
    sched.block_manager.check_invariants([other, s])


def test_a_failed_async_load_resumes_from_the_first_bad_block(scheduler_pair) -> None:
    sched = scheduler_pair(load_async=True)
    store_chunks(sched, 600)
    s = seq("r1", 600)
    sched.add_sequence(s)
    assert sched.schedule().is_empty
    sched.finish_loads({"r1"}, {s.block_table[20]})  # chunk 1's fifth block did not load
    assert s.num_computed_tokens == 20 * BS and s.num_cached_tokens == 20 * BS
    out = sched.schedule()
    assert [(x.seq, x.num_new_tokens) for x in out.scheduled] == [(s, 600 - 20 * BS)]


def test_a_load_error_reported_before_the_load_ends_is_kept_for_it(scheduler_pair) -> None:
    sched = scheduler_pair(load_async=True)
    store_chunks(sched, 600)
    other, s = seq("other", 40), seq("r1", 600)
    sched.add_sequence(other)
    sched.add_sequence(s)
    out = sched.schedule()
    sched.update_from_output(out, [7], {s.block_table[3]})  # reported in a step r1 was not part of
    sched.finish_loads({"r1"})
    assert s.num_computed_tokens == 3 * BS


def test_a_request_aborted_while_loading_keeps_its_blocks_until_the_load_ends(scheduler_pair) -> None:
    sched = scheduler_pair(load_async=True)
    store_chunks(sched, 600)
    s = seq("r1", 600)
    sched.add_sequence(s)
    sched.schedule()
    held = sched.block_manager.num_free_blocks
    assert sched.abort("r1") is s and s.is_finished
    assert sched.block_manager.num_free_blocks == held, "the loader may still write into them"
    sched.finish_loads({"r1"})
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    assert not sched.has_unfinished()
    sched.block_manager.check_invariants([])


def _count_lookups(sched: Scheduler, monkeypatch) -> list[int]:
    """Count the engine's asks of its connector (the connector keeps a request's answer, so a repeat
    ask costs no round trip: what these tests pin is that the scheduler does not even ask)."""
    calls = [0]
    ask = sched.connector.get_num_new_matched_tokens

    def counted(request, num_computed_tokens):
        calls[0] += 1
        return ask(request, num_computed_tokens)

    monkeypatch.setattr(sched.connector, "get_num_new_matched_tokens", counted)
    return calls


def _decode(sched: Scheduler, steps: int) -> None:
    for _ in range(steps):
        out = sched.schedule()
        sched.update_from_output(out, [5] * len(out.scheduled))


def test_a_store_hit_waiting_for_memory_is_looked_up_again_only_after_blocks_are_freed(
    scheduler_pair, monkeypatch
) -> None:
    """A hit that does not fit waits at the head of the queue; asking the store again every step
    would cost a round trip per step for the same answer, until a sequence frees blocks."""
    sched = scheduler_pair(num_blocks=20)
    store_chunks(sched, 300)
    running = Sequence("a", list(range(1000, 1200)), SamplingParams(temperature=0.0, max_tokens=50))
    sched.add_sequence(running)
    _decode(sched, 1)  # 200 tokens: 13 of the 20 blocks
    waiting = seq("b", 300)  # chunk 0 stored: 16 blocks for it, 3 more for the rest
    sched.add_sequence(waiting)
    calls = _count_lookups(sched, monkeypatch)
    _decode(sched, 20)  # `a` grows into a 14th and a 15th block meanwhile
    assert calls[0] == 1 and waiting.status is SequenceStatus.WAITING
    assert running.num_output_tokens == 21
    sched.abort("a")  # its blocks wait for the save of its partial chunk
    _decode(sched, 1)
    assert calls[0] == 1, "nothing was freed yet"
    sched.finish_saves({"a"})  # now they are free
    out = sched.schedule()
    assert calls[0] == 2 and [x.seq for x in out.scheduled] == [waiting]
    assert waiting.num_computed_tokens == 256, "admitted with its store hit"


def test_no_lookup_while_neither_a_miss_nor_the_smallest_hit_could_fit(scheduler_pair, monkeypatch) -> None:
    sched = scheduler_pair(num_blocks=20)
    store_chunks(sched, 300)
    running = Sequence("a", list(range(1000, 1300)), SamplingParams(temperature=0.0, max_tokens=50))
    sched.add_sequence(running)
    _decode(sched, 1)  # 19 blocks of 20; its growth reserve is 3
    sched.add_sequence(seq("b", 300))
    calls = _count_lookups(sched, monkeypatch)
    _decode(sched, 5)
    assert calls[0] == 0
    sched.abort("a")
    sched.finish_saves({"a"})
    _decode(sched, 1)
    assert calls[0] == 1
