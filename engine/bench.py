"""`kvstore-engine bench latency|throughput`: figures measured side by side in one run.

Prompts are random token ids (seeded), and every request generates exactly `output_len` tokens
(`ignore_eos`; transformers gets `min_new_tokens`), so both engines do the same work.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import numpy as np
import torch

from engine.engine_args import EngineArgs
from engine.errors import InvalidRequest
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def random_prompts(
    vocab_size: int, n: int, length: int, seed: int, range_ratio: float = 0.0
) -> list[list[int]]:
    """`n` prompts of random token ids; lengths uniform in length * [1 - range_ratio, 1 + range_ratio]."""
    rng = np.random.default_rng(seed)
    lens = random_lengths(rng, n, length, range_ratio)
    # Stay clear of the special tokens at the start of the vocabulary.
    return [rng.integers(100, vocab_size, size=k).tolist() for k in lens]


def random_lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float) -> list[int]:
    lo, hi = max(1, round(length * (1 - range_ratio))), max(1, round(length * (1 + range_ratio)))
    return rng.integers(lo, hi + 1, size=n).tolist()


def _percentiles(name: str, values: list[float]) -> str:
    if not values:
        return f"{name}: n/a"
    ms = np.asarray(values) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return f"{name:<26} mean {ms.mean():8.1f} ms   p50 {p50:8.1f}   p90 {p90:8.1f}   p99 {p99:8.1f}"


def _print_config(title: str, args: EngineArgs, engine: LLMEngine, **extra: object) -> None:
    print(f"== {title} ==")
    print(
        f"model {engine.model_name} ({engine.dtype}, {args.device}), torch threads {torch.get_num_threads()}"
    )
    print("  " + ", ".join(f"{k}={v}" for k, v in {**extra, "block_size": args.block_size,
          "max_num_batched_tokens": args.max_num_batched_tokens, "kv_blocks": engine.block_manager.num_blocks}.items()))  # fmt: skip


def run_latency(
    args: EngineArgs, input_len: int, output_len: int, batch_size: int, num_iters: int, warmup: int, seed: int
) -> dict[str, float]:
    """Runs `batch_size` requests together `num_iters` times; TTFT, inter-token and e2e latency."""
    engine = LLMEngine(args)
    _print_config(
        "bench latency", args, engine, input_len=input_len, output_len=output_len, batch_size=batch_size
    )
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    ttft: list[float] = []
    itl: list[float] = []
    e2e: list[float] = []
    wall = 0.0
    for it in range(warmup + num_iters):
        prompts = random_prompts(engine.model_config.vocab_size, batch_size, input_len, seed + it)
        start = time.perf_counter()
        stamps: dict[str, list[float]] = {}
        for p in prompts:
            stamps[engine.add_request(p, params).request_id] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                stamps[out.request_id].append(time.perf_counter())
        if it < warmup:
            continue
        wall += time.perf_counter() - start
        for times in stamps.values():
            ttft.append(times[0] - start)
            itl.extend(np.diff(times).tolist())
            e2e.append(times[-1] - start)
    print(_percentiles("time to first token", ttft))
    print(_percentiles("inter-token latency", itl))
    print(_percentiles("end-to-end latency", e2e))
    tokens = batch_size * output_len * num_iters
    print(f"output throughput {tokens / wall:8.1f} tokens/s (batch {batch_size})")
    return {
        "ttft_p50": float(np.median(ttft)),
        "itl_p50": float(np.median(itl)),
        "e2e_p50": float(np.median(e2e)),
    }


def _run_hf(
    model_dir: str, prompts: list[list[int]], output_lens: list[int], dtype: torch.dtype
) -> tuple[float, int]:
    """transformers `generate` on all prompts as one left-padded batch. One batch has one length, so
    it runs to the longest output; only each request's own `output_lens[i]` tokens are counted."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    pad = model.config.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    n_out = max(output_lens)
    gen_kwargs = dict(do_sample=False, max_new_tokens=n_out, min_new_tokens=n_out, pad_token_id=pad)
    with torch.inference_mode():
        warm = {**gen_kwargs, "max_new_tokens": 2, "min_new_tokens": 2}
        model.generate(input_ids=ids[:1, -8:], attention_mask=mask[:1, -8:], **warm)
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, **gen_kwargs)
        elapsed = time.perf_counter() - start
    assert out.shape[1] - width == n_out
    return elapsed, sum(output_lens)


def run_throughput(
    args: EngineArgs,
    num_prompts: int,
    input_len: int,
    output_len: int,
    compare_hf: bool,
    seed: int,
    range_ratio: float = 0.0,
) -> dict[str, float]:
    if not 0 <= range_ratio < 1:
        raise InvalidRequest(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    llm = LLM(**asdict(args))
    engine = llm.engine
    _print_config("bench throughput", args, engine, num_prompts=num_prompts, input_len=input_len,
                  output_len=output_len, range_ratio=range_ratio)  # fmt: skip
    prompts = random_prompts(engine.model_config.vocab_size, num_prompts, input_len, seed, range_ratio)
    output_lens = random_lengths(np.random.default_rng(seed + 1), num_prompts, output_len, range_ratio)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
    engine.block_manager.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert generated == sum(output_lens)
    n_in = sum(len(p) for p in prompts)
    result = {"engine_tokens_per_s": generated / elapsed, "engine_seconds": elapsed}
    print(f"kvstore-engine : {generated} tokens in {elapsed:6.2f} s = {generated / elapsed:8.1f} output tokens/s "
          f"({(generated + n_in) / elapsed:8.1f} total tokens/s)")  # fmt: skip
    if compare_hf:
        hf_elapsed, hf_generated = _run_hf(str(engine.model_dir), prompts, output_lens, engine.dtype)
        result.update(hf_tokens_per_s=hf_generated / hf_elapsed, hf_seconds=hf_elapsed)
        print(f"transformers   : {hf_generated} tokens in {hf_elapsed:6.2f} s = "
              f"{hf_generated / hf_elapsed:8.1f} output tokens/s (generate, batch {num_prompts}, same prompts)")  # fmt: skip
        result["speedup"] = hf_elapsed / elapsed
        print(f"speedup        : {result['speedup']:.2f}x transformers")
    return result
