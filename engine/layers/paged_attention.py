"""The torch path of paged attention: write new K/V to their slots, then attend over the paged cache.

Works on any device. No per-token Python loop: the decode rows of a step form one padded batch (their
blocks gathered with one `index_select`, one SDPA call, a key-padding mask) — or, with
`use_cpu_kernels`, one call of the C kernel that reads the blocks in place; each prefill chunk gets
one SDPA over its gathered blocks (plain causal when it starts at position 0 without a window, an
explicit mask otherwise). GQA never copies K/V (`enable_gqa` or a [kv_heads, group] view of q).

An fp8 (e4m3) cache holds `K / k_scale` per KV head (`quantize_kv`); every read multiplies back
(`dequantize_kv`). Attention always sees the cache's values: a prefill that attends to its own new
K/V rounds them through the cache dtype rather than using them at full precision, so a prompt whose
KV came from the cache (or the store) computes exactly what a fresh one does.

What depends only on the step (which rows decode, block ids, masks) is planned once per
`AttentionMetadata` and reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from kvstore.engine.attention_metadata import AttentionMetadata
from kvstore.engine.layers import cpu_ops

_PLAN_ATTR = "_torch_attention_plan"
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value; larger magnitudes saturate


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """x: [..., num_kv_heads, head_dim] -> the cache dtype (fp8: x / scale per head, saturated)."""
    if dtype != FP8:
        return x.to(dtype)
    assert scale is not None, "an fp8 KV cache needs its scales"
    return (x.float() / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache values [..., num_kv_heads, head_dim] -> `dtype` (fp8: times the scale per head)."""
    if x.dtype != FP8:
        return x.to(dtype)
    return (x.float() * scale[:, None]).to(dtype)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """key/value: [N, num_kv_heads, head_dim]; kv_cache: [2, num_blocks, block_size, num_kv_heads,
    head_dim]; a negative slot means "do not write" (e.g. a token whose KV is already cached)."""
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    k_flat = kv_cache[0].view(num_slots, *kv_cache.shape[3:])
    v_flat = kv_cache[1].view(num_slots, *kv_cache.shape[3:])
    slots = slot_mapping
    if slots.numel() and bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    k_new, v_new = quantize_kv(key, kv_cache.dtype, k_scale), quantize_kv(value, kv_cache.dtype, v_scale)
    if kv_cache.dtype == FP8:  # index_copy_ has no fp8 kernel: copy the bytes
        k_flat, v_flat, k_new, v_new = (t.view(torch.uint8) for t in (k_flat, v_flat, k_new, v_new))
    k_flat.index_copy_(0, slots, k_new)
    v_flat.index_copy_(0, slots, v_new)


@dataclass
class _Prefill:
    row: int  # first row of this sequence's tokens in q
    q_len: int
    context_len: int
    block_ids: torch.Tensor  # [num_blocks] long


@dataclass
class _Decode:
    rows: torch.Tensor | None  # [B] long, rows of q (None when every row decodes, in order)
    block_ids: torch.Tensor  # [B * blocks] long, padding mapped to block 0 and masked out
    num_blocks: int
    context_lens: torch.Tensor  # [B] long
    block_tables: torch.Tensor  # [B, blocks] int32, contiguous (the CPU kernel's table)
    context_lens_i32: torch.Tensor  # [B] int32


