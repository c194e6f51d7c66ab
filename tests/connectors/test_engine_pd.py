"""Prefill/decode disaggregation: `kvstore-engine proxy` sends a request to a `--kv-role prefill`
engine (first token only; its prompt KV goes to the store) and then to a `--kv-role decode` engine
(loads it, continues). The answer equals a single engine's, and the decode engine hit the store."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path

import pytest
from kvstore.engine import SamplingParams
from kvstore.engine.structured_output import StructuredOutputsParams
from prometheus_client.parser import text_string_to_metric_families

from tests.connectors.engine_util import ENGINE, GREEDY, doc, free_port
from tests.waiting import wait_until

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def http_json(url: str, body: dict | None = None, timeout: float = 300) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


def wait_saves_landed(url: str, timeout_s: float = 60.0) -> None:
    """Until the engine at `url` has no save in flight: saves are asynchronous (a response may come
    before the finished request's partial chunk reaches the store), so another engine's lookup right
    after it may not see that chunk yet."""
    wait_until(lambda: metric(url, "kvstore_connector_pending_saves") == 0, timeout_s, 0.1,
               what=f"no save of {url} pending")  # fmt: skip


class Proc:
    def __init__(self, args: list[str]) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore.engine", *args], cwd=ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip

    def drain(self) -> None:
        """Keep reading its output (a full pipe would block it); the last lines stay in `tail`."""
        self.tail: deque[str] = deque(maxlen=50)
        threading.Thread(target=lambda: self.tail.extend(self.proc.stdout), daemon=True).start()

    def wait_line(self, pattern: str, timeout: float = 300) -> re.Match:
        deadline = time.monotonic() + timeout
        seen = []
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            m = re.search(pattern, line)
            if m:
                self.drain()
                return m
        raise RuntimeError("process did not get ready:\n" + "".join(seen[-30:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def engine_server(store_url: str, role: str) -> tuple[Proc, str]:
    port = free_port()
    args = ["serve", "--port", str(port), "--kv-backend", "kvstore", "--kv-store-url", store_url]
    args += ["--kv-role", role, "--max-model-len", str(ENGINE["max_model_len"])]
    args += ["--kv-cache-memory", ENGINE["kv_cache_memory"], "--num-threads", "1"]
    proc = Proc(args)
    proc.drain()
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"engine ({role}) exited: {''.join(proc.tail)[-3000:]}")
        try:
            http_json(url + "/health", timeout=2)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False
        return True

    try:
        wait_until(healthy, 300, 0.5, RuntimeError, f"engine ({role}) starting")
    except RuntimeError:
        proc.stop()
        raise
    return proc, url


def test_pd_handoff_through_the_proxy_gives_a_single_engines_tokens(off, shared_server) -> None:
    prompt = doc(560, 50)
    (want,) = off.generate([prompt], GREEDY)
    procs = []
    try:
        prefill, prefill_url = engine_server(shared_server.url, "prefill")
        procs.append(prefill)
        decode, decode_url = engine_server(shared_server.url, "decode")
        procs.append(decode)
        proxy = Proc(["proxy", "--prefill", prefill_url, "--decode", decode_url, "--port", "0"])
        procs.append(proxy)
        proxy_url = proxy.wait_line(r"listening on (http://\S+)").group(1)

        body = {"prompt": prompt, "max_tokens": GREEDY.max_tokens, "temperature": 0, "ignore_eos": True}
        got = http_json(proxy_url + "/v1/completions", body)
        assert got["choices"][0]["text"] == want.outputs[0].text
        # the decode engine took every block below the last prompt token from the store: two full
        # chunks and the prefill engine's 48-token partial chunk (560 -> 544, the cap)
        assert metric(decode_url, "vllm:external_prefix_cache_hits_total") == 544
        assert metric(prefill_url, "vllm:generation_tokens_total") == 1, "prefill stops after one token"

        # a JSON-schema request: both sides get the constraint (the prefill side rejects a bad one
        # before any work); the decode side builds its matcher from it and answers as one engine does
        schema = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 24},
                  "pages": {"type": "integer", "minimum": 1, "maximum": 999}}, "required": ["title", "pages"]}  # fmt: skip
        so = StructuredOutputsParams(json=schema)
        (want,) = off.generate([prompt], SamplingParams(temperature=0, max_tokens=40, structured_outputs=so))
        fmt = {"type": "json_schema", "json_schema": {"name": "book", "schema": schema}}
        constrained = {**body, "max_tokens": 40, "ignore_eos": False, "response_format": fmt}
        got = http_json(proxy_url + "/v1/completions", constrained)["choices"][0]
        assert got["text"] == want.outputs[0].text and got["finish_reason"] == "stop"
        assert set(json.loads(got["text"])) == {"title", "pages"}
        with pytest.raises(urllib.error.HTTPError) as bad:
            http_json(proxy_url + "/v1/completions", {**body, "structured_outputs": {"regex": "(unclosed"}})
        assert bad.value.code == 400 and "cannot be compiled" in bad.value.read().decode()
    finally:
        for p in reversed(procs):
            p.stop()
