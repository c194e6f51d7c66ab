"""The vLLM scheduler-side adapter with vLLM's own Request / KVCacheBlocks / SchedulerOutput objects and
a real in-process store: lookups, chunked-prefill saves, held blocks, and cache-salt isolation."""

from __future__ import annotations

import pytest
import torch
from kvstore.connectors.config import KVTransferConfig
from kvstore.connectors.kv_scheduler import KVStoreScheduler
from kvstore.connectors.store_handle import acquire_store, release_store
from kvstore.connectors.vllm_scheduler import VllmScheduler

from kvstore.blob import encode_blob
from kvstore.keys import chunk_keys

pytest.importorskip("vllm")
from vllm import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

BS, CS = 128, 256
LAYOUT = {"model_name": "m", "model_config_hash": "0" * 32, "num_layers": 2, "num_kv_heads": 1, "head_dim": 8,
          "kv_dtype": "bfloat16"}  # fmt: skip
TOKENS = list(range(1000, 1600))  # 2 full chunks + 88 tokens


@pytest.fixture
def sched(tmp_path):
    config = KVTransferConfig(store_url="local", chunk_size=CS, block_size=BS, layout=LAYOUT,
                              local_disk_path=tmp_path, load_async=False)  # fmt: skip
    handle = acquire_store(config)
    tables: dict[str, list[int]] = {}
    yield VllmScheduler(KVStoreScheduler(config, handle), tables.__getitem__), tables, handle, config
    release_store(handle)


def request(rid: str, **kw) -> Request:
    return Request(rid, list(TOKENS), SamplingParams(max_tokens=4), None, **kw)


def blocks(ids: list[int]) -> KVCacheBlocks:
    return KVCacheBlocks(([KVCacheBlock(i) for i in ids],))


def step(new=(), cached=(), finished=()) -> SchedulerOutput:
    """new: (request, num_computed, num_scheduled); cached: (request id, num_computed, num_scheduled)."""
    out = SchedulerOutput.make_empty()
    for req, computed, n in new:
        out.scheduled_new_reqs.append(NewRequestData.from_request(req, ([],)))
        out.scheduled_new_reqs[-1].num_computed_tokens = computed
        out.num_scheduled_tokens[req.request_id] = n
    for rid, computed, n in cached:
        out.scheduled_cached_reqs.req_ids.append(rid)
        out.scheduled_cached_reqs.num_computed_tokens.append(computed)
        out.num_scheduled_tokens[rid] = n
    out.finished_req_ids = set(finished)
    return out


def test_chunked_prefill_saves_each_full_chunk_once_and_holds_the_blocks(sched) -> None:
    adapter, tables, _, _ = sched
    a = request("a")
    assert adapter.get_num_new_matched_tokens(a, 0) == (0, False)
    tables["a"] = [7, 3, 9, 1, 4]
    adapter.update_state_after_alloc(a, blocks(tables["a"]), 0)
    transfers, held = adapter.build_connector_meta(step(new=[(a, 0, 512)]))
    assert [(s.chunk_index, s.block_ids) for s in transfers.saves] == [(0, (7, 3)), (1, (9, 1))]
    assert not transfers.loads and held == frozenset()
    transfers, _ = adapter.build_connector_meta(step(cached=[("a", 512, 88)]))
    assert not transfers.saves  # the 88-token tail is no full chunk
    assert adapter.request_finished(a, tables["a"])[0] is True  # saves were handed out: keep the blocks
    _, held = adapter.build_connector_meta(step(finished={"a"}))
    assert held == {"a"}
    _, held = adapter.build_connector_meta(step())
    assert held == frozenset()  # told once; the worker remembers until the save lands


def test_a_stored_prefix_loads_into_the_requests_blocks_and_a_salted_request_never_sees_it(sched) -> None:
    adapter, tables, handle, config = sched
    chunk = torch.zeros(2, 2, CS, 1, 8, dtype=torch.bfloat16)
    handle.batch_put_blobs([(k, encode_blob(chunk)) for k in chunk_keys(TOKENS, config.layout)])
    b = request("b")
    assert adapter.get_num_new_matched_tokens(b, 128) == (512 - 128, False)  # one block local, cap 512
    tables["b"] = [5, 6, 8, 2, 0]
    adapter.update_state_after_alloc(b, blocks(tables["b"]), 512 - 128)
    transfers, _ = adapter.build_connector_meta(step(new=[(b, 512, 88)]))
    (load,) = transfers.loads
    assert (load.start_token, load.end_token, load.block_ids[:4]) == (128, 512, (5, 6, 8, 2))
    assert not transfers.saves  # what was loaded is in the store already
    salted = request("s", cache_salt="tenant-2")
    assert adapter.get_num_new_matched_tokens(salted, 0) == (0, False)
    tables["s"] = [10, 11, 12, 13, 14]
    adapter.update_state_after_alloc(salted, blocks(tables["s"]), 0)
    transfers, _ = adapter.build_connector_meta(step(new=[(salted, 0, 600)]))
    assert {s.key for s in transfers.saves}.isdisjoint(chunk_keys(TOKENS, config.layout))


