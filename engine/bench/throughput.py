"""`kvstore-engine bench throughput`: tokens/s and CPU-seconds of this engine, and with
`--compare-hf` / `--compare-vllm` of transformers and vLLM on the same requests in the same run.

Systems are interleaved round by round (the order rotates every round) and the figures are medians
over rounds with their min-max spread; ratios are medians of per-round ratios. With `--measure-decode`
every round also runs the prompts with one output token, and the difference is the decode phase:
decode tokens/s and the time of one decode step (the inter-token latency at this batch size).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

import torch
from kvstore.engine.bench.datasets import BenchRequest, load_requests
from kvstore.engine.bench.stats import Spread, write_json
from kvstore.engine.bench.systems import EngineSystem, HFSystem, RoundResult, VLLMSystem, vllm_installed
from kvstore.engine.engine_args import EngineArgs
from kvstore.engine.errors import InvalidRequest
from kvstore.engine.llm import LLM


@dataclass
class ThroughputOptions:
    dataset: str = "random"  # "random" or a JSONL path
    num_prompts: int = 16
    input_len: int = 128
    output_len: int = 64
    random_range_ratio: float = 0.0
    seed: int = 0
    num_rounds: int = 3
    compare_hf: bool = False
    compare_vllm: bool = False
    vllm_compile: bool = False
    measure_decode: bool = False
    output_json: str | None = None

    def __post_init__(self) -> None:
        if self.num_rounds < 1:
            raise InvalidRequest(f"--num-rounds must be >= 1, got {self.num_rounds}")


@dataclass
class _Rounds:
    full: list[RoundResult] = dataclasses.field(default_factory=list)
    prefill: list[RoundResult] = dataclasses.field(default_factory=list)  # --measure-decode: 1 token out


def _figures(r: _Rounds, requests: list[BenchRequest]) -> dict[str, list[float]]:
    n_in = sum(len(q.prompt_token_ids) for q in requests)
    f: dict[str, list[float]] = {
        "output_tokens_per_s": [x.output_tokens / x.wall for x in r.full],
        "total_tokens_per_s": [(x.output_tokens + n_in) / x.wall for x in r.full],
        "requests_per_s": [len(requests) / x.wall for x in r.full],
        "seconds": [x.wall for x in r.full],
        "cpu_seconds": [x.cpu for x in r.full],
        "output_tokens_per_cpu_s": [x.output_tokens / x.cpu for x in r.full],
    }
    if r.prefill:
        decode_tokens = sum(q.output_len - 1 for q in requests)
        walls = [max(full.wall - pre.wall, 1e-9) for full, pre in zip(r.full, r.prefill, strict=True)]
        f["decode_tokens_per_s"] = [decode_tokens / w for w in walls]
        f["decode_cpu_seconds"] = [full.cpu - pre.cpu for full, pre in zip(r.full, r.prefill, strict=True)]
        steps = max(q.output_len for q in requests) - 1
        if steps > 0:
            f["decode_step_ms"] = [w / steps * 1e3 for w in walls]
    return f


def run_throughput(args: EngineArgs, opts: ThroughputOptions) -> dict:
    llm = LLM(**asdict(args))
    engine = llm.engine
    requests = load_requests(
        opts.dataset, vocab_size=engine.model_config.vocab_size, encode=engine.tokenize,
        num_prompts=opts.num_prompts, input_len=opts.input_len, output_len=opts.output_len,
        range_ratio=opts.random_range_ratio, seed=opts.seed,
    )  # fmt: skip
    if opts.measure_decode and any(r.output_len < 2 for r in requests):
        raise InvalidRequest("--measure-decode needs output lengths of at least 2")
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    if longest > engine.max_model_len:
        raise InvalidRequest(f"a request needs {longest} positions; max_model_len is {engine.max_model_len}")
    threads = torch.get_num_threads()
    print("== bench throughput ==")
    kv = str(engine.kv_cache_dtype).removeprefix("torch.")
    print(f"model {engine.model_name} ({engine.dtype}, kv cache {kv}, {args.device}), "
          f"torch threads {threads}, kv blocks {engine.block_manager.num_blocks} x {args.block_size}")  # fmt: skip
    print(f"  dataset {opts.dataset}: {len(requests)} requests, "
          f"{sum(len(r.prompt_token_ids) for r in requests)} prompt tokens, "
          f"{sum(r.output_len for r in requests)} output tokens; {opts.num_rounds} rounds")  # fmt: skip
    llm.generate([r.prompt_token_ids for r in requests[:2]], [_warm()] * min(2, len(requests)))

    systems: list = [EngineSystem(llm)]
    try:
        if opts.compare_hf:
            systems.append(HFSystem(engine.model_dir, engine.dtype, _pad_token(engine)))
        if opts.compare_vllm:
            if vllm_installed():
                vllm = VLLMSystem(
                    engine.model_dir, str(engine.dtype).removeprefix("torch."), engine.max_model_len, threads,
                    args.kv_cache_memory, "auto", opts.vllm_compile,
                )  # fmt: skip
                systems.append(vllm)
                print(
                    f"  vllm {vllm.version} in a subprocess ({'compiled' if opts.vllm_compile else 'eager'})"
                )
            else:
                print("  --compare-vllm: vllm is not installed, skipped")
        rounds = {s.name: _Rounds() for s in systems}
        prefill_only = [dataclasses.replace(r, output_len=1) for r in requests]
        for i in range(opts.num_rounds):
            order = systems[i % len(systems) :] + systems[: i % len(systems)]
            for s in order:
                rounds[s.name].full.append(res := s.run(requests))
                if opts.measure_decode:
                    rounds[s.name].prefill.append(s.run(prefill_only))
                print(f"  round {i + 1} {s.name:<15} {res.output_tokens / res.wall:8.1f} output tokens/s, "
                      f"{res.wall:6.2f} s, {res.cpu:6.2f} CPU-s", flush=True)  # fmt: skip
    finally:
        for s in systems:
            s.close()
    return _report(rounds, requests, opts, systems[0].name)


def _report(
    rounds: dict[str, _Rounds], requests: list[BenchRequest], opts: ThroughputOptions, ours: str
) -> dict:
    figures = {name: _figures(r, requests) for name, r in rounds.items()}
    result: dict = {"options": asdict(opts), "num_requests": len(requests), "systems": {}, "ratios": {}}
    for name, f in figures.items():
        result["systems"][name] = {k: asdict(Spread.of(v)) | {"rounds": v} for k, v in f.items()}
        line = (f"{name:<15}: {Spread.of(f['output_tokens_per_s'])} output tokens/s, "
                f"{Spread.of(f['total_tokens_per_s'])} total tokens/s, {Spread.of(f['requests_per_s'])} requests/s, "
                f"{Spread.of(f['cpu_seconds'])} CPU-s")  # fmt: skip
        if "decode_tokens_per_s" in f:
            line += f"; decode {Spread.of(f['decode_tokens_per_s'])} tokens/s"
            if "decode_step_ms" in f:
                line += f", {Spread.of(f['decode_step_ms'])} ms/step"
        print(line)
    mine = figures[ours]
    for name, f in figures.items():
        if name == ours:
            continue
        # > 1 means this engine is better: more tokens/s, fewer CPU-seconds.
        ratios = {
            "throughput": [
                a / b for a, b in zip(mine["output_tokens_per_s"], f["output_tokens_per_s"], strict=True)
            ],
            "cpu_efficiency": [b / a for a, b in zip(mine["cpu_seconds"], f["cpu_seconds"], strict=True)],
        }
        if "decode_tokens_per_s" in f:
            ratios["decode"] = [
                a / b for a, b in zip(mine["decode_tokens_per_s"], f["decode_tokens_per_s"], strict=True)
            ]
        result["ratios"][name] = {k: asdict(Spread.of(v)) | {"rounds": v} for k, v in ratios.items()}
        text = ", ".join(f"{k} {Spread.of(v)}x" for k, v in ratios.items())
        print(f"speedup vs {name:<12}: {text}  (median of per-round ratios, min-max)")
    write_json(opts.output_json, result)
    return result


def _warm():
    from kvstore.engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=2)


def _pad_token(engine) -> int:
    eos = engine.model_config.eos_token_ids
    return eos[0] if eos else 0
