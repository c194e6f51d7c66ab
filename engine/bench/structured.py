"""`kvstore-engine bench latency|throughput --structured-output json`: JSON-schema decoding against
free decoding of the same prompts in one run, rounds interleaved (the order alternates), medians of
the per-round ratios with their spread; and the grammar compile time, cold and cached.

The schema is an array of at least 1,000 records, so no answer can close it before `output_len`:
every generated token is a constrained one, and both sides generate exactly `output_len` tokens.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import numpy as np
import torch

from engine.bench.datasets import random_requests
from engine.bench.latency import LatencyOptions
from engine.bench.stats import Spread, write_json
from engine.bench.throughput import ThroughputOptions
from engine.engine_args import EngineArgs
from engine.errors import InvalidRequest
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputsParams

BENCH_SCHEMA = {
    "type": "array",
    "minItems": 1000,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 1000000},
            "name": {"type": "string", "maxLength": 16},
            "email": {"type": "string", "format": "email"},
            "active": {"type": "boolean"},
            "role": {"enum": ["admin", "editor", "viewer"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        },
        "required": ["id", "name", "email", "active", "role", "tags"],
    },
}
COMPILE_CASES = {
    "bench schema": StructuredOutputsParams(json=BENCH_SCHEMA),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex (date)": StructuredOutputsParams(regex=r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"),
    "choice (3)": StructuredOutputsParams(choice=["positive", "negative", "neutral"]),
}


def compile_times(engine: LLMEngine, repeats: int = 5) -> dict[str, dict[str, float]]:
    """{case: {"cold_s", "cached_s"}}, medians. Cold clears the tokenizer's grammar cache first."""
    cache = engine.structured_output.cache
    out = {}
    for name, params in COMPILE_CASES.items():
        cold, cached = [], []
        for _ in range(repeats):
            cache.clear()
            start = time.perf_counter()
            cache.get(params)
            cold.append(time.perf_counter() - start)
            for _ in range(20):
                start = time.perf_counter()
                cache.get(params)
                cached.append(time.perf_counter() - start)
        out[name] = {"cold_s": float(np.median(cold)), "cached_s": float(np.median(cached))}
        print(f"compile {name:<14} cold {out[name]['cold_s'] * 1e3:9.2f} ms   "
              f"cached {out[name]['cached_s'] * 1e6:8.2f} us")  # fmt: skip
    cache.get(COMPILE_CASES["bench schema"])  # the runs start warm
    return out


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[float]]:
    """One batch to completion: (wall seconds, the inter-token gaps of every request)."""
    start = time.perf_counter()
    stamps: dict[str, list[float]] = {engine.add_request(p, params).request_id: [] for p in prompts}
    while engine.has_unfinished_requests():
        for out in engine.step():
            stamps[out.request_id].append(time.perf_counter())
    wall = time.perf_counter() - start
    assert all(len(s) == params.max_tokens for s in stamps.values())
    return wall, [gap for s in stamps.values() for gap in np.diff(s).tolist()]


def _compare(engine: LLMEngine, rounds: list[list[list[int]]], output_len: int) -> dict[str, list[float]]:
    """Per round: the median ITL of each side and the json/free ratios of ITL and elapsed time."""
    free = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    json = SamplingParams(
        temperature=0.0, max_tokens=output_len, ignore_eos=True,
        structured_outputs=StructuredOutputsParams(json=BENCH_SCHEMA),
    )  # fmt: skip
    figures: dict[str, list[float]] = {"itl_free": [], "itl_json": [], "itl_ratio": [], "elapsed_ratio": []}
    for r, prompts in enumerate(rounds):
        results = {}
        for name in ("free", "json") if r % 2 == 0 else ("json", "free"):
            engine.block_manager.reset_prefix_cache()
            results[name] = _run(engine, prompts, free if name == "free" else json)
        itl = {name: float(np.median(gaps)) for name, (_, gaps) in results.items()}
        figures["itl_free"].append(itl["free"])
        figures["itl_json"].append(itl["json"])
        figures["itl_ratio"].append(itl["json"] / itl["free"])
        figures["elapsed_ratio"].append(results["json"][0] / results["free"][0])
    return figures


def _header(title: str, args: EngineArgs, engine: LLMEngine, **shape: object) -> None:
    print(f"== {title} ==")
    print(
        f"model {engine.model_name} ({engine.dtype}, {args.device}), torch threads {torch.get_num_threads()}"
    )
    print("  " + ", ".join(f"{k}={v}" for k, v in shape.items()))


def _report(figures: dict[str, list[float]]) -> dict[str, object]:
    itl, elapsed = Spread.of(figures["itl_ratio"]), Spread.of(figures["elapsed_ratio"])
    print(f"inter-token latency p50    free {np.median(figures['itl_free']) * 1e3:8.2f} ms   "
          f"json {np.median(figures['itl_json']) * 1e3:8.2f} ms")  # fmt: skip
    print(f"json / free ITL, median of {len(figures['itl_ratio'])} rounds (min-max): {itl}")
    print(f"json / free elapsed, same rounds:            {elapsed}")
    print(f"structured-output overhead per token: {(itl.median - 1) * 100:+.1f}% (goal <= +10%)")
    return {"itl_ratio": asdict(itl), "elapsed_ratio": asdict(elapsed), "rounds": figures}


def run_latency(args: EngineArgs, opts: LatencyOptions) -> dict:
    engine = LLMEngine(args)
    _header("bench latency --structured-output json", args, engine, input_len=opts.input_len,
            output_len=opts.output_len, batch_size=opts.batch_size, rounds=opts.num_iters)  # fmt: skip
    compiled = compile_times(engine)
    vocab = engine.model_config.vocab_size
    rounds = [
        [
            r.prompt_token_ids
            for r in random_requests(vocab, opts.batch_size, opts.input_len, 1, seed=opts.seed + i)
        ]
        for i in range(opts.num_iters_warmup + opts.num_iters)
    ]
    _compare(engine, rounds[: opts.num_iters_warmup], opts.output_len)
    result = {"options": asdict(opts), "compile": compiled}
    result.update(_report(_compare(engine, rounds[opts.num_iters_warmup :], opts.output_len)))
    engine.shutdown()
    write_json(opts.output_json, result)
    return result


def run_throughput(args: EngineArgs, opts: ThroughputOptions) -> dict:
    if opts.dataset != "random" or opts.compare_hf or opts.compare_vllm:
        raise InvalidRequest("--structured-output json runs random prompts on this engine only")
    engine = LLMEngine(args)
    _header("bench throughput --structured-output json", args, engine, num_prompts=opts.num_prompts,
            input_len=opts.input_len, output_len=opts.output_len, rounds=opts.num_rounds)  # fmt: skip
    compiled = compile_times(engine)
    requests = random_requests(
        engine.model_config.vocab_size, opts.num_prompts, opts.input_len, 1, seed=opts.seed
    )
    prompts = [r.prompt_token_ids for r in requests]
    _compare(engine, [prompts[:2]], 4)  # warm-up
    result = {"options": asdict(opts), "compile": compiled}
    result.update(_report(_compare(engine, [prompts] * opts.num_rounds, opts.output_len)))
    engine.shutdown()
    write_json(opts.output_json, result)
    return result
