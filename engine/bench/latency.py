"""`kvstore-engine bench latency`: TTFT, inter-token and end-to-end latency of a batch of requests
run together, over several iterations after warm-up ones."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
from kvstore.engine.bench.datasets import random_requests
from kvstore.engine.bench.stats import format_ms, percentiles, write_json
from kvstore.engine.engine_args import EngineArgs
from kvstore.engine.llm_engine import LLMEngine
from kvstore.engine.sampling_params import SamplingParams


@dataclass
class LatencyOptions:
    input_len: int = 128
    output_len: int = 32
    batch_size: int = 1
    num_iters: int = 3
    num_iters_warmup: int = 1
    seed: int = 0
    output_json: str | None = None


def run_latency(args: EngineArgs, opts: LatencyOptions) -> dict:
    engine = LLMEngine(args)
    print("== bench latency ==")
    kv = str(engine.kv_cache_dtype).removeprefix("torch.")
    print(f"model {engine.model_name} ({engine.dtype}, kv cache {kv}, {args.device}), torch threads {torch.get_num_threads()}, "
          f"kv blocks {engine.block_manager.num_blocks} x {args.block_size}")  # fmt: skip
    print(f"  input_len={opts.input_len}, output_len={opts.output_len}, batch_size={opts.batch_size}")
    params = SamplingParams(temperature=0.0, max_tokens=opts.output_len, ignore_eos=True)
    ttft: list[float] = []
    itl: list[float] = []
    e2e: list[float] = []
    wall = 0.0
    vocab = engine.model_config.vocab_size
    for it in range(opts.num_iters_warmup + opts.num_iters):
        requests = random_requests(
            vocab, opts.batch_size, opts.input_len, opts.output_len, seed=opts.seed + it
        )
        start = time.perf_counter()
        stamps: dict[str, list[float]] = {}
        for r in requests:
            stamps[engine.add_request(r.prompt_token_ids, params).request_id] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                stamps[out.request_id].append(time.perf_counter())
        if it < opts.num_iters_warmup:
            continue
        wall += time.perf_counter() - start
        for times in stamps.values():
            ttft.append(times[0] - start)
            itl.extend(np.diff(times).tolist())
            e2e.append(times[-1] - start)
    engine.shutdown()
    print(format_ms("time to first token", ttft))
    print(format_ms("inter-token latency", itl))
    print(format_ms("end-to-end latency", e2e))
    tokens = opts.batch_size * opts.output_len * opts.num_iters
    print(f"output throughput {tokens / wall:8.1f} tokens/s (batch {opts.batch_size})")
    result = {
        "options": asdict(opts),
        "ttft_s": percentiles(ttft),
        "itl_s": percentiles(itl),
        "e2e_s": percentiles(e2e),
        "output_tokens_per_s": tokens / wall,
    }
    write_json(opts.output_json, result)
    return result
