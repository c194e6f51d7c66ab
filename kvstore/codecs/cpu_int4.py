"""numba CPU kernels for the int4 codec (one thread; see int4.py for the format).

Every kernel reads and writes raw bits (cpu_bits.py) so that float16, bfloat16 and float32 share one
compiled path each. Quantisation: scale = fp16((max - min) / 15), zero = fp16(min),
q = clamp(floor((x - zero) * (1 / scale) + 0.5), 0, 15); dequantisation: q * scale + zero, in float32,
then rounded to the KV dtype. The Triton kernels do exactly these float32 operations in this order.
Loops are written so that LLVM vectorises them: dtype branches outside loops, min/max over
independent lanes (a single running min is a serial chain that does not vectorise without fastmath).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvstore.codecs.cpu_bits import f16_to_f32, f32_to_f16, fwht, load_row, store_row

_NAN16 = 0x7E00
_LANES = 8  # every group size is a multiple of 8


@njit(inline="always")
def _params(mn: float, mx: float, bad: bool) -> tuple:
    """(scale bits, zero bits, zero, 1/scale) for a group with range [mn, mx]; NaN scale if bad."""
    if bad:
        return _NAN16, _NAN16, np.float32(0), np.float32(0)
    s16 = f32_to_f16((np.float32(mx) - np.float32(mn)) / np.float32(15))
    z16 = f32_to_f16(mn)
    s = f16_to_f32(s16)
    inv = np.float32(1) / s if s > 0 else np.float32(0)
    return s16, z16, f16_to_f32(z16), inv


@njit(inline="always")
def _quant(buf, lo, hi, z, inv, q) -> None:
    for i in range(lo, hi):
        v = np.floor((buf[i] - z) * inv + np.float32(0.5))
        q[i] = np.uint8(min(max(v, np.float32(0)), np.float32(15)))


@njit(inline="always")
def _pack(q, codes_row) -> None:
    for j in range(codes_row.shape[0]):
        codes_row[j] = q[2 * j] | (q[2 * j + 1] << 4)


@njit(cache=True, nogil=True)
def encode_rows(x, kind, group, rotate, norm, codes, sz):  # noqa: PLR0913
    """Per-token groups: x (A, B, D) bits -> codes (A, B, D/2) uint8, sz (A, B, D/group, 2) uint16."""
    na, nb, d = x.shape
    buf = np.empty(d, np.float32)
    q = np.empty(d, np.uint8)
    lmn = np.empty(_LANES, np.float32)
    lmx = np.empty(_LANES, np.float32)
    for a in range(na):
        for b in range(nb):
            bad = load_row(x[a, b], kind, buf)
            if rotate:
                fwht(buf, norm)
            for g in range(d // group):
                lo = g * group
                for j in range(_LANES):
                    lmn[j] = buf[lo + j]
                    lmx[j] = buf[lo + j]
                for i in range(lo + _LANES, lo + group, _LANES):
                    for j in range(_LANES):
                        lmn[j] = min(lmn[j], buf[i + j])
                        lmx[j] = max(lmx[j], buf[i + j])
                mn, mx = lmn[0], lmx[0]
                for j in range(1, _LANES):
                    mn = min(mn, lmn[j])
                    mx = max(mx, lmx[j])
                s16, z16, z, inv = _params(mn, mx, bad)
                sz[a, b, g, 0] = s16
                sz[a, b, g, 1] = z16
                _quant(buf, lo, lo + group, z, inv, q)
            _pack(q, codes[a, b])


@njit(cache=True, nogil=True)
def decode_rows(codes, sz, kind, group, rotate, norm, out):  # noqa: PLR0913
    """Inverse of encode_rows into out (A, B, D) bits."""
    na, nb, d = out.shape
    buf = np.empty(d, np.float32)
    for a in range(na):
        for b in range(nb):
            c = codes[a, b]
            for g in range(d // group):
                s = f16_to_f32(sz[a, b, g, 0])
                z = f16_to_f32(sz[a, b, g, 1])
                for j in range(g * group // 2, (g + 1) * group // 2):
                    buf[2 * j] = np.float32(c[j] & 15) * s + z
                    buf[2 * j + 1] = np.float32(c[j] >> 4) * s + z
            if rotate:
                fwht(buf, norm)
            store_row(buf, kind, out[a, b])


@njit(cache=True, nogil=True)
def encode_channels(x, kind, group, codes, sz):
    """Per-channel groups of `group` tokens: x (L, T, C) bits, T % group == 0 ->
    codes (L, T, C/2) uint8, sz (L, T/group, C, 2) uint16."""
    nl, nt, nc = x.shape
    buf = np.empty((group, nc), np.float32)
    q = np.empty(nc, np.uint8)
    mn = np.empty(nc, np.float32)
    mx = np.empty(nc, np.float32)
    zs = np.empty(nc, np.float32)
    invs = np.empty(nc, np.float32)
    for layer in range(nl):
        for g in range(nt // group):
            t0 = g * group
            bad = False
            for t in range(group):
                bad |= load_row(x[layer, t0 + t], kind, buf[t])
            mn[:] = buf[0]
            mx[:] = buf[0]
            for t in range(1, group):
                row = buf[t]
                for c in range(nc):
                    mn[c] = min(mn[c], row[c])
                    mx[c] = max(mx[c], row[c])
            for c in range(nc):
                s16, z16, z, inv = _params(mn[c], mx[c], bad)
                zs[c] = z
                invs[c] = inv
                sz[layer, g, c, 0] = s16
                sz[layer, g, c, 1] = z16
            for t in range(group):
                row = buf[t]
                for c in range(nc):
                    v = np.floor((row[c] - zs[c]) * invs[c] + np.float32(0.5))
                    q[c] = np.uint8(min(max(v, np.float32(0)), np.float32(15)))
                _pack(q, codes[layer, t0 + t])


@njit(cache=True, nogil=True)
def decode_channels(codes, sz, kind, group, out):
    """Inverse of encode_channels into out (L, T, C) bits."""
    nl, nt, nc = out.shape
    buf = np.empty(nc, np.float32)
    ss = np.empty(nc, np.float32)
    zs = np.empty(nc, np.float32)
    for layer in range(nl):
        for g in range(nt // group):
            for c in range(nc):
                ss[c] = f16_to_f32(sz[layer, g, c, 0])
                zs[c] = f16_to_f32(sz[layer, g, c, 1])
            for t in range(g * group, (g + 1) * group):
                cr = codes[layer, t]
                for j in range(nc // 2):
                    buf[2 * j] = np.float32(cr[j] & 15) * ss[2 * j] + zs[2 * j]
                    buf[2 * j + 1] = np.float32(cr[j] >> 4) * ss[2 * j + 1] + zs[2 * j + 1]
                store_row(buf, kind, out[layer, t])
