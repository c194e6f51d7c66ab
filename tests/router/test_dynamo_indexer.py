"""Dynamo's own KV indexer reads kvstore's KV events (issue 46 item 1): ai-dynamo-runtime 1.6.1's
standalone indexer (`python -m dynamo.indexer`, offline on CPU: no etcd, no NATS), in a venv of its own
(`make dynamo-env`: it pins a pydantic older than the project's), subscribes to kvstore-engine's and
kvstore-server's live streams and is asked over its HTTP API (`/register`, `/query`), as a Dynamo or
llm-d deployment would.

How Dynamo reads a stream: its SUB always connects (to the worker's `endpoint`), and it asks the
`replay_endpoint` for what it missed (a gap, or a first batch past seq 0). So in bind mode it connects
to kvstore's bound socket; in connect mode (kvstore connects to a subscriber that binds, as llm-d's
indexer does) a forwarder binds both sides (a bound XSUB kvstore connects to, a bound XPUB Dynamo
connects to: `zmq.proxy`), which is also how one points Dynamo at publishers that connect.

Dynamo keys its radix tree by its own hash of each block's token ids, and indexes a BlockStored only
when it carries `block_size` (the size registered) tokens per block, chained by `parent_block_hash`:
an engine's events do, so Dynamo finds an engine's prefixes. A server sees chunk keys, not tokens: its
events carry them when the writer put them as hints (kvstore.token_hints; the connectors do), and then
Dynamo finds a server's prefixes too, registered with its chunk size, in the tier it files the medium
in ("CPU": its cpu tier, `instances[worker].cpu` of /query, not the device `scores`). Puts without
hints publish `token_ids` empty and `block_size` 0: every batch decodes (before: every BlockStored batch
failed with "did not match any variant of untagged enum BlockHashValue"), nothing to index.

Skipped without the venv, except under CI=true, where that fails."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq
from kvstore.engine.engine_args import EngineArgs
from kvstore.engine.llm_engine import LLMEngine
from kvstore.engine.sampling_params import SamplingParams
from kvstore.sdk import Store
from kvstore.server.config import ServerConfig
from kvstore.server.runner import ServerThread

from kvstore.blob import encode_blob
from kvstore.config import StoreConfig
from kvstore.keys import KVLayout, chunk_keys
from kvstore.store import TieredStore
from tests.engine.conftest import make_tiny_engine_dir
from tests.valkey import free_port
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
DYN_VENV = ROOT / ".venv" / "dynamo"
DYN_PYTHON = DYN_VENV / "bin" / "python"
BLOCK = 16  # the tiny engine's block size
DECODE_FAILED = "Failed to decode"


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


class DynamoIndexer:
    """`python -m dynamo.indexer` on a free port, its log in a file."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.log = log
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DYN_", "VIRTUAL_ENV"))}
        env["NO_COLOR"] = "1"
        with open(log, "w") as f:
            self.proc = subprocess.Popen(
                [str(DYN_PYTHON), "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"],
                stdout=f, stderr=subprocess.STDOUT, env=env, cwd=log.parent,
            )  # fmt: skip

        def up() -> bool:
            assert self.proc.poll() is None, self.text()[-3000:]
            try:
                self.http("/health")
            except (urllib.error.URLError, ConnectionError):
                return False
            return True

        _until(up, "Dynamo's indexer did not come up", timeout_s=60)

    def http(self, path: str, body: dict | None = None) -> tuple[int, dict | list | str]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                status, text = r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read().decode()
        try:
            return status, json.loads(text)
        except json.JSONDecodeError:
            return status, text

    def register(self, worker: int, endpoint: str, replay_endpoint: str) -> None:
        status, body = self.http("/register", {"instance_id": worker, "endpoint": endpoint, "model_name": "m",
                                               "block_size": BLOCK, "replay_endpoint": replay_endpoint})  # fmt: skip
        assert status == 201, body
        # Dynamo replays what it missed only when a later batch shows it a gap: the tests publish once its
        # SUB is connected (its listener active, then ZMQ's slow joiner's few ms)
        _until(lambda: self._listening(worker), f"Dynamo's listener of worker {worker} never became active")
        time.sleep(0.5)

    def _listening(self, worker: int) -> bool:
        status, workers = self.http("/workers")
        assert status == 200, workers
        mine = [w for w in workers if w["instance_id"] == worker]
        return bool(mine) and all(x["status"] == "active" for x in mine[0]["listeners"].values())

    def matched(self, worker: int, tokens: list[int], tier: str = "gpu") -> int:
        """Leading tokens of `tokens` Dynamo says `worker` holds (its /query) in `tier`: "gpu", its
        device tier (the `scores` a router ranks by: an engine's medium "GPU"); "cpu" or "disk", the lower
        tiers Dynamo files a block in by its medium (a server's "CPU", "STORAGE"), in `instances`."""
        status, body = self.http("/query", {"token_ids": tokens, "model_name": "m"})
        assert status == 200, body
        if tier == "gpu":
            return body["scores"].get(str(worker), {}).get("0", 0)
        return body.get("instances", {}).get(str(worker), {}).get(tier, 0)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def dynamo(tmp_path):
    if not (DYN_VENV / ".installed").is_file() or not DYN_PYTHON.is_file():
        if _in_ci():
            pytest.fail("no Dynamo venv in .venv/dynamo under CI: `make dynamo-env`")
        pytest.skip("no Dynamo venv in .venv/dynamo: `make dynamo-env`")
    indexer = DynamoIndexer(tmp_path / "dynamo.log")
    yield indexer
    indexer.stop()