@dataclass
class AttentionPlan:
    decode: _Decode | None
    prefills: list[_Prefill]
    block_size: int
    meta: AttentionMetadata
    _masks: dict = field(default_factory=dict)
    _buffers: dict = field(default_factory=dict)
    _per_row: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def per_row(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block tables [N, blocks] int32, context lengths [N] int32) of every row of q: row r at
        position p of sequence i has sequence i's table and context p + 1, so the decode kernel gives
        each row causal attention over the cache (the step's K/V stored first)."""
        if self._per_row is None:
            meta = self.meta
            if meta.is_decode:  # one row per sequence: the step's own tables
                self._per_row = (meta.block_tables, meta.context_lens)
            else:
                cu, ctx = meta.cu_seqlens_q.tolist(), meta.context_lens.tolist()
                seq, lens = [], []
                for i, c in enumerate(ctx):
                    n = cu[i + 1] - cu[i]
                    seq += [i] * n
                    lens += range(c - n + 1, c + 1)
                dev = meta.block_tables.device
                tables = meta.block_tables.index_select(0, torch.tensor(seq, dtype=torch.long, device=dev))
                self._per_row = (tables.contiguous(), torch.tensor(lens, dtype=torch.int32, device=dev))
        return self._per_row

    def gather(self, cache: torch.Tensor, block_ids: torch.Tensor, which: str) -> torch.Tensor:
        """cache: [num_blocks, block_size, H, D] -> [len(block_ids) * block_size, H, D], copied into a
        buffer that every layer of the step reuses (a fresh allocation per layer costs more than the
        copy itself on a busy CPU)."""
        shape = (block_ids.shape[0], *cache.shape[1:])
        key = (which, shape, cache.dtype, cache.device)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(shape, dtype=cache.dtype, device=cache.device)
        torch.index_select(cache, 0, block_ids, out=buf)
        return buf.view(-1, *cache.shape[2:])

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[B, 1, 1, L] True where the key may be attended."""
        key = ("decode", window)
        if key not in self._masks:
            d = self.decode
            assert d is not None
            pos = torch.arange(d.num_blocks * self.block_size, device=d.context_lens.device)
            ctx = d.context_lens[:, None]
            mask = pos[None, :] < ctx
            if window is not None:
                mask &= pos[None, :] >= ctx - window
            self._masks[key] = mask[:, None, None, :]
        return self._masks[key]

    def prefill_mask(self, i: int, window: int | None, device: torch.device) -> torch.Tensor | None:
        """[q_len, context_len] causal (+ window) mask; None when plain `is_causal` is exact."""
        p = self.prefills[i]
        if window is None and p.q_len == p.context_len:
            return None
        key = ("prefill", i, window)
        if key not in self._masks:
            q_pos = torch.arange(p.context_len - p.q_len, p.context_len, device=device)[:, None]
            k_pos = torch.arange(p.context_len, device=device)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            self._masks[key] = mask
        return self._masks[key]


def build_plan(meta: AttentionMetadata) -> AttentionPlan:
    bs = meta.block_size
    cu = meta.cu_seqlens_q.tolist()
    ctx = meta.context_lens.tolist()
    q_lens = [cu[i + 1] - cu[i] for i in range(len(ctx))]
    tables = meta.block_tables
    decode_idx = [i for i, n in enumerate(q_lens) if n == 1]
    decode = None
    if decode_idx:
        num_blocks = (max(ctx[i] for i in decode_idx) + bs - 1) // bs
        all_rows = len(decode_idx) == len(ctx)
        idx = None if all_rows else torch.tensor(decode_idx, dtype=torch.long, device=tables.device)
        sub = tables if idx is None else tables.index_select(0, idx)
        block_ids = sub[:, :num_blocks].long().clamp(min=0).reshape(-1)
        rows = None if all_rows else torch.tensor([cu[i] for i in decode_idx], device=tables.device)
        lens = torch.tensor([ctx[i] for i in decode_idx], dtype=torch.long, device=tables.device)
        decode = _Decode(
            rows=rows, block_ids=block_ids, num_blocks=num_blocks, context_lens=lens,
            block_tables=sub[:, :num_blocks].contiguous(), context_lens_i32=lens.to(torch.int32),
        )  # fmt: skip
    prefills = []
    for i, n in enumerate(q_lens):
        if n > 1:
            nb = (ctx[i] + bs - 1) // bs
            prefills.append(_Prefill(row=cu[i], q_len=n, context_len=ctx[i], block_ids=tables[i, :nb].long()))
    return AttentionPlan(decode=decode, prefills=prefills, block_size=bs, meta=meta)


def get_plan(meta: AttentionMetadata) -> AttentionPlan:
    """The plan of this step, built by the first layer that asks and cached on the metadata."""
    plan = getattr(meta, _PLAN_ATTR, None)
    if plan is None:
        plan = build_plan(meta)
        setattr(meta, _PLAN_ATTR, plan)
    return plan


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    use_cpu_kernels: bool = False,
    every_row: bool = False,
) -> torch.Tensor:
    """q: [N, num_heads, head_dim] for the step's new tokens (their K/V already stored).
    Returns [N, num_heads, head_dim]. With the new tokens' `key`/`value` ([N, num_kv_heads,
    head_dim]) a prefill that starts at position 0 attends to them (rounded through the cache
    dtype) instead of gathering the same values back from the cache. `k_scale`/`v_scale`
    ([num_kv_heads] fp32) dequantise an fp8 cache. `use_cpu_kernels` runs the decode rows through
    `cpu_ops.paged_decode_attention` (fp32 q on CPU); with `every_row` the prefill rows too, each one
    on its own: a row's result then depends only on the cache up to its position, never on how the
    prompt was chunked or batched (the 16-bit CPU path, where that makes KV loaded from a store and KV
    recomputed bit-identical)."""
    plan = get_plan(meta)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if use_cpu_kernels and every_row:
        tables, lens = plan.per_row
        cpu_ops.paged_decode_attention(
            q, out, k_cache, v_cache, tables, lens, None, scale, sliding_window, k_scale, v_scale
        )
        return out

    d = plan.decode
    if d is not None and use_cpu_kernels:
        cpu_ops.paged_decode_attention(
            q, out, k_cache, v_cache, d.block_tables, d.context_lens_i32, d.rows, scale,
            sliding_window, k_scale, v_scale,
        )  # fmt: skip
    elif d is not None:
        b = d.context_lens.shape[0]
        qd = q if d.rows is None else q.index_select(0, d.rows)
        qd = qd.view(b, num_kv_heads, group, head_dim)  # the group acts as the query length
        k = plan.gather(k_cache, d.block_ids, "k")
        v = plan.gather(v_cache, d.block_ids, "v")
        k = dequantize_kv(k, q.dtype, k_scale).view(b, -1, num_kv_heads, head_dim).transpose(1, 2)
        v = dequantize_kv(v, q.dtype, v_scale).view(b, -1, num_kv_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=plan.decode_mask(sliding_window), scale=scale)
        o = o.reshape(b, num_heads, head_dim)
        if d.rows is None:
            out.copy_(o)
        else:
            out.index_copy_(0, d.rows, o)

    cache_dtype = k_cache.dtype
    for i, p in enumerate(plan.prefills):
        qp = q[p.row : p.row + p.q_len].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        if key is not None and value is not None and p.q_len == p.context_len:
            k = key[p.row : p.row + p.q_len]
            v = value[p.row : p.row + p.q_len]
            if cache_dtype != q.dtype:  # what the cache holds, not the full-precision values
                k = dequantize_kv(quantize_kv(k, cache_dtype, k_scale), q.dtype, k_scale)
                v = dequantize_kv(quantize_kv(v, cache_dtype, v_scale), q.dtype, v_scale)
        else:
            k = dequantize_kv(plan.gather(k_cache, p.block_ids, f"k{i}")[: p.context_len], q.dtype, k_scale)
            v = dequantize_kv(plan.gather(v_cache, p.block_ids, f"v{i}")[: p.context_len], q.dtype, v_scale)
        k = k.transpose(0, 1).unsqueeze(0)
        v = v.transpose(0, 1).unsqueeze(0)
        mask = plan.prefill_mask(i, sliding_window, q.device)
        o = F.scaled_dot_product_attention(
            qp, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=group > 1
        )
        out[p.row : p.row + p.q_len] = o[0].transpose(0, 1)
    return out
