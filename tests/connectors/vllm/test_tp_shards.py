"""TP-free chunks without vLLM: two gloo ranks, each holding half of the KV heads in vLLM's CPU layout,
save a chunk through a kvstore-server (the heads gathered to rank 0); the stored blob is byte for byte
what a TP=1 worker stores for the same KV, and it loads into a TP=1 cache, into each rank of a TP=4
one (one head each) and of a TP=8 one (heads replicated on two ranks each), every rank reading its own
heads."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from kvstore.connectors.config import KVTransferConfig
from kvstore.connectors.kv_worker import KVStoreWorker
from kvstore.connectors.layouts import VllmCpuLayout
from kvstore.connectors.meta import LoadSpec, SaveSpec, StepTransfers
from kvstore.connectors.shard import Shard
from kvstore.connectors.store_handle import acquire_store, release_store

from kvstore.blob import decode_blob
from kvstore.keys import KVLayout, chunk_keys
from tests.connectors.conftest import ServerProcess

L, H, D, BS, CS, NB = 3, 4, 16, 32, 128, 12
TOKENS = list(range(100, 100 + CS))
BLOCKS = (7, 2, 9, 4)  # the chunk's blocks in every cache


def layout() -> KVLayout:
    return KVLayout("tiny", "0" * 32, L, H, D, kv_dtype="bfloat16", chunk_size=CS)


def config(url: str) -> KVTransferConfig:
    return KVTransferConfig(store_url=url, chunk_size=CS, block_size=BS, layout=layout(), load_async=False)


def truth() -> torch.Tensor:
    return torch.randn(2, L, CS, H, D, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)


def caches(heads: int) -> list[torch.Tensor]:
    return [torch.zeros(NB, heads, BS, 2 * D, dtype=torch.bfloat16) for _ in range(L)]


def _save_rank(rank: int, url: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        cfg = config(url)
        handle = acquire_store(cfg)
        shard = Shard(rank, 2, H, group=dist.group.WORLD)
        worker = KVStoreWorker(cfg, handle, paged=VllmCpuLayout(), shard=shard)
        own = caches(H // 2)
        h0, h1 = shard.heads
        VllmCpuLayout().scatter(own, truth()[:, :, :, h0:h1].contiguous(), BLOCKS)
        worker.register_kv_caches(own)
        key = chunk_keys(TOKENS, layout())[0]
        worker.wait_for_save(StepTransfers(saves=[SaveSpec("r", key, 0, BLOCKS)]))
        worker.flush()
        worker.shutdown()
        release_store(handle)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--tiers", "cpu").start()
    yield srv
    srv.stop()


def load(url: str, shard: Shard, key: str) -> list[torch.Tensor]:
    cfg = config(url)
    handle = acquire_store(cfg)
    try:
        worker = KVStoreWorker(cfg, handle, paged=VllmCpuLayout(), shard=shard)
        own = caches(shard.local_heads)
        worker.register_kv_caches(own)
        worker.start_load_kv(StepTransfers(loads=[LoadSpec("r", (key,), 0, BLOCKS, 0, CS)]))
        assert not worker.get_block_ids_with_load_errors()
        worker.shutdown()
        return own
    finally:
        release_store(handle)


def test_a_chunk_saved_at_tp2_is_the_tp1_chunk_and_loads_at_tp1_and_tp4(server) -> None:
    from kvstore.sdk import Store  # noqa: PLC0415

    from tests.valkey import free_port  # noqa: PLC0415

    mp.spawn(_save_rank, args=(server.url, free_port()), nprocs=2, join=True)
    key = chunk_keys(TOKENS, layout())[0]
    with Store.connect(server.url) as client:
        blob = client.get_blob(key)
    want = truth()
    assert torch.equal(decode_blob(blob), want), "the TP=2 save holds every head, in order"
    # the very bytes a TP=1 worker stores for the same KV under the same key
    with Store.connect(server.url) as client:
        client.delete(key)
    cfg = config(server.url)
    handle = acquire_store(cfg)
    try:
        one = KVStoreWorker(cfg, handle, paged=VllmCpuLayout())
        own = caches(H)
        VllmCpuLayout().scatter(own, want, BLOCKS)
        one.register_kv_caches(own)
        one.wait_for_save(StepTransfers(saves=[SaveSpec("r", key, 0, BLOCKS)]))
        one.flush()
        one.shutdown()
    finally:
        release_store(handle)
    with Store.connect(server.url) as client:
        assert client.get_blob(key) == blob
    # TP=1: every head
    got = VllmCpuLayout().gather(load(server.url, Shard(0, 1, H), key), BLOCKS)
    assert torch.equal(got, want)
    # TP=4: one head a rank; TP=8: each head on two consecutive ranks
    for n in (4, 8):
        for rank in range(n):
            shard = Shard(rank, n, H)
            h0, h1 = shard.heads
            assert (h0, h1) == ((rank, rank + 1) if n == 4 else (rank // 2, rank // 2 + 1))
            got = VllmCpuLayout().gather(load(server.url, shard, key), BLOCKS)
            assert torch.equal(got, want[:, :, :, h0:h1]), (n, rank)


def test_pp_stages_store_their_own_layers_and_a_lookup_needs_every_stage(server) -> None:
    """Two pipeline stages (layers [0, 2) and [2, 3)) each store their layers under their own stage key;
    the scheduler asks for both stages' keys in one lookup: a chunk one stage lacks is a miss."""
    from kvstore.connectors.kv_scheduler import KVStoreScheduler  # noqa: PLC0415
    from kvstore.sdk import Store  # noqa: PLC0415

    from kvstore.keys import stage_key  # noqa: PLC0415

    stages = ((0, 2), (2, 3))
    cfg = KVTransferConfig(**{**config(server.url).model_dump(), "pp_stages": stages})
    want = truth()
    tokens = list(range(500, 500 + 2 * CS + 1))
    keys = chunk_keys(tokens, layout())
    handle = acquire_store(cfg)
    try:
        for a, b in stages:
            worker = KVStoreWorker(
                cfg, handle, paged=VllmCpuLayout(), shard=Shard(num_heads=H, layers=(a, b))
            )
            own = caches(H)[a:b]
            VllmCpuLayout().scatter(own, want[:, a:b].contiguous(), BLOCKS)
            worker.register_kv_caches(own)
            saves = [SaveSpec("r", k, c, BLOCKS) for c, k in enumerate(keys)]
            worker.wait_for_save(StepTransfers(saves=saves))
            worker.flush()
            worker.shutdown()
        with Store.connect(server.url) as client:
            for a, b in stages:
                assert torch.equal(decode_blob(client.get_blob(stage_key(keys[0], a, b))), want[:, a:b])
            assert client.get_blob(keys[0]) is None, "no stage-free blob"

        class Req:
            request_id, all_token_ids = "q", tokens

        sched = KVStoreScheduler(cfg, handle)
        assert sched.get_num_new_matched_tokens(Req(), 0) == (2 * CS, False)
        with Store.connect(server.url) as client:
            client.delete(stage_key(keys[1], *stages[1]))  # stage 1 lost chunk 1: only chunk 0 is a hit
        Req.request_id = "q2"
        assert sched.get_num_new_matched_tokens(Req(), 0) == (CS, False)
    finally:
        release_store(handle)


def test_stage_keys_are_pinned() -> None:
    """kvstore.keys.stage_key by hand (its formula is in the module's docstring) and pinned: a change
    is a new KEY_VERSION."""
    import hashlib  # noqa: PLC0415

    from kvstore.keys import stage_key  # noqa: PLC0415

    key = "00" * 16
    by_hand = hashlib.blake2b(bytes(16) + b"layers" + (0).to_bytes(4, "little") + (2).to_bytes(4, "little"),
                              digest_size=16).hexdigest()  # fmt: skip
    assert stage_key(key, 0, 2) == by_hand == "e873e657bc34353a6d4eacc358e40d27"
    assert stage_key(key, 2, 4) == "37409d18e083b29893fa293acb19c20c"
    with pytest.raises(ValueError):
        stage_key(key, 2, 2)
