"""KV events in vLLM's wire format, decoded with vLLM's own msgspec classes: the engine's prefix cache
(stored, evicted, a replay for a subscriber that joins late) and a kvstore-server's tiers (each a
medium; an eviction from the cpu tier and a delete seen as BlockRemoved; a warm restart's snapshot)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kvstore.engine.engine_args import EngineArgs
from kvstore.engine.llm_engine import LLMEngine
from kvstore.engine.sampling_params import SamplingParams
from kvstore.sdk import Store
from kvstore.server.config import ServerConfig
from kvstore.server.runner import ServerThread
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from kvstore.blob import encode_blob
from kvstore.config import StoreConfig
from kvstore.errors import ConfigError
from kvstore.events import parse_kv_events_config
from kvstore.keys import chunk_keys
from kvstore.store import TieredStore
from tests.engine.conftest import make_tiny_engine_dir
from tests.router.events_util import events, receive, replay, settle, subscribe
from tests.waiting import wait_until


def _config(tmp_path, name: str) -> dict:
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{tmp_path}/{name}-pub",
        "replay_endpoint": f"ipc://{tmp_path}/{name}-replay",
        "buffer_steps": 100,
        "int_block_hashes": False,  # hashes as bytes, compared below (the int default: test_events_forms.py)
    }


def test_config_is_vllms_and_off_by_default() -> None:
    assert not parse_kv_events_config(None).enabled
    assert not parse_kv_events_config('{"enable_kv_cache_events": false}').enabled
    assert parse_kv_events_config('{"enable_kv_cache_events": true}').enabled  # publisher defaults to zmq
    assert not parse_kv_events_config({"enable_kv_cache_events": True, "publisher": "null"}).enabled
    for bad in ('{"enable_kv_cache_events": true, "bogus": 1}', "{nope", '{"publisher": "kafka"}',
                '{"buffer_steps": 0}'):  # fmt: skip
        with pytest.raises(ConfigError):
            parse_kv_events_config(bad)


def _run(engine: LLMEngine, prompt: list[int]) -> list[bytes]:
    seq = engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    return list(seq.block_hashes)


def test_engine_events_stored_evicted_and_replayed(tmp_path) -> None:
    model = make_tiny_engine_dir(tmp_path / "llama")
    cfg = _config(tmp_path, "engine")
    engine = LLMEngine(
        EngineArgs(model=str(model), max_model_len=256, num_kv_blocks=24, kv_events_config=cfg)
    )
    sub = subscribe(cfg["endpoint"])
    try:
        settle()
        a = [5 + i % 200 for i in range(100)]  # 6 full blocks of 16 (the 100th token is recomputed)
        hashes_a = _run(engine, a)
        got = receive(sub, lambda b: any(isinstance(e, BlockStored) for e in events(b)))
        stored = [e for e in events(got) if isinstance(e, BlockStored)]
        assert stored, "no BlockStored for a prefilled prompt"
        assert (
            stored[0].parent_block_hash is None and stored[0].medium == "GPU" and stored[0].block_size == 16
        )
        assert [h for e in stored for h in e.block_hashes] == hashes_a[:6]
        assert [t for e in stored for t in e.token_ids] == a[:96]
        # two other long prompts need every block: A's blocks are evicted, seen as BlockRemoved
        for k in (1, 2):
            _run(engine, [7 + (i * (k + 3)) % 250 for i in range(200)])
        got += receive(sub, lambda b: set(hashes_a[:6]) <= {
            h for e in events(b) if isinstance(e, BlockRemoved) for h in e.block_hashes})  # fmt: skip
        removed = {h for e in events(got) if isinstance(e, BlockRemoved) for h in e.block_hashes}
        assert set(hashes_a[:6]) <= removed
        assert all(e.medium == "GPU" for e in events(got) if isinstance(e, BlockRemoved))
        # a subscriber that joins now gets everything from the replay endpoint, from seq 0:
        # the engine's first batch is AllBlocksCleared, then the very batches the early one saw
        late = replay(cfg["replay_endpoint"], 0)
        assert late[0][0] == 0 and isinstance(late[0][1].events[0], AllBlocksCleared)
        assert [s for s, _ in late] == list(range(len(late)))
        early = {s: b for s, b in got}
        assert all(early[s] == b for s, b in late if s in early) and set(early) <= {s for s, _ in late}
        assert [s for s, _ in replay(cfg["replay_endpoint"], late[-1][0])] == [late[-1][0]]
    finally:
        sub.close()
        engine.shutdown()


def _blob(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return bytes(encode_blob(torch.randn((2, 2, 16, 2, 32), generator=g).to(torch.bfloat16), "raw"))


def test_server_events_per_tier_eviction_delete_and_warm_restart(tmp_path) -> None:
    cfg = _config(tmp_path, "server")
    size = len(_blob(0))
    store_config = StoreConfig(
        tiers=["cpu", "disk"], cpu_capacity=2 * size + size // 2, disk_path=tmp_path / "disk"
    )
    keys = [bytes.fromhex(k) for k in chunk_keys(list(range(16 * 4)), _layout(16))]
    store = TieredStore(store_config)
    srv = ServerThread(store, store_config, ServerConfig(port=0, kv_events_config=cfg), close_store=True)
    with srv:
        sub = subscribe(cfg["endpoint"])
        settle()
        client = Store.connect(srv.server.url)
        try:
            for i, k in enumerate(keys[:3]):  # the cpu tier holds two: the first is evicted from it
                client.put(k.hex(), _blob(i))
            assert client.delete(keys[1].hex())
        finally:
            client.close()

        def done(b) -> bool:
            return any(isinstance(e, BlockRemoved) and e.medium == "STORAGE" for e in events(b))

        got = events(receive(sub, done))
        sub.close()
    by = {}
    for e in got:
        by.setdefault((type(e).__name__, e.medium), []).extend(e.block_hashes)
    assert by[("BlockStored", "CPU")] == keys[:3] and by[("BlockStored", "STORAGE")] == keys[:3]
    assert all(e.token_ids == [] and e.parent_block_hash is None for e in got if isinstance(e, BlockStored))
    assert by[("BlockRemoved", "CPU")] == [keys[0], keys[1]]  # evicted, then deleted
    assert by[("BlockRemoved", "STORAGE")] == [keys[1]]
    # a restarted server (warm disk tier) starts its stream with AllBlocksCleared and what it holds
    store = TieredStore(store_config)
    with ServerThread(store, store_config, ServerConfig(port=0, kv_events_config=cfg), close_store=True):
        first = replay(cfg["replay_endpoint"], 0)
    assert isinstance(first[0][1].events[0], AllBlocksCleared)
    snapshot = {
        h
        for e in events(first)
        if isinstance(e, BlockStored) and e.medium == "STORAGE"
        for h in e.block_hashes
    }
    assert snapshot == {keys[0], keys[2]}


def _layout(chunk: int):
    from kvstore.keys import KVLayout

    return KVLayout("m", "0" * 32, 2, 2, 32, "bfloat16", chunk)


def test_the_routers_feed_replays_on_start_follows_live_and_sees_a_publisher_restart(tmp_path) -> None:
    from kvstore.engine.router.index import PrefixIndex
    from kvstore.engine.router.subscriber import EventSubscriber, Source

    from kvstore.events import KVEventsConfig, ZmqEventPublisher, all_blocks_cleared, block_stored

    cfg = KVEventsConfig(True, "zmq", f"ipc://{tmp_path}/p", f"ipc://{tmp_path}/r")
    a, b = bytes(16), bytes([1] * 16)
    pub = ZmqEventPublisher(cfg)
    pub.publish([all_blocks_cleared()])
    pub.publish([block_stored([a], None, [1, 2, 3, 4], 4, "GPU")])
    index = PrefixIndex()
    sub = EventSubscriber([Source("e", cfg.endpoint, cfg.replay_endpoint, index.apply_engine)])
    try:
        settle()  # both batches were published before the subscriber existed: only replay has them
        sub.start()
        assert sub.ready.wait(10)
        assert index.local_tokens("e", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 4
        pub.publish([block_stored([b], a, [5, 6, 7, 8], 4, "GPU")])  # live
        _until(lambda: index.local_tokens("e", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8)
        pub.shutdown()
        pub = ZmqEventPublisher(cfg)  # a restarted engine: seq 0 again, AllBlocksCleared first
        settle()
        pub.publish([all_blocks_cleared()])
        _until(lambda: index.local_tokens("e", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 0)
    finally:
        sub.stop()
        pub.shutdown()


def _until(cond, timeout_s: float = 10.0) -> None:
    wait_until(cond, timeout_s, 0.02, what="the router's index following the events")


@pytest.mark.parametrize("command", [["engine", "serve", "--port", "0"], ["server", "--port", "0"]])
def test_a_bad_kv_events_config_stops_either_command_at_once(command, tmp_path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", *command, "--kv-events-config", '{"enable_kv_cache_events": true, "hwm": -1}'],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )  # fmt: skip
    assert r.returncode == 2 and "hwm must be a positive integer" in r.stderr, r.stderr[-2000:]
