"""KV events any consumer reads (issue 46 item 1): block hashes in vLLM's default form (64-bit integers,
vLLM's own conversion) or, by setting, as bytes, from kvstore-engine and kvstore-server alike, read with
vLLM's own decoder; and a publisher that connects (to a subscriber that binds, as llm-d's indexer does)
delivers every batch, even to a subscriber that starts reading only after the puts."""

from __future__ import annotations

import os
import time

import pytest
import torch
import zmq
from kvstore.engine.engine_args import EngineArgs
from kvstore.engine.llm_engine import LLMEngine
from kvstore.engine.router.index import PrefixIndex
from kvstore.engine.sampling_params import SamplingParams
from kvstore.sdk import Store
from kvstore.server.config import ServerConfig
from kvstore.server.runner import ServerThread
from vllm.distributed.kv_events import AllBlocksCleared, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvstore import events as ev
from kvstore.blob import encode_blob
from kvstore.config import StoreConfig
from kvstore.errors import ConfigError
from kvstore.keys import KVLayout, chunk_keys
from kvstore.store import TieredStore
from tests.engine.conftest import make_tiny_engine_dir
from tests.router.events_util import DECODER, events, receive, settle, subscribe
from tests.valkey import free_port
from tests.waiting import wait_until

LAYOUT = KVLayout("m", "0" * 32, 2, 2, 64, "bfloat16", 16)


