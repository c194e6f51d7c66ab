"""The torch paged-attention path against a naive per-token reference on random shapes: GQA, block
sizes, shuffled block tables with -1 padding, chunked prefill on a partial cache, mixed batches,
sliding windows, skipped (negative) slots, fp32 and bf16."""

from __future__ import annotations

import math

import pytest
import torch
from kvstore.engine.attention_metadata import AttentionMetadata
from kvstore.engine.errors import EngineError
from kvstore.engine.layers.attention import Attention
from kvstore.engine.layers.paged_attention import get_plan, paged_attention, store_kvcache

pytestmark = pytest.mark.usefixtures("single_thread")


def make_case(
    q_lens: list[int],
    ctx_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """Random full-sequence K/V per sequence, a shuffled paged cache holding the cached prefix, and
    the metadata of a step that adds each sequence's last q_len tokens."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(c / block_size) for c in ctx_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    width = max(blocks_per_seq) + 2
    tables = torch.full((len(q_lens), width), -1, dtype=torch.int32)
    seqs_k, seqs_v, qs, new_k, new_v, slots = [], [], [], [], [], []
    for i, (q_len, ctx) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        table = [perm.pop() for _ in range(blocks_per_seq[i])]
        tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        seq_slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(ctx)])
        flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
        flat[0, seq_slots[: ctx - q_len]] = k[: ctx - q_len]  # the cached prefix
        flat[1, seq_slots[: ctx - q_len]] = v[: ctx - q_len]
        seqs_k.append(k)
        seqs_v.append(v)
        qs.append(torch.randn(q_len, num_heads, head_dim, generator=gen).to(dtype))
        new_k.append(k[ctx - q_len :])
        new_v.append(v[ctx - q_len :])
        slots.append(seq_slots[ctx - q_len :])
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32),
        slot_mapping=torch.cat(slots).long(),
        block_tables=tables,
        max_q_len=max(q_lens),
        max_context_len=max(ctx_lens),
        block_size=block_size,
    )
    return kv_cache, torch.cat(qs), torch.cat(new_k), torch.cat(new_v), meta, (qs, seqs_k, seqs_v)


def naive_attention(qs, ks, vs, scale: float, window: int | None) -> torch.Tensor:
    """Token by token, head by head, in fp64."""
    out = []
    for q, k, v in zip(qs, ks, vs, strict=True):
        q_len, num_heads, _ = q.shape
        ctx, num_kv_heads, _ = k.shape
        group = num_heads // num_kv_heads
        o = torch.empty(q.shape, dtype=torch.float64)
        for t in range(q_len):
            pos = ctx - q_len + t
            lo = 0 if window is None else max(0, pos - window + 1)
            for h in range(num_heads):
                kh = k[lo : pos + 1, h // group].double()
                vh = v[lo : pos + 1, h // group].double()
                w = torch.softmax(kh @ q[t, h].double() * scale, dim=0)
                o[t, h] = w @ vh
        out.append(o)
    return torch.cat(out)


CASES = [
    # q_lens, ctx_lens, heads, kv_heads, head_dim, block_size
    ([7], [7], 4, 2, 16, 4),  # a single prefill
    ([5], [19], 4, 1, 32, 4),  # a chunk on a partial cache (MQA)
    ([1, 1, 1], [1, 9, 33], 9, 3, 64, 16),  # decode batch, SmolLM2's GQA ratio
    ([1, 6, 1, 13], [12, 6, 40, 20], 8, 2, 64, 4),  # mixed
    ([3, 1], [3, 50], 6, 6, 128, 16),  # MHA, head_dim 128
]


@pytest.mark.parametrize("pass_new_kv", [False, True], ids=["cache-only", "new-kv"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("case", CASES, ids=[str(c[:2]) for c in CASES])
def test_torch_path_matches_naive(case, window, pass_new_kv) -> None:
    q_lens, ctx, heads, kv_heads, dim, bs = case
    kv_cache, q, k, v, meta, (qs, ks, vs) = make_case(q_lens, ctx, heads, kv_heads, dim, bs)
    store_kvcache(k, v, kv_cache, meta.slot_mapping)
    scale = dim**-0.5
    extra = (k, v) if pass_new_kv else (None, None)
    out = paged_attention(q, kv_cache, meta, scale, window, *extra)
    torch.testing.assert_close(out.double(), naive_attention(qs, ks, vs, scale, window), atol=1e-5, rtol=1e-5)


def test_bf16_cache_and_queries() -> None:
    kv_cache, q, k, v, meta, (qs, ks, vs) = make_case(
        [1, 4, 1], [20, 9, 3], 8, 2, 64, 16, dtype=torch.bfloat16
    )
    store_kvcache(k, v, kv_cache, meta.slot_mapping)
    out = paged_attention(q, kv_cache, meta, 0.125)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), naive_attention(qs, ks, vs, 0.125, None), atol=2e-2, rtol=2e-2)


def test_store_writes_exact_slots_and_skips_negative() -> None:
    kv_cache = torch.zeros(2, 5, 4, 2, 8)
    k = torch.randn(4, 2, 8)
    v = torch.randn(4, 2, 8)
    slots = torch.tensor([17, -1, 3, 0])
    store_kvcache(k, v, kv_cache, slots)
    flat = kv_cache.view(2, 20, 2, 8)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[0, s], k[i]) and torch.equal(flat[1, s], v[i])
    written = {17, 3, 0}
    untouched = [s for s in range(20) if s not in written]
    assert flat[:, untouched].abs().sum() == 0  # the skipped token wrote nothing


def test_plan_is_built_once_per_step() -> None:
    kv_cache, q, k, v, meta, _ = make_case([1, 3], [10, 3], 4, 2, 16, 4)
    store_kvcache(k, v, kv_cache, meta.slot_mapping)
    plan = get_plan(meta)
    assert get_plan(meta) is plan
    a = paged_attention(q, kv_cache, meta, 0.25)
    b = paged_attention(q, kv_cache, meta, 0.25)  # a second "layer" reuses the plan and its buffers
    assert torch.equal(a, b) and get_plan(meta) is plan


def test_attention_layer_needs_a_cache() -> None:
    layer = Attention(num_heads=4, head_dim=16, scale=0.25, num_kv_heads=2)
    kv_cache, q, k, v, meta, (qs, ks, vs) = make_case([3], [3], 4, 2, 16, 4)
    with pytest.raises(EngineError, match="kv_cache"):
        layer(q.view(3, -1), k.view(3, -1), v.view(3, -1), meta)
    layer.kv_cache = kv_cache
    out = layer(q.view(3, -1), k.view(3, -1), v.view(3, -1), meta)
    torch.testing.assert_close(
        out.view(3, 4, 16).double(), naive_attention(qs, ks, vs, 0.25, None), atol=1e-5, rtol=0
    )
