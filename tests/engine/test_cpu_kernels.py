"""The C kernels (engine/layers/cpu_kernels.c) against torch references on odd shapes: GEMM with
16-bit weights (ragged panels, every row-tile size, bias), paged decode attention over every KV dtype
(fp8 with per-head scales, sliding windows, GQA, decode rows inside a mixed batch), the KV store's
rounding, RMSNorm with the fused residual, RoPE and SiLU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from kvstore.engine.layers import cpu_lib, cpu_ops

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.skipif(not cpu_lib.available(), reason="no AVX-512F CPU or no C compiler"),
]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bf16_gemm(wdtype, k: int) -> bool:
    """Whether this GEMM rounds x to bf16 first here (AMX tile units or AVX-512 BF16 dot products)."""
    return cpu_ops.gemm_kind() != "avx512" and wdtype == torch.bfloat16 and k % 32 == 0


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("m", "k", "n"),
    [(1, 64, 32), (3, 40, 70), (8, 576, 96), (13, 33, 17), (21, 128, 300), (300, 96, 40)],
)
def test_gemm_w16_matches_fp32_matmul_of_the_same_weights(wdtype, m: int, k: int, n: int) -> None:
    g = _gen(m * k + n)
    w = torch.randn(n, k, generator=g).to(wdtype)
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g)
    packed = cpu_ops.pack_weight(w)
    assert packed.shape == (-(-n // 32), k, 32)
    # the AMX and AVX-512 BF16 paths multiply bf16-rounded activations (exactly, accumulating in fp32)
    rounded = (lambda t: t.bfloat16().double()) if _bf16_gemm(wdtype, k) else (lambda t: t.double())
    ref = rounded(x) @ w.double().T
    torch.testing.assert_close(cpu_ops.gemm_w16(x, packed, n).double(), ref, atol=1e-4 * k**0.5, rtol=1e-5)
    with_bias = cpu_ops.gemm_w16(x, packed, n, bias)
    torch.testing.assert_close(with_bias.double(), ref + bias.double(), atol=1e-4 * k**0.5, rtol=1e-5)
    strided = torch.randn(m, k + 7, generator=g)[:, 3 : 3 + k]  # rows with a stride != K
    torch.testing.assert_close(
        cpu_ops.gemm_w16(strided, packed, n).double(), rounded(strided) @ w.double().T, atol=1e-3, rtol=1e-5
    )


@pytest.mark.parametrize("k", [64, 576, 40])
def test_gemm_w16_rows_do_not_depend_on_their_neighbours(k: int) -> None:
    """A row's result is the same bits alone, inside a decode batch, or deep in a 300-row prefill
    chunk (what chunked prefill and store reuse rely on), on the AMX path and the AVX-512 one."""
    g = _gen(k)
    w = torch.randn(70, k, generator=g).bfloat16()
    x = torch.randn(300, k, generator=g)
    packed = cpu_ops.pack_weight(w)
    full = cpu_ops.gemm_w16(x, packed, 70)
    for lo, hi in [(0, 1), (17, 18), (299, 300), (5, 9), (16, 48), (250, 290)]:
        assert torch.equal(cpu_ops.gemm_w16(x[lo:hi].contiguous(), packed, 70), full[lo:hi]), (lo, hi)


def _fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Quantise [..., H, D] with a scale per head the way the engine's cache does."""
    return (x / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)


