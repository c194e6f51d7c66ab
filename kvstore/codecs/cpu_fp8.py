"""numba CPU kernels for the fp8 codec (one thread; see fp8.py for the format).

Quantisation: scale = amax / 448 (float32), q = e4m3(clamp(x * (1 / scale), -448, 448)) rounded to
nearest even; an all-zero row has scale 0 and codes 0. Dequantisation: e4m3 value * scale in
float32, rounded to the KV dtype. The Triton kernels do the same float32 operations in this order.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvstore.codecs.cpu_bits import f32_to_e4m3, load_row, store_row

E4M3_MAX = np.float32(448.0)
_LANES = 8


@njit(inline="always")
def _row_amax(buf, lanes) -> float:
    """max |buf| over independent lanes (vectorises; a single running max does not)."""
    n = buf.shape[0]
    lanes[:] = 0
    for i in range(0, n - n % _LANES, _LANES):
        for j in range(_LANES):
            lanes[j] = max(lanes[j], abs(buf[i + j]))
    m = lanes.max()
    for i in range(n - n % _LANES, n):
        m = max(m, abs(buf[i]))
    return m


@njit(cache=True, nogil=True)
def amax(x, kind):
    """Largest |x| over a (R, D) bits array; NaN if any element is NaN or Inf."""
    buf = np.empty(x.shape[1], np.float32)
    lanes = np.empty(_LANES, np.float32)
    m = np.float32(0)
    for r in range(x.shape[0]):
        if load_row(x[r], kind, buf):
            return np.float32(np.nan)
        m = max(m, _row_amax(buf, lanes))
    return m


@njit(cache=True, nogil=True)
def encode_rows(x, kind, per_row, scales, codes):
    """x (R, D) bits -> codes (R, D) uint8. per_row: write scales[r] = amax(row) / 448;
    otherwise use scales[0] for every row. A row with NaN/Inf gets a NaN scale."""
    nr, d = x.shape
    buf = np.empty(d, np.float32)
    lanes = np.empty(_LANES, np.float32)
    s = scales[0]
    for r in range(nr):
        bad = load_row(x[r], kind, buf)
        if per_row:
            s = np.float32(np.nan) if bad else _row_amax(buf, lanes) / E4M3_MAX
            scales[r] = s
        inv = np.float32(1) / s if s > 0 else np.float32(0)
        c = codes[r]
        for i in range(d):
            c[i] = f32_to_e4m3(min(max(buf[i] * inv, -E4M3_MAX), E4M3_MAX))


@njit(cache=True, nogil=True)
def decode_rows(codes, scales, per_row, table, kind, out):
    """Inverse of encode_rows into out (R, D) bits; table maps an e4m3 code to its float32 value."""
    nr, d = out.shape
    buf = np.empty(d, np.float32)
    s = scales[0]
    for r in range(nr):
        if per_row:
            s = scales[r]
        c = codes[r]
        for i in range(d):
            buf[i] = table[c[i]] * s
        store_row(buf, kind, out[r])