def _blob(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return bytes(encode_blob(torch.randn((2, 2, 16, 2, 64), generator=g).to(torch.bfloat16), "raw"))


def _run(engine: LLMEngine, prompt: list[int]) -> list[bytes]:
    seq = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    return list(seq.block_hashes)


def test_the_int_form_is_vllms_own_conversion() -> None:
    """vLLM 0.32 publishes `int.from_bytes(hash, "big") & (2**64 - 1)` unless told otherwise: so does
    kvstore, for a chunk key (16 bytes) and any longer key alike."""
    assert os.environ.get(ev.INT_HASHES_ENV, "1") == "1"
    for key in chunk_keys(list(range(16 * 8)), LAYOUT) + ["ab" * 32]:
        raw = bytes.fromhex(key)
        assert ev.external_block_hash(raw) == maybe_convert_block_hash(raw) == int.from_bytes(raw[-8:], "big")
        assert ev.external_block_hash(raw, as_int=False) == raw
    assert ev.external_block_hash(12345) == 12345


def test_the_setting_and_vllms_switch(monkeypatch) -> None:
    on = ev.parse_kv_events_config({"enable_kv_cache_events": True})
    assert on.int_block_hashes is None and ev.int_block_hashes(on)
    monkeypatch.setenv(ev.INT_HASHES_ENV, "0")  # vLLM's own switch, read as vLLM reads it
    assert not ev.int_block_hashes(on)
    assert ev.int_block_hashes(ev.parse_kv_events_config({"int_block_hashes": True}))  # the field wins
    monkeypatch.setenv(ev.INT_HASHES_ENV, "yes")
    with pytest.raises(ConfigError, match=ev.INT_HASHES_ENV):
        ev.parse_kv_events_config({"enable_kv_cache_events": True})
    monkeypatch.delenv(ev.INT_HASHES_ENV)
    for bad in ("yes", 1, 0):
        with pytest.raises(ConfigError, match="int_block_hashes"):
            ev.parse_kv_events_config({"enable_kv_cache_events": True, "int_block_hashes": bad})


@pytest.mark.parametrize("as_int", [True, False], ids=["int", "bytes"])
def test_vllms_decoder_reads_the_engines_and_the_servers_events_in_either_form(tmp_path, as_int) -> None:
    model = make_tiny_engine_dir(tmp_path / "llama")
    ecfg = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/e-pub", "int_block_hashes": as_int}
    engine = LLMEngine(
        EngineArgs(model=str(model), max_model_len=256, num_kv_blocks=24, kv_events_config=ecfg)
    )
    sub = subscribe(ecfg["endpoint"])
    try:
        settle()
        prompt = [5 + i % 200 for i in range(50)]  # 3 full blocks of 16
        hashes = _run(engine, prompt)
        got = receive(sub, lambda b: any(isinstance(e, BlockStored) for e in events(b)))
    finally:
        sub.close()
        engine.shutdown()
    stored = [e for e in events(got) if isinstance(e, BlockStored)]
    wire = [ev.external_block_hash(h, as_int) for h in hashes[:3]]
    assert [h for e in stored for h in e.block_hashes] == wire
    assert all(type(h) is (int if as_int else bytes) for h in wire)
    assert stored[0].parent_block_hash is None and [t for e in stored for t in e.token_ids] == prompt[:48]

    scfg = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/s-pub", "int_block_hashes": as_int}
    store_config = StoreConfig(tiers=["cpu"], cpu_capacity=64 << 20)
    keys = chunk_keys(list(range(16 * 3)), LAYOUT)
    with ServerThread(TieredStore(store_config), store_config, ServerConfig(port=0, kv_events_config=scfg),
                      close_store=True) as srv:  # fmt: skip
        sub = subscribe(scfg["endpoint"])
        try:
            settle()
            client = Store.connect(srv.server.url)
            try:
                for i, k in enumerate(keys):
                    client.put(k, _blob(i))
            finally:
                client.close()
            got = receive(sub, lambda b: len([e for e in events(b) if isinstance(e, BlockStored)]) >= 3)
        finally:
            sub.close()
    stored = [h for e in events(got) if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored == [ev.external_block_hash(bytes.fromhex(k), as_int) for k in keys]
    # the router reads either form: its own chunk keys (raw bytes) match what the server announced
    index = PrefixIndex()
    index.apply_store("s", [e for e in events(got)])
    assert index.store_chunks([bytes.fromhex(k) for k in keys]) == 3


def _bound_sub(endpoint: str) -> zmq.Socket:
    """A subscriber that binds, as llm-d's KV-events indexer does; the publisher connects to it."""
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.bind(endpoint)
    return sock


def _drain(sock: zmq.Socket, want: int, timeout_s: float = 15.0) -> list[tuple[int, object]]:
    out = []
    deadline = time.monotonic() + timeout_s
    while len(out) < want and time.monotonic() < deadline:
        if sock.poll(50):
            _topic, seq, payload = sock.recv_multipart()
            out.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
    return out


@pytest.mark.parametrize("reads", ["after", "along"])
def test_a_server_that_connects_delivers_every_put(reads) -> None:
    """The issue's setup: "endpoint": "tcp://127.0.0.1:PORT" (vLLM's rule: connected to), a subscriber
    bound there, 30 puts 0.2 s apart: 31 batches (AllBlocksCleared, then one per put), in order, whether
    the subscriber reads along or only after the last put (before: its subscription reached the server
    only once it polled, and every batch before that was dropped, AllBlocksCleared always)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sub = _bound_sub(endpoint)
    cfg = {"enable_kv_cache_events": True, "endpoint": endpoint}
    store_config = StoreConfig(tiers=["cpu"], cpu_capacity=64 << 20)
    keys = chunk_keys(list(range(16 * 30)), LAYOUT)
    blob = _blob(0)
    got: list = []
    try:
        with ServerThread(TieredStore(store_config), store_config, ServerConfig(port=0, kv_events_config=cfg),
                          close_store=True) as srv:  # fmt: skip
            assert not srv.server.kv_events.publisher.bound
            client = Store.connect(srv.server.url)
            try:
                publisher = srv.server.kv_events.publisher
                for k in keys:
                    sent = publisher.published
                    client.put(k, blob)
                    if reads == "along":
                        got += _drain(sub, 31, timeout_s=0.2)
                    else:  # its own batch, sent and not read yet
                        wait_until(lambda sent=sent: publisher.published > sent, timeout=10)
            finally:
                client.close()
            got += _drain(sub, 31 - len(got))
    finally:
        sub.close()
    assert [s for s, _ in got] == list(range(31))
    assert isinstance(got[0][1].events[0], AllBlocksCleared)
    wire = [h for _, b in got[1:] for e in b.events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert wire == [ev.external_block_hash(bytes.fromhex(k)) for k in keys]


def test_an_engine_that_connects_delivers_every_batch(tmp_path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sub = _bound_sub(endpoint)
    model = make_tiny_engine_dir(tmp_path / "llama")
    cfg = {"enable_kv_cache_events": True, "endpoint": endpoint}
    engine = LLMEngine(
        EngineArgs(model=str(model), max_model_len=256, num_kv_blocks=64, kv_events_config=cfg)
    )
    try:
        publisher = engine.kv_events.publisher
        assert not publisher.bound
        prompts = [[7 + j] + [5 + (i * (j + 2)) % 200 for i in range(20)] for j in range(30)]
        hashes = [_run(engine, p)[0] for p in prompts]  # 30 prompts, a full block each: one batch each
        # every batch sent before the subscriber reads any
        wait_until(lambda: publisher.published >= 31, timeout=10, what=f"31 batches ({publisher.published})")
        got = _drain(sub, publisher.published)
    finally:
        sub.close()
        engine.shutdown()
    assert [s for s, _ in got] == list(range(publisher.published)) and publisher.unsent == 0
    assert isinstance(got[0][1].events[0], AllBlocksCleared)
    stored = [h for _, b in got for e in b.events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert [ev.external_block_hash(h) for h in hashes] == stored[: len(hashes)]
