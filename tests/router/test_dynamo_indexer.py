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
when it carries `block_size` (the size registered) tokens per block: an engine's events do, so Dynamo
finds an engine's prefixes. A server's do not (a server sees chunk keys, never tokens: `token_ids`
empty, `block_size` 0): Dynamo decodes every batch of a server (before: every BlockStored batch failed
with "did not match any variant of untagged enum BlockHashValue") but has no tokens to index.

Skipped without the venv, except under CI=true, where that fails."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
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

    def matched(self, worker: int, tokens: list[int]) -> int:
        """Leading tokens of `tokens` Dynamo says `worker` holds (its /query)."""
        status, body = self.http("/query", {"token_ids": tokens, "model_name": "m"})
        assert status == 200, body
        return body["scores"].get(str(worker), {}).get("0", 0)

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


@pytest.mark.parametrize("mode", ["bind", "connect"])
def test_dynamos_indexer_reads_every_server_batch_but_has_no_tokens_to_index(tmp_path, dynamo, mode) -> None:
    """Every batch decodes (before: each BlockStored batch failed), Dynamo applies each BlockStored and
    drops its blocks for want of tokens ("Block size is: 0"): a server's chunks score nothing there."""
    cfg, dyn_endpoint, fwd = _streams(tmp_path, "server", mode)
    store_config = StoreConfig(tiers=["cpu"], cpu_capacity=64 << 20)
    layout = KVLayout("m", "0" * 32, 2, 2, 64, "bfloat16", BLOCK)
    tokens = list(range(BLOCK * 4))
    try:
        with ServerThread(TieredStore(store_config), store_config, ServerConfig(port=0, kv_events_config=cfg),
                          close_store=True) as srv:  # fmt: skip
            publisher = srv.server.kv_events.publisher
            assert publisher.bound == (mode == "bind")
            dynamo.register(2, dyn_endpoint, cfg["replay_endpoint"])
            client = Store.connect(srv.server.url)
            try:
                for i, k in enumerate(chunk_keys(tokens, layout)):
                    client.put(k, _blob(i))
            finally:
                client.close()
            _until(
                lambda: "Block size is: 0" in dynamo.text(), f"Dynamo read no BlockStored: {dynamo.text()}"
            )
            time.sleep(1.0)  # every batch has had time to arrive
            assert publisher.published == 5  # AllBlocksCleared and four puts
            assert DECODE_FAILED not in dynamo.text(), dynamo.text()
            assert dynamo.matched(2, tokens) == 0
    finally:
        if fwd is not None:
            fwd.close()


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
