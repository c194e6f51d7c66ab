"""Triton kernels for the fp8 and int4 codecs: compiled on CUDA, interpreted on CPU in tests
(`TRITON_INTERPRET=1` must be set before this module is imported).

They do the same float32 operations in the same order as the numba kernels (cpu_fp8.py,
cpu_int4.py) and write the same payload layout (fp8.py, int4.py), so a blob encoded on a GPU decodes
on a CPU and back. Conversions to e4m3 and back are done on the bits, so they need no fp8 hardware.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from kvstore.codecs.common import hadamard
from kvstore.codecs.int4_layout import Int4Layout, row_jobs

_BLOCK_R = 16  # rows per program (tl.dot in the rotation needs >= 16)
_BLOCK_C = 64  # key channels per program in per-channel groups
# no mul+add -> fma contraction: the numba kernels round after every float32 operation
_EXACT = {"enable_fp_fusion": False}


@triton.jit
def _to_e4m3(y):
    """float32 (|y| <= 448) -> e4m3fn bits, round to nearest even (same trick as cpu_bits)."""
    w = y.to(tl.int32, bitcast=True)
    sign = (w >> 24) & 0x80
    w = w & 0x7FFFFFFF
    sub = ((w.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)) & 0xFF
    nor = ((w + ((7 - 127) << 23) + 0x7FFFF + ((w >> 20) & 1)) >> 20) & 0xFF
    return tl.where(w < (121 << 23), sub, nor) | sign


@triton.jit
def _from_e4m3(c):
    c = c.to(tl.int32)
    e = (c >> 3) & 0xF
    m = c & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    return tl.where((c & 0x80) != 0, -v, v)


@triton.jit
def _out(x, BF16: tl.constexpr):
    """float32 -> what the output pointer holds: bfloat16 bits (int16) rounded to nearest even by hand,
    since the interpreter truncates, or the value itself (the store casts, nearest even). One return:
    compiled (not interpreted) Triton refuses two of different types, constexpr branch or not."""
    if BF16:
        w = x.to(tl.int32, bitcast=True)
        x = ((w + 0x7FFF + ((w >> 16) & 1)) >> 16).to(tl.int16)
    return x


def _out_view(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    return (t.view(torch.int16), True) if t.dtype == torch.bfloat16 else (t, False)


@triton.jit
def _fp8_encode(x_ptr, codes_ptr, scales_ptr, R, D, PER_ROW: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_D: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < R) & (cols[None, :] < D)
    offs = rows[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if PER_ROW:
        bad = tl.max(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32), axis=1)
        s = tl.where(bad > 0, float("nan"), tl.math.div_rn(tl.max(tl.abs(x), axis=1), 448.0))
        tl.store(scales_ptr + rows, s, mask=rows < R)
    else:
        s = tl.zeros((BLOCK_R,), tl.float32) + tl.load(scales_ptr)
    inv = tl.where(s > 0, tl.math.div_rn(1.0, tl.where(s > 0, s, 1.0)), 0.0)
    y = tl.minimum(tl.maximum(x * inv[:, None], -448.0), 448.0)
    tl.store(codes_ptr + offs, _to_e4m3(y).to(tl.uint8), mask=mask)


@triton.jit
def _fp8_decode(codes_ptr, scales_ptr, out_ptr, R, D, PER_ROW: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_D: tl.constexpr, BF16: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < R) & (cols[None, :] < D)
    offs = rows[:, None] * D + cols[None, :]
    if PER_ROW:
        s = tl.load(scales_ptr + rows, mask=rows < R, other=0.0)
    else:
        s = tl.zeros((BLOCK_R,), tl.float32) + tl.load(scales_ptr)
    v = _from_e4m3(tl.load(codes_ptr + offs, mask=mask, other=0)) * s[:, None]
    tl.store(out_ptr + offs, _out(v, BF16).to(out_ptr.dtype.element_ty), mask=mask)


def fp8_encode(kv: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """kv [2, L, T, H, D] on the device -> (codes uint8 [2, L*T*H, D], scales float32)."""
    d = kv.shape[-1]
    x = kv.contiguous().view(2, -1, d)
    r = x.shape[1]
    codes = torch.empty(x.shape, dtype=torch.uint8, device=kv.device)
    scales = torch.empty((2, r) if mode == "token" else (2, 1), dtype=torch.float32, device=kv.device)
    grid = (triton.cdiv(r, _BLOCK_R),)
    for half in range(2):
        if mode == "tensor":
            xf = x[half].float()
            amax = xf.abs().amax()
            scales[half] = torch.where(torch.isfinite(xf).all(), amax / 448.0, float("nan"))
        _fp8_encode[grid](x[half], codes[half], scales[half], r, d, mode == "token", _BLOCK_R,
                          triton.next_power_of_2(d), **_EXACT)  # fmt: skip
    return codes, scales.view(-1)


def fp8_decode(
    codes: torch.Tensor, scales: torch.Tensor, mode: str, shape: tuple, dtype: torch.dtype
) -> torch.Tensor:
    d = shape[-1]
    out = torch.empty(shape, dtype=dtype, device=codes.device)
    ov, bf16 = _out_view(out)
    o, c, r = ov.view(2, -1, d), codes.view(2, -1, d), out[0].numel() // d
    sc = scales.view(2, -1)
    for half in range(2):
        _fp8_decode[(triton.cdiv(r, _BLOCK_R),)](c[half], sc[half], o[half], r, d, mode == "token", _BLOCK_R,
                                                 triton.next_power_of_2(d), bf16, **_EXACT)  # fmt: skip
    return out


@triton.jit
def _int4_params(mn, mx, bad):
    """fp16 scale and zero of a group with range [mn, mx] (NaN scale when bad), plus zero and 1/scale in fp32."""
    s16 = tl.where(bad, float("nan"), tl.math.div_rn(mx - mn, 15.0)).to(tl.float16)
    z16 = tl.where(bad, float("nan"), mn).to(tl.float16)
    s = s16.to(tl.float32)
    inv = tl.where(s > 0, tl.math.div_rn(1.0, tl.where(s > 0, s, 1.0)), 0.0)
    return s16, z16, z16.to(tl.float32), inv


@triton.jit
def _int4_encode_rows(x_ptr, h_ptr, codes_ptr, sz_ptr, NB, sxa, sxb, sca, scb, ssa, ssb,
                      D: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, ROTATE: tl.constexpr,
                      BLOCK_R: tl.constexpr):  # fmt: skip
    """Per-token groups of G along head_dim for rows b of slab a: x (A, B, D) -> codes, scale/zero."""
    a = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < NB
    cols = tl.arange(0, D)
    x = tl.load(x_ptr + a * sxa + rows[:, None] * sxb + cols[None, :], mask=rmask[:, None], other=0.0)
    x = x.to(tl.float32)
    if ROTATE:
        h = tl.load(h_ptr + cols[:, None] * D + cols[None, :])
        x = tl.dot(x, h, input_precision="ieee")
    xg = tl.reshape(x, (BLOCK_R, NG, G))
    bad = tl.max(((xg != xg) | (tl.abs(xg) == float("inf"))).to(tl.int32), axis=2) > 0
    s16, z16, z, inv = _int4_params(tl.min(xg, axis=2), tl.max(xg, axis=2), bad)
    q = tl.floor((xg - z[:, :, None]) * inv[:, :, None] + 0.5)
    q = tl.minimum(tl.maximum(q, 0.0), 15.0).to(tl.int32)
    lo, hi = tl.split(tl.reshape(q, (BLOCK_R, D // 2, 2)))
    byte = (lo | (hi << 4)).to(tl.uint8)
    half_cols = tl.arange(0, D // 2)
    tl.store(codes_ptr + a * sca + rows[:, None] * scb + half_cols[None, :], byte, mask=rmask[:, None])
    g = tl.arange(0, NG)
    so = sz_ptr + a * ssa + rows[:, None] * ssb + g[None, :] * 2
    tl.store(so, s16.to(tl.int16, bitcast=True), mask=rmask[:, None])
    tl.store(so + 1, z16.to(tl.int16, bitcast=True), mask=rmask[:, None])


@triton.jit
def _int4_decode_rows(codes_ptr, sz_ptr, h_ptr, out_ptr, NB, sca, scb, ssa, ssb, soa, sob,
                      D: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, ROTATE: tl.constexpr,
                      BLOCK_R: tl.constexpr, BF16: tl.constexpr):  # fmt: skip
    a = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < NB
    half_cols = tl.arange(0, D // 2)
    byte = tl.load(
        codes_ptr + a * sca + rows[:, None] * scb + half_cols[None, :], mask=rmask[:, None], other=0
    )
    byte = byte.to(tl.int32)
    q = tl.reshape(tl.join(byte & 15, byte >> 4), (BLOCK_R, NG, G)).to(tl.float32)
    g = tl.arange(0, NG)
    so = sz_ptr + a * ssa + rows[:, None] * ssb + g[None, :] * 2
    s = tl.load(so, mask=rmask[:, None], other=0).to(tl.float16, bitcast=True).to(tl.float32)
    z = tl.load(so + 1, mask=rmask[:, None], other=0).to(tl.float16, bitcast=True).to(tl.float32)
    x = tl.reshape(q * s[:, :, None] + z[:, :, None], (BLOCK_R, D))
    cols = tl.arange(0, D)
    if ROTATE:
        h = tl.load(h_ptr + cols[:, None] * D + cols[None, :])
        x = tl.dot(x, h, input_precision="ieee")
    tl.store(out_ptr + a * soa + rows[:, None] * sob + cols[None, :], _out(x, BF16).to(out_ptr.dtype.element_ty),
             mask=rmask[:, None])  # fmt: skip


@triton.jit
def _int4_encode_channels(x_ptr, codes_ptr, sz_ptr, C, T, OT, G: tl.constexpr, BLOCK_C: tl.constexpr):
    """Per-channel groups of G tokens over the first T of OT tokens: x (L, OT, C) -> codes (L, OT, C/2),
    scale/zero (L, T/G, C, 2)."""
    layer, g = tl.program_id(0), tl.program_id(1)
    ch = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = ch < C
    t = g * G + tl.arange(0, G)
    x = tl.load(x_ptr + (layer * OT + t[:, None]) * C + ch[None, :], mask=cmask[None, :], other=0.0)
    x = x.to(tl.float32)
    bad = tl.max(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32), axis=0) > 0
    s16, z16, z, inv = _int4_params(tl.min(x, axis=0), tl.max(x, axis=0), bad)
    q = tl.floor((x - z[None, :]) * inv[None, :] + 0.5)
    q = tl.minimum(tl.maximum(q, 0.0), 15.0).to(tl.int32)
    lo, hi = tl.split(tl.reshape(q, (G, BLOCK_C // 2, 2)))
    hc = tl.program_id(2) * (BLOCK_C // 2) + tl.arange(0, BLOCK_C // 2)
    tl.store(codes_ptr + (layer * OT + t[:, None]) * (C // 2) + hc[None, :], (lo | (hi << 4)).to(tl.uint8),
             mask=(hc < C // 2)[None, :])  # fmt: skip
    so = sz_ptr + ((layer * (T // G) + g) * C + ch) * 2
    tl.store(so, s16.to(tl.int16, bitcast=True), mask=cmask)
    tl.store(so + 1, z16.to(tl.int16, bitcast=True), mask=cmask)


@triton.jit
def _int4_decode_channels(
    codes_ptr, sz_ptr, out_ptr, C, T, OT, G: tl.constexpr, BLOCK_C: tl.constexpr, BF16: tl.constexpr
):
    """Inverse of _int4_encode_channels; out has OT tokens per layer (the chunk's T incl. the tail)."""
    layer, g = tl.program_id(0), tl.program_id(1)
    ch = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = ch < C
    t = g * G + tl.arange(0, G)
    hc = tl.program_id(2) * (BLOCK_C // 2) + tl.arange(0, BLOCK_C // 2)
    byte = tl.load(codes_ptr + (layer * OT + t[:, None]) * (C // 2) + hc[None, :], mask=(hc < C // 2)[None, :],
                   other=0).to(tl.int32)  # fmt: skip
    q = tl.reshape(tl.join(byte & 15, byte >> 4), (G, BLOCK_C)).to(tl.float32)
    so = sz_ptr + ((layer * (T // G) + g) * C + ch) * 2
    s = tl.load(so, mask=cmask, other=0).to(tl.float16, bitcast=True).to(tl.float32)
    z = tl.load(so + 1, mask=cmask, other=0).to(tl.float16, bitcast=True).to(tl.float32)
    x = q * s[None, :] + z[None, :]
    tl.store(out_ptr + (layer * OT + t[:, None]) * C + ch[None, :], _out(x, BF16).to(out_ptr.dtype.element_ty),
             mask=cmask[None, :])  # fmt: skip


_TORCH_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _sections(buf: torch.Tensor, lay: Int4Layout) -> dict[str, torch.Tensor]:
    out, pos = {}, 0
    for name, npdt, shape in lay.sections():
        n = math.prod(shape) * np.dtype(npdt).itemsize
        part = buf[pos : pos + n]
        out[name] = part.view(_TORCH_BITS[np.dtype(npdt).itemsize]).view(shape)
        pos += n
    assert pos == buf.numel()
    return out


def int4_encode(kv: torch.Tensor, lay: Int4Layout) -> torch.Tensor:
    """kv [2, L, T, H, D] contiguous on the device -> the int4 payload as a device uint8 tensor."""
    _, nl, nt, nh, d = lay.shape
    buf = torch.empty(lay.nbytes(), dtype=torch.uint8, device=kv.device)
    p = _sections(buf, lay)
    h = hadamard(d, kv.device) if lay.rotate else buf  # any pointer when not rotating
    p["sink"].copy_(kv[:, :, : lay.sink].view(p["sink"].dtype))
    for half, ts, group, sz in row_jobs(lay):
        rows = (ts.stop - ts.start) * nh
        x, c = kv[half, :, ts].view(nl, rows, d), p["codes"][half, :, ts].view(nl, rows, d // 2)
        s = p[sz].view(nl, rows, d // group * 2)
        grid = (nl, triton.cdiv(rows, _BLOCK_R))
        _int4_encode_rows[grid](x, h, c, s, rows, x.stride(0), x.stride(1), c.stride(0), c.stride(1),
                                s.stride(0), s.stride(1), d, group, d // group, lay.rotate, _BLOCK_R, **_EXACT)  # fmt: skip
    tf = lay.full_tokens
    if tf:
        grid = (nl, tf // lay.key_group, triton.cdiv(nh * d, _BLOCK_C))
        _int4_encode_channels[grid](kv[0], p["codes"][0], p["k_sz"], nh * d, tf, nt, lay.key_group, _BLOCK_C,
                                    **_EXACT)  # fmt: skip
    return buf


def int4_decode(buf: torch.Tensor, lay: Int4Layout, dtype: torch.dtype) -> torch.Tensor:
    """A device uint8 int4 payload -> the KV tensor on the same device."""
    _, nl, nt, nh, d = lay.shape
    p = _sections(buf, lay)
    out = torch.empty(lay.shape, dtype=dtype, device=buf.device)
    ov, bf16 = _out_view(out)
    h = hadamard(d, buf.device) if lay.rotate else buf
    for half, ts, group, sz in row_jobs(lay):
        rows = (ts.stop - ts.start) * nh
        o, c = ov[half, :, ts].view(nl, rows, d), p["codes"][half, :, ts].view(nl, rows, d // 2)
        s = p[sz].view(nl, rows, d // group * 2)
        grid = (nl, triton.cdiv(rows, _BLOCK_R))
        _int4_decode_rows[grid](c, s, h, o, rows, c.stride(0), c.stride(1), s.stride(0), s.stride(1),
                                o.stride(0), o.stride(1), d, group, d // group, lay.rotate, _BLOCK_R, bf16, **_EXACT)  # fmt: skip
    tf = lay.full_tokens
    if tf:
        grid = (nl, tf // lay.key_group, triton.cdiv(nh * d, _BLOCK_C))
        _int4_decode_channels[grid](p["codes"][0], p["k_sz"], ov[0], nh * d, tf, nt, lay.key_group, _BLOCK_C,
                                    bf16, **_EXACT)  # fmt: skip
    out[:, :, : lay.sink] = p["sink"].view(dtype)
    return out