class Forwarder:
    """A bound XSUB (publishers connect to it) and a bound XPUB (Dynamo's SUB connects to it), joined by
    zmq.proxy: subscriptions go up, batches come down, unchanged."""

    def __init__(self, upstream: str, downstream: str) -> None:
        self.ctx = zmq.Context()
        self.front, self.back = self.ctx.socket(zmq.XSUB), self.ctx.socket(zmq.XPUB)
        for sock, endpoint in ((self.front, upstream), (self.back, downstream)):
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(endpoint)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            zmq.proxy(self.front, self.back)
        except zmq.ZMQError:  # close(): the context is destroyed under it
            pass

    def close(self) -> None:
        self.ctx.destroy(linger=0)
        self.thread.join(5)


def _streams(tmp_path: Path, name: str, mode: str) -> tuple[dict, str, Forwarder | None]:
    """The publisher's events config and the endpoint Dynamo subscribes to (a forwarder's in connect mode)."""
    replay = f"ipc://{tmp_path}/{name}-replay"
    if mode == "bind":
        endpoint = f"ipc://{tmp_path}/{name}-pub"
        return ({"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay}, endpoint,
                None)  # fmt: skip
    upstream = f"tcp://127.0.0.1:{free_port()}"  # vLLM's rule: connected to
    downstream = f"ipc://{tmp_path}/{name}-fwd"
    fwd = Forwarder(upstream, downstream)
    return {"enable_kv_cache_events": True, "endpoint": upstream, "replay_endpoint": replay}, downstream, fwd


def _until(cond, what: str, timeout_s: float = 20.0) -> None:
    wait_until(cond, timeout_s, 0.1, what=what)


@pytest.mark.parametrize("mode", ["bind", "connect"])
def test_dynamos_indexer_finds_the_engines_prefixes(tmp_path, dynamo, mode) -> None:
    cfg, dyn_endpoint, fwd = _streams(tmp_path, "engine", mode)
    model = make_tiny_engine_dir(tmp_path / "llama")
    engine = LLMEngine(
        EngineArgs(model=str(model), max_model_len=256, num_kv_blocks=32, kv_events_config=cfg)
    )
    try:
        assert engine.kv_events.publisher.bound == (mode == "bind")
        dynamo.register(1, dyn_endpoint, cfg["replay_endpoint"])
        a = [5 + i % 200 for i in range(100)]  # 6 full blocks
        b = a[:48] + [250 - i for i in range(52)]  # A's first 3 blocks, then its own
        never = [3] * 100
        for prompt in (a, b):
            engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
            while engine.has_unfinished_requests():
                engine.step()
        _until(
            lambda: dynamo.matched(1, a) == 6 * BLOCK, f"Dynamo never found A's 96 tokens: {dynamo.text()}"
        )
        assert dynamo.matched(1, b) == 6 * BLOCK  # B's own blocks are there too
        assert dynamo.matched(1, a[:48] + never[:52]) == 3 * BLOCK  # the shared prefix, no more
        assert dynamo.matched(1, never) == 0
        assert DECODE_FAILED not in dynamo.text()
    finally:
        engine.shutdown()
        if fwd is not None:
            fwd.close()


def _blob(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return bytes(encode_blob(torch.randn((2, 2, 16, 2, 64), generator=g).to(torch.bfloat16), "raw"))


@contextlib.contextmanager
def _server(tmp_path: Path, mode: str) -> Iterator[tuple[ServerThread, str, str]]:
    """A kvstore-server publishing its events (bound, or connecting to a forwarder): (its thread, the
    endpoint Dynamo subscribes to, the replay endpoint)."""
    cfg, dyn_endpoint, fwd = _streams(tmp_path, "server", mode)
    store_config = StoreConfig(tiers=["cpu"], cpu_capacity=64 << 20)
    try:
        with ServerThread(TieredStore(store_config), store_config, ServerConfig(port=0, kv_events_config=cfg),
                          close_store=True) as srv:  # fmt: skip
            assert srv.server.kv_events.publisher.bound == (mode == "bind")
            yield srv, dyn_endpoint, cfg["replay_endpoint"]
    finally:
        if fwd is not None:
            fwd.close()


@pytest.mark.parametrize(("mode", "transport"), [("bind", "auto"), ("connect", "http")])
def test_dynamos_indexer_finds_the_servers_prefixes(tmp_path, dynamo, mode, transport) -> None:
    """Puts that carry their chunks' token ids and parents (kvstore.token_hints), as the connectors'
    do: A's six chunks one put each, then B's own three (after A's first three) in one batch. Dynamo
    finds both prefixes, the shared part and no more; a chunk deleted ends A's prefix there."""
    layout = KVLayout("m", "0" * 32, 2, 2, 64, "bfloat16", BLOCK)
    a = [5 + i % 200 for i in range(6 * BLOCK)]
    b = a[: 3 * BLOCK] + [250 - i for i in range(3 * BLOCK)]
    never = [3] * (6 * BLOCK)
    ka, kb = chunk_keys(a, layout), chunk_keys(b, layout)
    assert ka[:3] == kb[:3]
    with _server(tmp_path, mode) as (srv, dyn_endpoint, replay):
        dynamo.register(2, dyn_endpoint, replay)
        with Store.connect(srv.server.url, transport=transport) as client:
            for i, k in enumerate(ka):
                client.put(
                    k, _blob(i), token_ids=a[i * BLOCK : (i + 1) * BLOCK], parent=ka[i - 1] if i else None
                )
            own = range(3, 6)
            client.batch_put([(kb[i], _blob(10 + i)) for i in own],
                             token_ids=[b[i * BLOCK : (i + 1) * BLOCK] for i in own],
                             parents=[kb[i - 1] for i in own])  # fmt: skip
            _until(
                lambda: dynamo.matched(2, a, "cpu") == 6 * BLOCK,
                f"Dynamo never found A's 96 tokens: {dynamo.text()}",
            )
            _until(
                lambda: dynamo.matched(2, b, "cpu") == 6 * BLOCK,
                f"Dynamo never found B's 96 tokens: {dynamo.text()}",
            )
            assert (
                dynamo.matched(2, a[: 3 * BLOCK] + never[: 3 * BLOCK], "cpu") == 3 * BLOCK
            )  # the shared prefix
            assert dynamo.matched(2, never, "cpu") == 0
            assert dynamo.matched(2, a) == 0  # a server's CPU tier is not Dynamo's device tier
            assert client.delete(ka[4])
            _until(
                lambda: dynamo.matched(2, a, "cpu") == 4 * BLOCK,
                f"A's fifth chunk is still there: {dynamo.text()}",
            )
        assert DECODE_FAILED not in dynamo.text()
        assert "Block size is" not in dynamo.text()  # no BlockStored without its tokens


def test_dynamos_indexer_finds_what_the_engines_connector_stored(tmp_path, dynamo) -> None:
    """The writer for real: kvstore-engine with its connector saving to the server (chunks of 16
    tokens, Dynamo's block size for this worker); the engine's own events are off. Dynamo finds the
    prompt's six full chunks from the server's events alone."""
    model = make_tiny_engine_dir(tmp_path / "llama")
    prompt = [7 + i % 190 for i in range(100)]  # 6 full chunks, then 4 tokens
    with _server(tmp_path, "bind") as (srv, dyn_endpoint, replay):
        dynamo.register(4, dyn_endpoint, replay)
        ktc = {"kv_connector": "KVStoreConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"store_url": srv.server.url, "chunk_size": BLOCK}}  # fmt: skip
        engine = LLMEngine(
            EngineArgs(model=str(model), max_model_len=256, num_kv_blocks=32, kv_transfer_config=ktc)
        )
        try:
            engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
            while engine.has_unfinished_requests():
                engine.step()
            _until(
                lambda: dynamo.matched(4, prompt, "cpu") == 6 * BLOCK,
                f"Dynamo never found 96 tokens: {dynamo.text()}",
            )
        finally:
            engine.shutdown()
        assert dynamo.matched(4, [3] * 100, "cpu") == 0
        assert DECODE_FAILED not in dynamo.text()


def test_dynamos_indexer_reads_every_batch_of_puts_without_tokens(tmp_path, dynamo) -> None:
    """Puts without hints publish as before: every batch decodes (before issue 46: each BlockStored
    batch failed), and Dynamo drops their blocks for want of tokens ("Block size is: 0")."""
    layout = KVLayout("m", "0" * 32, 2, 2, 64, "bfloat16", BLOCK)
    tokens = list(range(BLOCK * 4))
    with _server(tmp_path, "bind") as (srv, dyn_endpoint, replay):
        dynamo.register(2, dyn_endpoint, replay)
        with Store.connect(srv.server.url) as client:
            for i, k in enumerate(chunk_keys(tokens, layout)):
                client.put(k, _blob(i))
        publisher = srv.server.kv_events.publisher
        _until(lambda: publisher.published == 5, "AllBlocksCleared and four puts")
        _until(
            lambda: dynamo.text().count("Block size is: 0") >= 3,
            f"Dynamo read no BlockStored: {dynamo.text()}",
        )
        assert DECODE_FAILED not in dynamo.text(), dynamo.text()
        assert dynamo.matched(2, tokens, "cpu") == 0


def test_dynamos_indexer_refuses_the_bytes_form(tmp_path, dynamo) -> None:
    """`"int_block_hashes": false` (vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 form) is what Dynamo
    1.6.1 cannot read: the issue's failure, kept as the reason for the default."""
    cfg, dyn_endpoint, _ = _streams(tmp_path, "bytes", "bind")
    cfg["int_block_hashes"] = False
    model = make_tiny_engine_dir(tmp_path / "llama")
    engine = LLMEngine(
        EngineArgs(model=str(model), max_model_len=256, num_kv_blocks=32, kv_events_config=cfg)
    )
    try:
        dynamo.register(3, dyn_endpoint, cfg["replay_endpoint"])
        a = [5 + i % 200 for i in range(40)]
        engine.add_request(a, SamplingParams(max_tokens=1, temperature=0.0))
        while engine.has_unfinished_requests():
            engine.step()
        _until(lambda: "BlockHashValue" in dynamo.text(), f"no decode failure: {dynamo.text()}")
        assert dynamo.matched(3, a) == 0
    finally:
        engine.shutdown()