def _dequant(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    out = cache.to(torch.float64)
    return out if scale is None else out * scale.double()[:, None]


def _reference(q, k_cache, v_cache, tables, ctx, rows, scale, window, k_scale, v_scale, tiles=False):
    """Per sequence, gather its blocks and run softmax attention in fp64 on the dequantised cache; with
    `tiles`, rounded as the AMX kernel rounds: q * scale (fp8: q * scale * k_scale * 2^8, which meets
    the cache's e4m3 values x 2^-8) and the softmax numerators to bf16 (the denominator stays the sum
    of the unrounded ones)."""
    bs = k_cache.shape[1]
    hq, hkv = q.shape[1], k_cache.shape[2]
    out = {}
    for b, c in enumerate(ctx.tolist()):
        pos = torch.arange(c)
        slots = tables[b, pos // bs].long() * bs + pos % bs
        k = _dequant(k_cache.flatten(0, 1)[slots], k_scale)  # [c, Hkv, D]
        v = _dequant(v_cache.flatten(0, 1)[slots], v_scale)
        lo = max(0, c - window) if window else 0
        k, v = k[lo:], v[lo:]
        row = int(rows[b]) if rows is not None else b
        qq = q[row].double().view(hkv, hq // hkv, -1)
        if tiles:
            # the factor q meets in the kernel, so that bf16 rounds the same value
            f = scale if k_scale is None else (k_scale.double() * 256 * scale)[:, None, None]
            qs = (qq * f).float().bfloat16().double() * (scale / f)
            s = torch.einsum("hgd,thd->hgt", qs, k)
            e = (s - s.amax(-1, keepdim=True)).exp()
            o = torch.einsum("hgt,thd->hgd", e.float().bfloat16().double(), v) / e.sum(-1, keepdim=True)
        else:
            s = torch.einsum("hgd,thd->hgt", qq, k) * scale
            o = torch.einsum("hgt,thd->hgd", s.softmax(-1), v)
        out[row] = o.reshape(hq, -1)
    return out


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "bs", "window"),
    [
        (9, 3, 64, 16, None),
        (4, 4, 32, 4, 5),
        (8, 2, 16, 8, None),
        (6, 2, 128, 16, 20),
        (3, 1, 48, 16, None),
        (6, 2, 128, 32, None),
        (4, 4, 32, 16, None),
        (16, 1, 64, 16, None),
    ],  # fmt: skip
)
def test_paged_decode_attention_matches_a_dequantised_reference(kv_dtype, hq, hkv, d, bs, window) -> None:
    g = _gen(hq * d + bs)
    ctx = torch.tensor([1, 17, 33, 5, 64], dtype=torch.int32)
    width = -(-64 // bs)
    nb = len(ctx) * width + 3
    k_scale = v_scale = None
    k_full = torch.randn(nb, bs, hkv, d, generator=g) * 3
    v_full = torch.randn(nb, bs, hkv, d, generator=g)
    if kv_dtype == torch.float8_e4m3fn:
        k_scale = torch.rand(hkv, generator=g) * 0.05 + 0.005
        v_scale = torch.rand(hkv, generator=g) * 0.01 + 0.002
        k_cache, v_cache = _fp8(k_full, k_scale), _fp8(v_full, v_scale)
        for c in (k_cache, v_cache):  # every other block: any e4m3 code but NaN, subnormals included
            codes = torch.randint(0, 254, c[::2].shape, generator=g, dtype=torch.uint8)
            c.view(torch.uint8)[::2] = codes + (codes >= 0x7F).to(torch.uint8)  # skip 0x7F (NaN)
    else:
        k_cache, v_cache = k_full.to(kv_dtype), v_full.to(kv_dtype)
    perm = torch.randperm(nb, generator=g)
    tables = perm[: len(ctx) * width].view(len(ctx), width).to(torch.int32).contiguous()
    n = 9  # a mixed batch: decode rows scattered among other rows
    rows = torch.tensor([7, 0, 3, 8, 5], dtype=torch.int64)
    q = torch.randn(n, hq, d, generator=g)
    out = torch.full_like(q, 12345.0)
    scale = d**-0.5
    cpu_ops.paged_decode_attention(
        q, out, k_cache, v_cache, tables, ctx, rows, scale, window, k_scale, v_scale
    )
    tiles = cpu_ops.attention_on_tiles(kv_dtype, hkv, hq // hkv, d, bs, window)
    ref = _reference(q, k_cache, v_cache, tables, ctx, rows, scale, window, k_scale, v_scale, tiles)
    for row, expected in ref.items():
        # on tiles a numerator that lands next to a bf16 rounding boundary may round the other way
        torch.testing.assert_close(out[row].double(), expected, atol=2e-4 if tiles else 2e-5, rtol=1e-5)
    untouched = [r for r in range(n) if r not in ref]
    assert (out[untouched] == 12345.0).all()  # only the decode rows are written


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_kv_rounds_like_torch_and_skips_negative_slots(kv_dtype) -> None:
    g = _gen(1)
    k_cache = torch.zeros(6, 4, 3, 16, dtype=kv_dtype)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(5, 48, generator=g) * 100
    key[0, :3] = torch.tensor([float("nan"), float("inf"), -0.0])
    value = torch.randn(5, 48, generator=g)
    slots = torch.tensor([3, 22, -1, 0, 9])
    cpu_ops.store_kv(key, value, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, 48), v_cache.view(-1, 48)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        torch.testing.assert_close(flat_k[s], key[i].to(kv_dtype), equal_nan=True, atol=0, rtol=0)
        torch.testing.assert_close(flat_v[s], value[i].to(kv_dtype), atol=0, rtol=0)
    written = {s for s in slots.tolist() if s >= 0}
    assert all((flat_k[s] == 0).all() for s in range(flat_k.shape[0]) if s not in written)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_and_without_the_residual(wdtype) -> None:
    g = _gen(2)
    x = torch.randn(7, 72, generator=g) * 4
    res = torch.randn(7, 72, generator=g)
    w = (torch.randn(72, generator=g) * 0.1 + 1).to(wdtype)
    ref = w.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-5), ref, atol=1e-5, rtol=1e-5)
    total = x + res
    out = cpu_ops.rms_norm(x, w, 1e-5, residual=res)
    torch.testing.assert_close(res, total, atol=0, rtol=0)  # the residual now holds x + residual
    ref = w.float() * (total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_rope_on_strided_q_and_k_views_matches_rotate_half() -> None:
    from kvstore.engine.layers.rotary_embedding import RotaryEmbedding, apply_rotary_emb

    g = _gen(3)
    hq, hk, d = 3, 1, 32
    rope = RotaryEmbedding(d, 64, 10000.0)
    qkv = torch.randn(6, (hq + 2 * hk) * d, generator=g)
    positions = torch.tensor([0, 5, 63, 2, 2, 17])
    q, k = qkv[:, : hq * d], qkv[:, hq * d : (hq + hk) * d]
    step = rope(positions)
    ref_q, ref_k = apply_rotary_emb(q.reshape(6, hq, d), k.reshape(6, hk, d), step.cos, step.sin)
    v_before = qkv[:, (hq + hk) * d :].clone()
    cpu_ops.rope(q, k, positions, rope.cos_sin, hq, hk)
    torch.testing.assert_close(q.reshape(6, hq, d), ref_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k.reshape(6, hk, d), ref_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, (hq + hk) * d :], v_before)


def test_silu_and_mul() -> None:
    x = torch.randn(5, 2 * 40, generator=_gen(4)) * 6
    x[0, 0], x[0, 1] = -200.0, 200.0
    ref = F.silu(x[:, :40]) * x[:, 40:]
    torch.testing.assert_close(cpu_ops.silu_and_mul(x), ref, atol=1e-5, rtol=1e-5)


def test_threads_split_the_work_without_changing_results() -> None:
    g = _gen(5)
    w = torch.randn(200, 64, generator=g).bfloat16()
    x = torch.randn(9, 64, generator=g)
    packed = cpu_ops.pack_weight(w)
    one = cpu_ops.gemm_w16(x, packed, 200)
    torch.set_num_threads(2)
    try:
        two = cpu_ops.gemm_w16(x, packed, 200)
    finally:
        torch.set_num_threads(1)
    assert torch.equal(one, two)


def _flags() -> list[str]:
    return cpu_lib.cpu_flags().split()


def test_each_gemm_kind_is_chosen_by_cpu_and_environment_in_a_fresh_process() -> None:
    """KVSTORE_AMX=0 turns the tile units off, KVSTORE_AVX512_BF16=0 the dot products (decided once per
    process, since it sets the packing). With both off, bf16 weights with K % 32 == 0 take the AVX-512
    kernel, exact on fp32 activations; otherwise the best the CPU has, on activations rounded to bf16."""
    script = (
        "import torch; from kvstore.engine.layers import cpu_ops; g = torch.Generator().manual_seed(0);"
        "w = torch.randn(40, 64, generator=g).bfloat16(); x = torch.randn(5, 64, generator=g);"
        "y = cpu_ops.gemm_w16(x, cpu_ops.pack_weight(w), 40).double();"
        "exact = (y - x.double() @ w.double().T).abs().max().item() < 1e-4;"
        "rounded = (y - x.bfloat16().double() @ w.double().T).abs().max().item() < 1e-4;"
        "print(cpu_ops.gemm_kind(), exact, rounded)"
    )
    run = {}
    for amx, dot in (("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")):
        env = {**os.environ, "KVSTORE_AMX": amx, "KVSTORE_AVX512_BF16": dot}
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr[-2000:]
        run[amx, dot] = out.stdout.split()
    exact, dots, tiles = (
        ["avx512", "True", "False"],
        ["avx512_bf16", "False", "True"],
        ["amx", "False", "True"],
    )
    has_dot, has_amx = "avx512_bf16" in _flags(), "amx_bf16" in _flags()
    assert run["0", "0"] == exact
    assert run["0", "1"] == (dots if has_dot else exact)
    assert run["1", "0"] == (tiles if has_amx else exact)
    assert run["1", "1"] == (tiles if has_amx else dots if has_dot else exact)
    assert cpu_ops.gemm_kind() == run["1", "1"][0]  # this process: the defaults


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (4, 1, 32), (2, 2, 128)])
def test_prompt_rows_attended_together_equal_each_row_alone(kv_dtype, hq: int, hkv: int, d: int) -> None:
    """A prompt's rows share tiles (the AMX path groups up to 16 / G of them); each row's bits must be
    what it gets alone, as a decode row, or in another chunking: what store reuse relies on."""
    g = _gen(hq + d)
    bs, length, start = 16, 150, 90
    nb = -(-length // bs) + 2
    k_cache = torch.randn(nb, bs, hkv, d, generator=g)
    v_cache = torch.randn(nb, bs, hkv, d, generator=g)
    scales = (None, None)
    if kv_dtype == torch.float8_e4m3fn:
        scales = (torch.rand(hkv, generator=g) * 0.05 + 0.005, torch.rand(hkv, generator=g) * 0.01 + 0.002)
        k_cache, v_cache = _fp8(k_cache, scales[0]), _fp8(v_cache, scales[1])
    else:
        k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    table = torch.randperm(nb, generator=g)[: -(-length // bs)].to(torch.int32)
    n = length - start  # rows at positions start .. length - 1, as AttentionPlan.per_row lays them out
    tables = table.expand(n, -1).contiguous()
    lens = torch.arange(start + 1, length + 1, dtype=torch.int32)
    q = torch.randn(n, hq, d, generator=g)
    together = torch.empty_like(q)
    cpu_ops.paged_decode_attention(q, together, k_cache, v_cache, tables, lens, None, d**-0.5, None, *scales)
    for lo, hi in [(0, 1), (7, 8), (59, 60), (3, 17), (30, 60)]:
        part = torch.empty(hi - lo, hq, d)
        cpu_ops.paged_decode_attention(
            q[lo:hi].contiguous(), part, k_cache, v_cache, tables[lo:hi].contiguous(), lens[lo:hi].contiguous(),
            None, d**-0.5, None, *scales,
        )  # fmt: skip
        assert torch.equal(part, together[lo:hi]), (lo, hi)
