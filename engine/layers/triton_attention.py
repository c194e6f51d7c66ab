"""Triton kernels for the paged KV cache, used on CUDA:

- `store_kvcache`: writes each new token's K and V to its slot (a negative slot is skipped);
- `paged_decode_attention`: one query token per sequence against its paged context, GQA aware: one
  program per (sequence, KV head) loads each K/V block once for all the query heads of its group and
  runs an online softmax over the blocks of the block table, honouring a sliding window.

Tests run both under `TRITON_INTERPRET=1` on CPU tensors against the torch path (`paged_attention.py`).
Shapes need not be powers of two: block size, head dim and group size are padded and masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kvstore.engine.attention_metadata import AttentionMetadata


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    key_stride,
    value_stride,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW
        k = tl.load(key_ptr + token * key_stride + offs, mask=mask)
        v = tl.load(value_ptr + token * value_stride + offs, mask=mask)
        tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
        tl.store(v_cache_ptr + slot * ROW + offs, v, mask=mask)


def store_kvcache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """key/value: [N, num_kv_heads, head_dim]; kv_cache: [2, num_blocks, block_size, num_kv_heads,
    head_dim] (contiguous); slot_mapping: [N] int64, negative = skip."""
    n, heads, dim = key.shape
    assert value.shape == key.shape and slot_mapping.shape == (n,), (
        key.shape,
        value.shape,
        slot_mapping.shape,
    )
    assert kv_cache.is_contiguous() and kv_cache.shape[3:] == (heads, dim), kv_cache.shape
    if n == 0:
        return
    # Cast on the host side: torch's rounding, identical on every backend (and a no-op when the
    # model and the cache share a dtype, the usual case).
    key = key.to(kv_cache.dtype).reshape(n, heads * dim)
    value = value.to(kv_cache.dtype).reshape(n, heads * dim)
    assert key.stride(1) == 1 and value.stride(1) == 1
    row = heads * dim
    _store_kvcache_kernel[(n,)](
        key,
        value,
        kv_cache[0],
        kv_cache[1],
        slot_mapping,
        key.stride(0),
        value.stride(0),
        ROW=row,
        BLOCK=triton.next_power_of_2(row),
    )


@triton.jit
def _paged_decode_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    scale,
    window,  # 0 = no sliding window
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,  # cache strides: block, token in block, head (dim stride is 1)
    stride_ct,
    stride_ch,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,  # next_power_of_2(BLOCK_SIZE)
    BLOCK_D: tl.constexpr,  # next_power_of_2(HEAD_DIM)
    BLOCK_G: tl.constexpr,  # next_power_of_2(GROUP)
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx = tl.load(context_lens_ptr + seq)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(
        q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)

    first = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)  # first position in the window
    num_blocks = tl.cdiv(ctx, BLOCK_SIZE)
    for blk in range(first // BLOCK_SIZE, num_blocks):
        block_id = tl.load(block_tables_ptr + seq * stride_bt + blk).to(tl.int64)
        pos = blk * BLOCK_SIZE + offs_n
        valid = (offs_n < BLOCK_SIZE) & (pos < ctx) & (pos >= first)
        kv_offs = block_id * stride_cb + offs_n[:, None] * stride_ct + kv_head * stride_ch + offs_d[None, :]
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=g_mask[:, None] & d_mask[None, :],
    )


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q: [B, num_heads, head_dim], one token per sequence (their K/V already stored); kv_cache:
    [2, num_blocks, block_size, num_kv_heads, head_dim]. Returns [B, num_heads, head_dim]."""
    assert meta.is_decode, "paged_decode_attention takes one query token per sequence"
    b, num_heads, head_dim = q.shape
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    assert cache_dim == head_dim and num_heads % num_kv_heads == 0 and b == meta.num_seqs
    assert k_cache.stride(-1) == 1 and q.stride(-1) == 1
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if b == 0:
        return out
    tables = meta.block_tables
    _paged_decode_kernel[(b, num_kv_heads)](
        out,
        q,
        k_cache,
        v_cache,
        tables,
        meta.context_lens,
        float(scale),
        int(sliding_window or 0),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        tables.stride(0),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        GROUP=group,
        BLOCK_N=triton.next_power_of_2(block_size),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_G=triton.next_power_of_2(group),
    )
    return out
