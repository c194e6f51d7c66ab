"""The systems `bench throughput` runs side by side on the same requests: this engine, transformers
`generate` and vLLM (in a subprocess). Each is loaded once and then runs whole rounds on demand, so the
benchmark can interleave them round by round.

Every request is greedy and generates exactly its `output_len` tokens (`ignore_eos`; transformers gets
`min_new_tokens`), so all systems do the same work.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from kvstore.engine.bench.datasets import BenchRequest
from kvstore.engine.bench.stats import Timer
from kvstore.engine.errors import EngineError
from kvstore.engine.llm import LLM
from kvstore.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


CPU_TICK = 0.01  # the resolution of the OS's CPU-time counters; a shorter round counts as one tick


@dataclass(frozen=True)
class RoundResult:
    wall: float  # seconds
    cpu: float  # CPU-seconds of the processes doing the work (at least CPU_TICK)
    output_tokens: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "cpu", max(self.cpu, CPU_TICK))


class EngineSystem:
    name = "kvstore-engine"

    def __init__(self, llm: LLM) -> None:
        self.llm = llm

    def run(self, requests: list[BenchRequest]) -> RoundResult:
        self.llm.engine.block_manager.reset_prefix_cache()  # rounds repeat the prompts
        params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
        with Timer() as t:
            outputs = self.llm.generate([r.prompt_token_ids for r in requests], params)
        return RoundResult(t.wall, t.cpu, sum(len(o.outputs[0].token_ids) for o in outputs))

    def close(self) -> None:
        pass


class HFSystem:
    """transformers `generate` on all prompts as one left-padded batch. One batch has one length, so
    it runs to the longest output; only each request's own `output_len` tokens are counted."""

    name = "transformers"

    def __init__(self, model_dir: str | Path, dtype: torch.dtype, pad_token_id: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.pad = pad_token_id
        self.run([BenchRequest(list(range(100, 108)), 2)])  # warm-up

    def run(self, requests: list[BenchRequest]) -> RoundResult:
        prompts = [r.prompt_token_ids for r in requests]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        n = max(r.output_len for r in requests)
        with torch.inference_mode(), Timer() as t:
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                pad_token_id=self.pad,
            )  # fmt: skip
        assert out.shape[1] - width == n, (out.shape, width, n)
        return RoundResult(t.wall, t.cpu, sum(r.output_len for r in requests))

    def close(self) -> None:
        del self.model


class VLLMSystem:
    """vLLM's offline `LLM` in a child process (see `vllm_worker.py`), with as many OpenMP threads as
    this engine uses and no thread pinning (the box is shared)."""

    name = "vllm"

    def __init__(
        self,
        model_dir: str | Path,
        dtype: str,
        max_model_len: int,
        num_threads: int,
        kv_cache_bytes: int,
        kv_cache_dtype: str = "auto",
        compile: bool = False,
    ) -> None:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(num_threads),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_CPU_KVCACHE_SPACE": str(max(1, -(-kv_cache_bytes // 2**30))),  # GiB, rounded up
        }
        cmd = [
            sys.executable, str(Path(__file__).with_name("vllm_worker.py")), "--model", str(model_dir),
            "--dtype", dtype, "--max-model-len", str(max_model_len), "--kv-cache-dtype", kv_cache_dtype,
        ] + (["--compile"] if compile else [])  # fmt: skip
        self.log = tempfile.NamedTemporaryFile(
            "w+", prefix="kvstore-bench-vllm-", suffix=".log", delete=False
        )
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env
        )
        self.version = self._read()["vllm_version"]

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("KVSTORE-BENCH "):
                return json.loads(line.removeprefix("KVSTORE-BENCH "))
        self.proc.wait(timeout=30)
        self.log.seek(0)
        tail = "".join(self.log.readlines()[-20:])
        raise EngineError(f"the vLLM worker exited with {self.proc.returncode}; log {self.log.name}:\n{tail}")

    def run(self, requests: list[BenchRequest]) -> RoundResult:
        assert self.proc.stdin is not None
        payload = {"requests": [[r.prompt_token_ids, r.output_len] for r in requests]}
        self.proc.stdin.write(json.dumps(payload) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        return RoundResult(reply["wall"], reply["cpu"], reply["output_tokens"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if self.proc.returncode == 0:
            os.unlink(self.log.name)  # a failed worker's log stays for the error message


def vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None
