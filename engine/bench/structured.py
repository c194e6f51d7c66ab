"""`kvstore-engine bench latency|throughput --structured-output json`: JSON-schema decoding against
free decoding of the same prompts in one run, rounds interleaved (the order alternates), medians of
the per-round ratios with their spread; and the grammar compile time, cold and cached.

The schema is an array of at least 1,000 records, so no answer can close it before `output_len`:
every generated token is a constrained one, and both sides generate exactly `output_len` tokens.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
from kvstore.engine.bench.datasets import random_requests
from kvstore.engine.bench.latency import LatencyOptions
from kvstore.engine.bench.stats import Spread, write_json
from kvstore.engine.bench.throughput import ThroughputOptions
from kvstore.engine.engine_args import EngineArgs
from kvstore.engine.errors import InvalidRequest
from kvstore.engine.llm_engine import LLMEngine
from kvstore.engine.sampling_params import SamplingParams
from kvstore.engine.structured_output import StructuredOutputsParams

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


@dataclass
class _Run:
    wall: float  # seconds
    steps: int
    gaps: list[float]  # inter-token gaps of every request
    outputs: list[list[int]]  # the generated tokens of every request


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> _Run:
    start = time.perf_counter()
    stamps: dict[str, list[float]] = {engine.add_request(p, params).request_id: [] for p in prompts}
    outputs, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            stamps[out.request_id].append(time.perf_counter())
            outputs[out.request_id] = out.outputs[0].token_ids
    wall = time.perf_counter() - start
    assert all(len(s) == params.max_tokens for s in stamps.values())
    gaps = [gap for s in stamps.values() for gap in np.diff(s).tolist()]
    return _Run(wall, steps, gaps, list(outputs.values()))


def _accept_seconds_per_token(
    engine: LLMEngine, params: StructuredOutputsParams, outputs: list[list[int]]
) -> float:
    """What the scheduler's matcher.accept_token costs: the generated tokens replayed on fresh matchers."""
    requests = [engine.structured_output.new_request(params) for _ in outputs]
    start = time.perf_counter()
    for request, tokens in zip(requests, outputs, strict=True):
        for t in tokens:
            assert request.accept_token(t)
    return (time.perf_counter() - start) / sum(len(t) for t in outputs)


def _compare(engine: LLMEngine, rounds: list[list[list[int]]], output_len: int) -> dict[str, list[float]]:
    """Per round: the median ITL of each side, the json/free ratios of ITL and elapsed time, and the
    grammar's own work (bitmask fill + masking, timed inside the engine; accept, replayed) per step
    as a share of the free side's step time: the overhead without the box's noise."""
    constraint = StructuredOutputsParams(json=BENCH_SCHEMA)
    free = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    json = SamplingParams(
        temperature=0.0, max_tokens=output_len, ignore_eos=True, structured_outputs=constraint
    )
    names = ("itl_free", "itl_json", "itl_ratio", "elapsed_ratio", "grammar_ms_per_step", "grammar_share")
    figures: dict[str, list[float]] = {name: [] for name in names}
    so = engine.structured_output
    for r, prompts in enumerate(rounds):
        results = {}
        for name in ("free", "json") if r % 2 == 0 else ("json", "free"):
            engine.block_manager.reset_prefix_cache()
            before = so.mask_seconds
            results[name] = _run(engine, prompts, free if name == "free" else json)
            if name == "json":
                mask_s = so.mask_seconds - before
        itl = {name: float(np.median(run.gaps)) for name, run in results.items()}
        figures["itl_free"].append(itl["free"])
        figures["itl_json"].append(itl["json"])
        figures["itl_ratio"].append(itl["json"] / itl["free"])
        figures["elapsed_ratio"].append(results["json"].wall / results["free"].wall)
        accept_s = _accept_seconds_per_token(engine, constraint, results["json"].outputs) * len(prompts)
        per_step = mask_s / results["json"].steps + accept_s
        figures["grammar_ms_per_step"].append(per_step * 1e3)
        figures["grammar_share"].append(per_step / (results["free"].wall / results["free"].steps))
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
    share = Spread.of(figures["grammar_share"])
    ms = np.median(figures["grammar_ms_per_step"])
    print(f"grammar work per step (fill + mask + accept): {ms:.2f} ms = {share.median * 100:.1f}% of a "
          f"free step (rounds {share.lo * 100:.1f}-{share.hi * 100:.1f}%)")  # fmt: skip
    print(f"structured-output overhead per token: {(itl.median - 1) * 100:+.1f}% measured end to end, "
          f"{share.median * 100:+.1f}% from the grammar's own time (goal <= +10%)")  # fmt: skip
    return {"itl_ratio": asdict(itl), "elapsed_ratio": asdict(elapsed), "grammar_share": asdict(share),
            "rounds": figures}  # fmt: skip


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
