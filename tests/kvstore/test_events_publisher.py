"""KV event publishers against hostile peers and networks (issue 45 items 6 and 9): a peer cannot grow
the publisher (subscriptions, huge frames); what Valkey evicts on its own reaches the router; events
stay on this host by default, say so loudly when exposed, and need the token where there is one."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zmq
from kvstore.engine.engine_args import EngineArgs
from kvstore.engine.llm_engine import LLMEngine
from kvstore.engine.router.index import PrefixIndex
from kvstore.engine.router.subscriber import EventSubscriber, Source
from kvstore.engine.sampling_params import SamplingParams
from kvstore.sdk import Store
from kvstore.server.config import ServerConfig
from kvstore.server.runner import ServerThread
from vllm.distributed.kv_events import BlockRemoved, BlockStored

from kvstore import events as ev  # its new names are looked up in the tests: each fails on its own before
from kvstore.blob import encode_blob
from kvstore.config import StoreConfig
from kvstore.errors import ConfigError
from kvstore.events import KVEventsConfig, ZmqEventPublisher, block_stored, parse_kv_events_config
from kvstore.keys import KVLayout, chunk_keys
from kvstore.store import TieredStore
from tests.engine.conftest import make_tiny_engine_dir
from tests.router.events_util import DECODER, events, receive, settle
from tests.valkey import free_port
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
PUBLISHER = """
import sys
from kvstore.events import KVEventsConfig, ZmqEventPublisher
pub = ZmqEventPublisher(KVEventsConfig(True, "zmq", sys.argv[1], sys.argv[2]))
print("ready", flush=True)
sys.stdin.readline()
pub.shutdown()
"""


def _status(pid: int, field: str) -> int:
    """A /proc/PID/status figure in KiB (VmRSS, VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


@pytest.fixture
def publisher_process(tmp_path):
    """A publisher in a process of its own (its memory is what is measured): (pid, endpoint, replay)."""
    pub, rep = f"ipc://{tmp_path}/p", f"ipc://{tmp_path}/r"
    proc = subprocess.Popen([sys.executable, "-c", PUBLISHER, pub, rep], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "ready"
        yield proc.pid, pub, rep
    finally:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _settled_rss(pid: int, seconds: float = 2.0) -> int:
    time.sleep(seconds)
    return _status(pid, "VmRSS")


# ---- item 6: a peer cannot grow the publisher ----------------------------------------------------------
def test_subscriptions_a_peer_sends_do_not_grow_the_publisher(publisher_process) -> None:
    """An XSUB sends subscriptions as it likes: 4 MB of distinct ones (before: +73 MiB, kept after the
    peer left; libzmq keeps every one)."""
    pid, endpoint, _ = publisher_process
    before = _settled_rss(pid, 0.5)
    sock = zmq.Context.instance().socket(zmq.XSUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    time.sleep(0.3)
    for i in range(40_000):
        sock.send(b"\x01%08d" % i + bytes(92))
    time.sleep(2)
    sock.close()
    grown = _settled_rss(pid) - before
    assert grown < 32 * 1024, f"the publisher grew by {grown} KiB"


def test_a_huge_replay_request_is_never_read(publisher_process) -> None:
    pid, _, replay = publisher_process
    before = _status(pid, "VmHWM")
    ctx = zmq.Context.instance()
    hostile = ctx.socket(zmq.DEALER)
    hostile.setsockopt(zmq.LINGER, 0)
    hostile.connect(replay)
    hostile.send_multipart((b"", bytes(96 << 20)))  # 96 MiB where 8 bytes belong
    time.sleep(2)
    hostile.close()
    assert _status(pid, "VmHWM") - before < 32 * 1024  # before: read whole, twice over
    good = ctx.socket(zmq.DEALER)  # and the replay still answers everyone else
    good.setsockopt(zmq.LINGER, 0)
    good.connect(replay)
    try:
        good.send_multipart((b"", (0).to_bytes(8, "big")))
        assert good.poll(5000)
        assert good.recv_multipart()[2] == (-1).to_bytes(8, "big", signed=True)
    finally:
        good.close()


def _blob(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return bytes(encode_blob(torch.randn((2, 2, 16, 2, 64), generator=g).to(torch.bfloat16), "raw"))


def test_what_valkey_evicts_on_its_own_leaves_the_routers_index(tmp_path, valkey_factory) -> None:
    """A 4 MB Valkey given 600 chunks of 16 KiB keeps ~200: the router's index, fed by the server's
    events, comes to hold what Valkey holds (before: all 600, forever)."""
    valkey = valkey_factory("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
    cfg = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/s-pub",
           "replay_endpoint": f"ipc://{tmp_path}/s-replay", "reconcile_s": 0.5}  # fmt: skip
    store_config = StoreConfig(tiers=["redis"], redis_url=valkey.url, redis_prefix="ev:")
    store = TieredStore(store_config)
    layout = KVLayout("m", "0" * 32, 2, 2, 64, "bfloat16", 16)
    keys = chunk_keys(list(range(16 * 600)), layout)
    index = PrefixIndex()
    sub = EventSubscriber([Source("store0", cfg["endpoint"], cfg["replay_endpoint"], index.apply_store)])
    with ServerThread(
        store, store_config, ServerConfig(port=0, kv_events_config=cfg), close_store=True
    ) as srv:
        sub.start()
        try:
            assert sub.ready.wait(15)
            client = Store.connect(srv.server.url)
            try:
                for i, k in enumerate(keys):
                    client.put(k, _blob(i % 7))
            finally:
                client.close()
            with valkey.client() as raw:
                held = raw.dbsize()
                assert 0 < held < 400, held
            wait_until(lambda: index.stats()["stores"].get("store0", {}).get("REDIS") == held, timeout=20,
                       what=f"the index holding Valkey's {held} chunks")  # fmt: skip
            with valkey.client() as raw:
                present = {k.decode()[len("ev:") :] for k in raw.keys("ev:*")}
            assert index.store_chunks([bytes.fromhex(k) for k in keys if k in present][:1]) == 1
        finally:
            sub.stop()


# ---- item 9: events stay on this host by default, and need the token where there is one -----------------
def test_the_default_endpoint_stays_on_this_host_and_every_example_too() -> None:
    config = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert config.endpoint.startswith("ipc://") and ev.is_local_endpoint(config.endpoint)
    assert not ev.is_local_endpoint("tcp://*:5557") and not ev.is_local_endpoint("tcp://0.0.0.0:5557")
    assert ev.is_local_endpoint("tcp://127.0.0.1:5557") and ev.is_local_endpoint("tcp://[::1]:5557")
    for argv in (["kvstore-server"], ["kvstore-engine", "serve"]):
        done = subprocess.run([str(Path(sys.executable).parent / argv[0]), *argv[1:], "--help"],
                              capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
        assert "tcp://*" not in done.stdout and "ipc://" in done.stdout, argv


def test_an_exposed_publisher_warns_loudly_and_a_local_one_does_not(tmp_path, caplog) -> None:
    port = free_port()
    with caplog.at_level(logging.WARNING, logger="kvstore.events"):
        pub = ZmqEventPublisher(KVEventsConfig(True, "zmq", f"tcp://*:{port}"))
        pub.shutdown()
    assert any("without authentication" in r.getMessage() and f"tcp://*:{port}" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvstore.events"):
        for cfg in (KVEventsConfig(True, "zmq", f"ipc://{tmp_path}/quiet"),
                    KVEventsConfig(True, "zmq", f"tcp://127.0.0.1:{free_port()}", bind=True),
                    KVEventsConfig(True, "zmq", f"tcp://*:{free_port()}", auth="curve")):  # fmt: skip
            ZmqEventPublisher(cfg, token="t0ken-" + "y" * 30).shutdown()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_bind_keeps_a_tcp_publisher_on_loopback(tmp_path) -> None:
    """vLLM's rule connects to tcp://127.0.0.1:P; `"bind": true` binds it, so a subscriber connects."""
    port = free_port()
    cfg = parse_kv_events_config({"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}",
                                  "bind": True})  # fmt: skip
    pub = ZmqEventPublisher(cfg)
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        settle()
        pub.publish([block_stored([bytes(16)], None, [1, 2], 2, "GPU")])
        assert sock.poll(5000)
        assert DECODER.decode(sock.recv_multipart()[2]).events[0].block_hashes == [0]  # vLLM's int form
    finally:
        sock.close()
        pub.shutdown()


def test_a_second_publisher_on_the_same_ipc_path_is_refused(tmp_path) -> None:
    cfg = KVEventsConfig(True, "zmq", f"ipc://{tmp_path}/shared")
    first = ZmqEventPublisher(cfg)
    try:
        with pytest.raises(ConfigError, match="in use"):  # before: it took the path over, silently
            ZmqEventPublisher(cfg)
    finally:
        first.shutdown()


def _curve_sub(endpoint: str, server_key: bytes | None) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    if server_key is not None:
        sock.curve_serverkey = server_key
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


def _replay_answers(endpoint: str, server_key: bytes | None, wait_s: float = 3.0) -> list[list[bytes]]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if server_key is not None:
        sock.curve_serverkey = server_key
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.connect(endpoint)
    out = []
    try:
        sock.send_multipart((b"", (0).to_bytes(8, "big")))
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if sock.poll(50):
                out.append(sock.recv_multipart())
                if out[-1][2] == (-1).to_bytes(8, "big", signed=True):
                    break
    finally:
        sock.close()
    return out


def test_a_token_protected_servers_events_need_the_token(tmp_path) -> None:
    """Anonymous: no event, no replay. With the token (CURVE, keys from it): the chunk keys, as vLLM's
    decoder reads them."""
    token = "server-token-" + "z" * 24
    cfg = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/srv-pub",
           "replay_endpoint": f"ipc://{tmp_path}/srv-replay"}  # fmt: skip
    store_config = StoreConfig(tiers=["cpu"], cpu_capacity=64 << 20)
    store = TieredStore(store_config)
    server_config = ServerConfig(port=0, kv_events_config=cfg, auth_token=token)
    key = chunk_keys(list(range(16)), KVLayout("m", "0" * 32, 2, 2, 64, "bfloat16", 16))[0]
    with ServerThread(store, store_config, server_config, close_store=True) as srv:
        anonymous = _curve_sub(cfg["endpoint"], None)
        try:
            settle()
            client = Store.connect(srv.server.url, token=token)
            try:
                client.put(key, _blob(0))
            finally:
                client.close()
            assert not anonymous.poll(1500)  # before: the chunk key of a PUT whose GET needs the token
        finally:
            anonymous.close()
        assert _replay_answers(cfg["replay_endpoint"], None) == []  # before: the whole buffered history
        answer = _replay_answers(cfg["replay_endpoint"], ev.curve_server_key(token))
        assert answer[-1][2] == (-1).to_bytes(8, "big", signed=True)
        stored = [e for a in answer[:-1] for e in DECODER.decode(a[3]).events if isinstance(e, BlockStored)]
        wire = ev.external_block_hash(bytes.fromhex(key))  # vLLM's int form, the default
        assert wire in [h for e in stored for h in e.block_hashes]  # vLLM's decoder reads it
        holder = _curve_sub(cfg["endpoint"], ev.curve_server_key(token))  # and live, with the token
        try:
            settle()
            client = Store.connect(srv.server.url, token=token)
            try:
                assert client.delete(key)
            finally:
                client.close()
            got = receive(holder, lambda b: any(isinstance(e, BlockRemoved) for e in events(b)))
            assert wire in [h for e in events(got) if isinstance(e, BlockRemoved) for h in e.block_hashes]
        finally:
            holder.close()


def test_an_engine_with_a_token_file_does_not_give_prompts_away(tmp_path) -> None:
    token_file = tmp_path / "events-token"
    token_file.write_text("engine-events-" + "w" * 24 + "\n")
    model = make_tiny_engine_dir(tmp_path / "llama")
    cfg = {
        "enable_kv_cache_events": True,
        "endpoint": f"ipc://{tmp_path}/e-pub",
        "token_file": str(token_file),
    }
    engine = LLMEngine(
        EngineArgs(model=str(model), max_model_len=256, num_kv_blocks=24, kv_events_config=cfg)
    )
    anonymous = _curve_sub(cfg["endpoint"], None)
    holder = _curve_sub(cfg["endpoint"], ev.curve_server_key(token_file.read_text().strip()))
    try:
        settle()
        prompt = [5 + i % 200 for i in range(40)]
        engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0))
        while engine.has_unfinished_requests():
            engine.step()
        got = receive(holder, lambda b: any(isinstance(e, BlockStored) for e in events(b)))
        assert [t for e in events(got) if isinstance(e, BlockStored) for t in e.token_ids] == prompt[:32]
        assert not anonymous.poll(1000)  # before: the prompt, rebuilt from BlockStored token_ids
    finally:
        anonymous.close()
        holder.close()
        engine.shutdown()


def test_a_bad_kvstore_field_is_named() -> None:
    for bad, what in (
        ({"bind": "yes"}, "bind"),
        ({"auth": "plain"}, "auth"),
        ({"reconcile_s": -1}, "reconcile_s"),
    ):
        with pytest.raises(ConfigError, match=what):
            parse_kv_events_config({"enable_kv_cache_events": True, **bad})
    with pytest.raises(ConfigError, match="needs a token"):
        ZmqEventPublisher(KVEventsConfig(True, "zmq", "inproc://no-token", auth="curve"))
