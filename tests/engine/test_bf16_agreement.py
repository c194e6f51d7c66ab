"""bf16 on the real SmolLM2 against transformers bf16 (and fp32): greedy agreement, printed.

The engine's bf16 keeps bf16 weights and KV but computes in fp32 (the CPU kernels; on AMX or AVX-512 BF16
CPUs the GEMM inputs are rounded to bf16, their sums stay fp32); transformers bf16 rounds every activation to bf16. So the two drift apart after a while in free-running greedy decoding,
while next-token (teacher-forced) top-1 agreement stays high. The engine must also be at least as close
to fp32 as transformers' own bf16 is.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kvstore.engine import LLM, SamplingParams
from kvstore.engine.loader import load_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]
N = 32
PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
    "The three primary colors are",
    "Here is a list of the planets of the solar system, in order from the sun, with one fact about each:",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
]


def _hf(model_dir: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def _hf_greedy(model, ids: list[int]) -> list[int]:
    with torch.inference_mode():
        t = torch.tensor([ids])
        out = model.generate(t, attention_mask=torch.ones_like(t), do_sample=False, max_new_tokens=N,
                             min_new_tokens=N)  # fmt: skip
    return out[0, len(ids) :].tolist()


def _hf_top1(model, seq: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([seq])).logits[0].float().argmax(-1)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_bf16_greedy_agreement_with_transformers(smollm2_dir: Path, paged_kv) -> None:
    llm = LLM(str(smollm2_dir), dtype="bfloat16", max_model_len=512, kv_cache_memory="32MiB")
    hf16, hf32 = _hf(smollm2_dir, torch.bfloat16), _hf(smollm2_dir, torch.float32)
    ours_model, _ = load_model(smollm2_dir, dtype="bfloat16")
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    prefix, tf_ours16, tf_ours32, tf_hf16 = [], [], [], []
    for prompt in PROMPTS:
        ids = llm.engine.tokenize(prompt)
        ours = llm.generate([ids], params)[0].outputs[0].token_ids
        prefix.append(_common_prefix(ours, _hf_greedy(hf16, ids)))
        # next-token agreement along the fp32 reference's own continuation
        seq = ids + _hf_greedy(hf32, ids)
        kv = paged_kv.for_model(ours_model, num_blocks=64, block_size=16, dtype=torch.bfloat16)
        x, pos, meta = kv.step([(0, seq)])
        with torch.inference_mode():
            ours_top1 = ours_model.compute_logits(ours_model(x, pos, meta)).argmax(-1)
        ref32, ref16 = _hf_top1(hf32, seq), _hf_top1(hf16, seq)
        gen = slice(len(ids) - 1, len(seq) - 1)  # the positions that predict generated tokens
        tf_ours16.append((ours_top1[gen] == ref16[gen]).float().mean().item())
        tf_ours32.append((ours_top1[gen] == ref32[gen]).float().mean().item())
        tf_hf16.append((ref16[gen] == ref32[gen]).float().mean().item())
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    print(
        f"\nbf16 greedy vs transformers bf16: identical first {prefix} of {N} tokens "
        f"({sum(prefix)}/{N * len(PROMPTS)} = {sum(prefix) / (N * len(PROMPTS)):.0%} before the first divergence)"
    )
    print(f"teacher-forced top-1: engine bf16 vs transformers bf16 {mean(tf_ours16):.1%}, "
          f"vs transformers fp32 {mean(tf_ours32):.1%}; transformers bf16 vs fp32 {mean(tf_hf16):.1%}")  # fmt: skip
    assert mean(tf_ours16) >= 0.9
    assert mean(tf_ours32) >= mean(tf_hf16) - 0.02  # at least as close to fp32 as transformers' bf16
    assert sum(p >= 4 for p in prefix) >= len(PROMPTS) - 1  # greedy starts out the same
