"""The Triton kernels (KV store, paged decode attention) against the torch path, under
`TRITON_INTERPRET=1` on CPU tensors and small shapes.

The interpreter must be switched on before triton is imported, and other test modules import triton
without it, so the cases run in one subprocess (`python -m tests.engine.test_triton_kernels
TINY_LLAMA_DIR`) that prints one JSON line per case; each pytest test checks its line. On a CUDA machine the same cases
also run compiled, in-process (`-m gpu`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.triton_interpret import interpreted_rows

# name: (q... per-seq context lengths, heads, kv_heads, head_dim, block_size, window, dtype)
DECODE_CASES = {
    "gqa3_d64_bs16": ([1, 17, 40], 9, 3, 64, 16, None, "float32"),
    "gqa2_d128_bs4": ([5, 12], 4, 2, 128, 4, None, "float32"),
    "mha_d64_bs4": ([9, 3], 4, 4, 64, 4, None, "float32"),
    "mqa_d64_bs16_window": ([40, 7, 23], 8, 1, 64, 16, 6, "float32"),
    "gqa4_d128_bs16_bf16": ([33, 2], 8, 2, 128, 16, None, "bfloat16"),
    "gqa3_d64_bs4_window_bf16": ([30, 11], 6, 2, 64, 4, 9, "bfloat16"),
}
STORE_CASES = {
    "store_d64_fp32": (2, 64, 4, "float32", "float32"),
    "store_d128_h3_bf16": (3, 128, 16, "float32", "bfloat16"),
    "store_d64_bf16_bf16": (1, 64, 16, "bfloat16", "bfloat16"),
}


def _decode_case(name: str, device: str) -> dict:
    from kvstore.engine.layers import triton_attention
    from kvstore.engine.layers.paged_attention import paged_attention, store_kvcache

    from tests.engine.test_attention import make_case

    ctx, heads, kv_heads, dim, bs, window, dtype = DECODE_CASES[name]
    dtype = getattr(torch, dtype)
    kv_cache, q, k, v, meta, _ = make_case([1] * len(ctx), ctx, heads, kv_heads, dim, bs, dtype=dtype, seed=7)
    store_kvcache(k, v, kv_cache, meta.slot_mapping)
    ref = paged_attention(q, kv_cache, meta, dim**-0.5, window)
    dev_meta = type(meta)(
        **{
            f: getattr(meta, f).to(device) if torch.is_tensor(getattr(meta, f)) else getattr(meta, f)
            for f in meta.__dataclass_fields__
        }
    )
    out = triton_attention.paged_decode_attention(
        q.to(device), kv_cache.to(device), dev_meta, dim**-0.5, window
    )
    err = (out.cpu().float() - ref.float()).abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    return {"case": name, "max_err": err, "ok": err <= tol and out.dtype == q.dtype}


def _store_case(name: str, device: str) -> dict:
    from kvstore.engine.layers import triton_attention
    from kvstore.engine.layers.paged_attention import store_kvcache

    heads, dim, bs, in_dtype, cache_dtype = STORE_CASES[name]
    gen = torch.Generator().manual_seed(3)
    n, num_blocks = 11, 6
    k = torch.randn(n, heads, dim, generator=gen).to(getattr(torch, in_dtype))
    v = torch.randn(n, heads, dim, generator=gen).to(getattr(torch, in_dtype))
    slots = torch.randperm(num_blocks * bs, generator=gen)[:n]
    slots[[2, 7]] = -1
    ref = torch.randn(2, num_blocks, bs, heads, dim, generator=gen).to(getattr(torch, cache_dtype))
    cache = ref.clone().to(device)
    store_kvcache(k, v, ref, slots)
    triton_attention.store_kvcache(k.to(device), v.to(device), cache, slots.to(device))
    return {"case": name, "max_err": 0.0, "ok": torch.equal(cache.cpu(), ref)}


def _model_case(device: str, model_dir: Path) -> dict:
    """A tiny Llama through prefill, chunked prefill and decode with the kernels on vs off."""
    from kvstore.engine.loader import load_model

    from tests.engine.conftest import PagedKV

    model, _ = load_model(model_dir, device=device)
    tokens = torch.randint(0, 320, (23,), generator=torch.Generator().manual_seed(5)).tolist()
    logits = {}
    for use_triton in (False, True):
        for m in model.modules():
            if hasattr(m, "use_triton"):
                m.use_triton = use_triton
        kv = PagedKV.for_model(model, num_blocks=16, block_size=4, device=device)
        steps = [[(0, tokens[:9]), (1, tokens[:4])], [(0, tokens[9:15]), (1, tokens[4:5])]]
        steps += [[(0, [t]), (1, [t])] for t in tokens[15:]]
        out = []
        with torch.no_grad():
            for batch in steps:
                ids, pos, meta = kv.step(batch)
                out.append(model.compute_logits(model(ids, pos, meta)).cpu())
        logits[use_triton] = torch.cat(out)
    err = (logits[True] - logits[False]).abs().max().item()
    return {"case": "tiny_llama_model", "max_err": err, "ok": err <= 1e-4}


def run_all(device: str, model_dir: Path) -> list[dict]:
    results = [_model_case(device, model_dir)]
    for name in STORE_CASES:
        results.append(_store_case(name, device))
    for name in DECODE_CASES:
        results.append(_decode_case(name, device))
    return results


@pytest.fixture(scope="module")
def interpreted(tiny_checkpoints) -> dict[str, dict]:
    rows = interpreted_rows("tests.engine.test_triton_kernels", str(tiny_checkpoints["llama"]))
    return {r["case"]: r for r in rows}


@pytest.mark.parametrize("case", [*STORE_CASES, *DECODE_CASES, "tiny_llama_model"])
def test_kernel_matches_torch_path_interpreted(interpreted: dict[str, dict], case: str) -> None:
    assert case in interpreted, f"the subprocess did not report {case}"
    assert interpreted[case]["ok"], interpreted[case]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernels_compiled_on_cuda(tiny_checkpoints) -> None:
    failed = [r for r in run_all("cuda", tiny_checkpoints["llama"]) if not r["ok"]]
    assert not failed, failed


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
    torch.set_num_threads(1)
    device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    for row in run_all(device, Path(sys.argv[1])):
        print(json.dumps(row), flush=True)
