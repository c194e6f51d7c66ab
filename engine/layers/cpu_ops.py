"""The ctypes wrappers of the engine's CPU kernels (`cpu_kernels.c`, built and loaded by `cpu_lib`):
GEMM on packed 16-bit weights, paged decode attention, the KV store, RMSNorm, RoPE, SiLU-and-mul.

Every wrapper takes fp32 activations contiguous in their last dimension (asserted). Calls release the
GIL, so with more than one torch thread a call's rows are split over a small thread pool. Call them
only where `cpu_lib.available()`.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import torch
from kvstore.engine.layers.cpu_lib import KV_TYPES, W_TYPES, check_rows, check_scales, lib, ptr_of

PANEL = 32  # output columns per packed weight panel (NR in the C source)
GEMM_KINDS = ("avx512", "avx512_bf16", "amx")  # gemm_kind(): how bf16 GEMMs with K % 32 == 0 run


@functools.cache
def _pool(n: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(n, thread_name_prefix="cpu-kernel")


def _split(fn, total: int, *args) -> None:
    """fn(*args, begin, end) over [0, total), split over torch's intra-op thread count."""
    n = min(torch.get_num_threads(), total)
    if n <= 1:
        fn(*args, 0, total)
        return
    bounds = [total * i // n for i in range(n + 1)]
    futures = [_pool(n).submit(fn, *args, bounds[i], bounds[i + 1]) for i in range(n)]
    for f in futures:
        f.result()


# ---- GEMM ------------------------------------------------------------------------------------------
# bf16 panels hold their columns as c0, c16, c1, c17, ... (the kernel splits one load into two halves)
_BF16_ORDER = torch.stack([torch.arange(PANEL // 2), torch.arange(PANEL // 2, PANEL)], 1).reshape(-1)


def gemm_kind() -> str:
    """How bf16 GEMMs with K % 32 == 0 run in this process: "amx" (tile units), "avx512_bf16" (dot
    products), both on activations rounded to bf16, or "avx512" (fp32 activations, weights widened)."""
    kernels = lib()
    return GEMM_KINDS[kernels.gemm_kind() if kernels is not None else 0]


def attention_on_tiles(
    kv_dtype: torch.dtype, num_kv_heads: int, group: int, head_dim: int, block_size: int, window: int | None
) -> bool:
    """Whether `paged_decode_attention` runs on the AMX tile units for this cache and layer (bf16 or
    fp8 cache, head_dim % 32 == 0, at most 16 query heads per KV head and 64 KV heads, block_size % 16
    == 0, no sliding window): q * scale (with an fp8 cache q * scale * k_scale * 2^8) and the softmax
    numerators are rounded to bf16 there."""
    kernels = lib()
    return (
        kernels is not None
        and kv_dtype in KV_TYPES
        and bool(
            kernels.attention_on_tiles(
                KV_TYPES[kv_dtype], num_kv_heads, group, head_dim, block_size, int(window or 0)
            )
        )
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16/fp16 -> [ceil(N/32), K, 32] (zero-padded panels of 32 output columns; bf16 ones
    interleaved, or for AMX and AVX-512 BF16 as [K/2, 32, 2] k-pairs: see cpu_kernels.c)."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=weight.dtype)
    padded[:n] = weight
    if lib().gemm_layout(W_TYPES[weight.dtype], k):
        return padded.view(panels, PANEL, k // 2, 2).transpose(1, 2).reshape(panels, k, PANEL).contiguous()
    packed = padded.view(panels, PANEL, k).transpose(1, 2)
    if weight.dtype == torch.bfloat16:
        packed = packed[:, :, _BF16_ORDER]
    return packed.contiguous()


def gemm_w16(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 @ W.T (+ bias fp32 [N]) -> [M, N] fp32, W packed by `pack_weight`."""
    check_rows(x)
    m, k = x.shape
    assert packed.shape[1] == k and packed.dtype in (torch.bfloat16, torch.float16), packed.shape
    assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        _split(lib().gemm_w16, packed.shape[0], x.data_ptr(), x.stride(0), packed.data_ptr(), W_TYPES[packed.dtype],
               ptr_of(bias), y.data_ptr(), n, m, n, k)  # fmt: skip
    return y


# ---- attention -------------------------------------------------------------------------------------
def paged_decode_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    rows: torch.Tensor | None,
    scale: float,
    window: int | None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Decode rows of q [N, Hq, D] (`rows[b]` for sequence b, or row b) attend to their paged KV;
    results go to the same rows of `out`. Caches: [num_blocks, block_size, Hkv, D], any KV dtype of
    KV_TYPES; fp8 values are multiplied by `k_scale`/`v_scale` [Hkv] (fp32)."""
    n, hq, d = q.shape
    _, bs, hkv, dk = k_cache.shape
    assert (
        q.dtype == out.dtype == torch.float32
        and q.stride(2) == 1
        and q.stride(1) == d
        and out.is_contiguous()
    )
    assert dk == d and d % 16 == 0 and d <= 256 and hq % hkv == 0 and hq // hkv <= 16, (
        q.shape,
        k_cache.shape,
    )
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and k_cache.dtype == v_cache.dtype
    assert block_tables.dtype == context_lens.dtype == torch.int32 and block_tables.stride(1) == 1
    assert rows is None or (rows.dtype == torch.int64 and rows.is_contiguous())
    check_scales(hkv, None, k_scale, v_scale)
    b = context_lens.shape[0]
    sb, st, sh, _ = k_cache.stride()
    _split(lib().paged_decode_attention, b, q.data_ptr(), q.stride(0), out.data_ptr(), hq * d, k_cache.data_ptr(),
           v_cache.data_ptr(), KV_TYPES[k_cache.dtype], sb, st, sh, ptr_of(k_scale), ptr_of(v_scale),
           block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(), ptr_of(rows), scale,
           int(window or 0), hq, hkv, d, bs)  # fmt: skip


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """key/value [N, Hkv*D] fp32 rows into caches [num_blocks, block_size, Hkv, D] (fp32/bf16/fp16,
    rounded to nearest even; fp8 e4m3: x / scale per KV head [Hkv], saturated at +-448, as
    `paged_attention.quantize_kv`); a negative slot is skipped."""
    check_rows(key)
    check_rows(value)
    nb, bs, hkv, d = k_cache.shape
    assert k_cache.dtype in KV_TYPES and k_cache.dtype == v_cache.dtype
    check_scales(hkv, k_cache.dtype == torch.float8_e4m3fn, k_scale, v_scale)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(2) == d and k_cache.stride(3) == 1
    assert key.shape == value.shape and key.shape[1] == hkv * d and slots.dtype == torch.int64
    assert slots.is_contiguous() and slots.shape[0] == key.shape[0]
    sb, st = k_cache.stride(0), k_cache.stride(1)
    lib().store_kv(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), k_cache.data_ptr(),
                    v_cache.data_ptr(), KV_TYPES[k_cache.dtype], sb, st, slots.data_ptr(), bs, hkv * d,
                    ptr_of(k_scale), ptr_of(v_scale), d, 0, key.shape[0])  # fmt: skip


# ---- elementwise -----------------------------------------------------------------------------------
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """weight * norm(x), or with `residual` (updated in place to x + residual) weight * norm(x + residual)."""
    check_rows(x)
    if residual is not None:
        check_rows(residual)
        assert residual.shape == x.shape
    assert weight.is_contiguous() and weight.dtype in W_TYPES and weight.shape == (x.shape[1],)
    out = torch.empty_like(x)
    _split(lib().rms_norm, x.shape[0], x.data_ptr(), x.stride(0), ptr_of(residual),
           residual.stride(0) if residual is not None else 0, weight.data_ptr(), W_TYPES[weight.dtype], eps,
           out.data_ptr(), out.stride(0), x.shape[1])  # fmt: skip
    return out


def rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
    num_kv_heads: int,
) -> None:  # fmt: skip
    """In place on q [N, Hq*D] and k [N, Hk*D] (rows may be strided views of one qkv tensor)."""
    check_rows(q)
    check_rows(k)
    d = cos_sin.shape[1]
    assert cos_sin.dtype == torch.float32 and cos_sin.is_contiguous() and d % 2 == 0
    assert positions.dtype == torch.int64 and positions.is_contiguous() and positions.shape[0] == q.shape[0]
    assert q.shape[1] == num_heads * d and k.shape[1] == num_kv_heads * d
    _split(lib().rope, q.shape[0], q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), positions.data_ptr(),
           cos_sin.data_ptr(), num_heads, num_kv_heads, d)  # fmt: skip


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[N, 2I] -> silu(x[:, :I]) * x[:, I:]"""
    check_rows(x)
    i = x.shape[1] // 2
    out = torch.empty(x.shape[0], i, dtype=torch.float32)
    _split(lib().silu_and_mul, x.shape[0], x.data_ptr(), x.stride(0), out.data_ptr(), i, i)
    return out