def test_extra_keys_of_a_request_follow_spec_1(sched) -> None:
    from kvstore.connectors.chunks import ChunkKeys, key_extra  # noqa: PLC0415

    _, _, _, config = sched
    assert key_extra(request("plain")) == b""  # a plain request keeps the engine-neutral keys
    for req in (request("s", cache_salt="t1"), request("l", lora_request=_lora("adapter-a"))):
        extra = key_extra(req)
        assert extra and ChunkKeys(config.layout, "", extra).update(TOKENS) == chunk_keys(
            TOKENS, config.layout, extra=extra
        )
    assert key_extra(request("s", cache_salt="t1")) != key_extra(request("s", cache_salt="t2"))


def _lora(name: str):
    from vllm.lora.request import LoRARequest  # noqa: PLC0415

    return LoRARequest(name, 1, "/nowhere")


def test_a_preempted_requests_partial_chunk_is_saved_from_its_last_step(sched) -> None:
    """vLLM frees a preempted request's blocks and zeroes its num_computed_tokens before the connector
    hears of it (preempted_req_ids, next step): its partial chunk is still handed out for
    handle_preemptions, from the blocks and tokens of the step it last ran in."""
    adapter, tables, _, _ = sched
    a = request("a")
    adapter.get_num_new_matched_tokens(a, 0)
    tables["a"] = [7, 3, 9, 1, 4]
    adapter.update_state_after_alloc(a, blocks(tables["a"]), 0)
    transfers, _ = adapter.build_connector_meta(step(new=[(a, 0, 384)]))  # chunk 0 + one block of chunk 1
    assert [s.chunk_index for s in transfers.saves] == [0]
    # vLLM's _preempt_request: blocks freed, num_computed_tokens = 0, then the next step names it
    del tables["a"]
    a.num_computed_tokens, a.num_preemptions = 0, 1
    out = step()
    out.preempted_req_ids = {"a"}
    transfers, _ = adapter.build_connector_meta(out)
    ((spec,),) = [transfers.preempt_saves]
    assert (spec.chunk_index, spec.block_ids, spec.partial) == (1, (9,), True)
    assert not transfers.saves
    # it resumes: the partial chunk counts as asked-for again (nothing is handed out twice)
    out = step()
    out.preempted_req_ids = {"a"}
    assert adapter.build_connector_meta(out)[0].preempt_saves == []


def test_an_async_load_is_asked_once_and_vllms_second_allocation_counts_nothing(sched) -> None:
    """With load_async, vLLM parks the request while the worker loads, then allocates its other blocks
    and calls update_state_after_alloc again with 0 tokens: nothing is loaded or counted twice; with
    vLLM's hybrid manager the block ids are one tuple per position (a block id per group)."""
    _, _, handle, config = sched
    config = config.model_copy(update={"load_async": True})
    tables: dict[str, list] = {}
    adapter = VllmScheduler(KVStoreScheduler(config, handle), tables.__getitem__)
    chunk = torch.zeros(2, 2, CS, 1, 8, dtype=torch.bfloat16)
    handle.batch_put_blobs([(k, encode_blob(chunk)) for k in chunk_keys(TOKENS, config.layout)])
    a = request("async")
    assert adapter.get_num_new_matched_tokens(a, 0) == (512, True)
    queries = handle.metrics.snapshot()["vllm:external_prefix_cache_queries_total"]
    groups = KVCacheBlocks(
        ([KVCacheBlock(i) for i in (1, 2, 3, 4, 5)], [KVCacheBlock(i) for i in (0, 0, 8, 9, 10)])
    )
    tables["async"] = list(zip((1, 2, 3, 4, 5), (0, 0, 8, 9, 10), strict=True))
    adapter.update_state_after_alloc(a, groups, 512)
    (load,) = adapter.build_connector_meta(step())[0].loads
    assert load.block_ids[:4] == ((1, 0), (2, 0), (3, 8), (4, 9)) and load.end_token == 512
    adapter.update_state_after_alloc(a, groups, 0)  # after the load: vLLM allocates again
    assert not adapter.build_connector_meta(step())[0].loads
    assert handle.metrics.snapshot()["vllm:external_prefix_cache_queries_total"] == queries + len(TOKENS)
