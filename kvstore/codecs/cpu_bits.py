"""Scalar float bit tricks for the numba CPU kernels (numba has no float16/bfloat16/float8 types).

Tensors reach the kernels as raw bits: float16/bfloat16 as uint16, float32 as uint32. Conversions are
branchless IEEE round-to-nearest-even, so they match torch's and the GPU's casts bit for bit.
Arithmetic is kept in int64 on purpose: numba widens uint32 arithmetic to 64 bits and mixes signed
and unsigned 64-bit ints into float64, which would silently break the bit twiddling.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

from kvstore.codecs.common import KIND_BF16, KIND_F16, KIND_F32  # noqa: F401 (the kernels' dtype codes)


@intrinsic
def f32_bits(typingctx, x):  # noqa: ARG001 (numba's intrinsic signature)
    """float32 -> its uint32 bit pattern."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], context.get_value_type(types.uint32))

    return types.uint32(types.float32), codegen


@intrinsic
def f32_from_bits(typingctx, x):  # noqa: ARG001
    """uint32 bit pattern -> float32."""
    if x != types.uint32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))

    return types.float32(types.uint32), codegen


@njit(inline="always")
def _f(bits: int) -> float:
    return f32_from_bits(np.uint32(bits & 0xFFFFFFFF))


@njit(inline="always")
def _b(x: float) -> int:
    return np.int64(f32_bits(np.float32(x)))


@njit(inline="always")
def f16_to_f32(h: int) -> float:
    """IEEE half bits -> float32 (exact; subnormals, inf and NaN included)."""
    w = np.int64(h) << 16
    sign = w & 0x80000000
    two_w = (w + w) & 0xFFFFFFFF
    normalized = _f((two_w >> 4) + (0xE0 << 23)) * _f(0x7800000)
    denormalized = _f((two_w >> 17) | (126 << 23)) - np.float32(0.5)
    if two_w < (1 << 27):
        return _f(sign | _b(denormalized))
    return _f(sign | _b(normalized))


@njit(inline="always")
def f32_to_f16(x: float) -> int:
    """float32 -> IEEE half bits, round to nearest even, overflow to inf."""
    base = (abs(np.float32(x)) * _f(0x77800000)) * _f(0x08800000)
    w = _b(x)
    shl1_w = (w + w) & 0xFFFFFFFF
    sign = w & 0x80000000
    bias = shl1_w & 0xFF000000
    if bias < 0x71000000:
        bias = 0x71000000
    bits = _b(_f((bias >> 1) + 0x07800000) + base)
    nonsign = ((bits >> 13) & 0x7C00) + (bits & 0x0FFF)
    if shl1_w > 0xFF000000:
        nonsign = 0x7E00
    return (sign >> 16) | nonsign


@njit(inline="always")
def bf16_to_f32(h: int) -> float:
    return _f(np.int64(h) << 16)


@njit(inline="always")
def f32_to_bf16(x: float) -> int:
    """float32 -> bfloat16 bits, round to nearest even (inputs here are finite)."""
    w = _b(x)
    return ((w + 0x7FFF + ((w >> 16) & 1)) >> 16) & 0xFFFF


@njit(inline="always")
def load_row(src: np.ndarray, kind: int, dst: np.ndarray) -> bool:
    """dst[:] = src bits (uint16 for f16/bf16, uint32 for f32) as float32; True if any is NaN or Inf.

    The dtype branch sits outside the loops so that each loop vectorises; non-finite values are
    found on the exponent bits (the float code elsewhere may then assume finite values).
    """
    top = 0
    if kind == KIND_F16:
        for i in range(src.shape[0]):
            dst[i] = f16_to_f32(src[i])
            top = max(top, np.int64(src[i]) & 0x7C00)
        return top == 0x7C00
    if kind == KIND_BF16:
        for i in range(src.shape[0]):
            dst[i] = bf16_to_f32(src[i])
            top = max(top, np.int64(src[i]) & 0x7F80)
        return top == 0x7F80
    for i in range(src.shape[0]):
        dst[i] = _f(np.int64(src[i]))
        top = max(top, np.int64(src[i]) & 0x7F800000)
    return top == 0x7F800000


@njit(inline="always")
def store_row(src: np.ndarray, kind: int, dst: np.ndarray) -> None:
    """dst[:] = float32 src rounded (nearest even) to the bits of the output dtype."""
    if kind == KIND_F16:
        for i in range(src.shape[0]):
            dst[i] = f32_to_f16(src[i])
    elif kind == KIND_BF16:
        for i in range(src.shape[0]):
            dst[i] = f32_to_bf16(src[i])
    else:
        for i in range(src.shape[0]):
            dst[i] = _b(src[i])


@njit(inline="always")
def f32_to_e4m3(x: float) -> int:
    """float32 -> float8 e4m3fn bits, round to nearest even; |x| must already be <= 448."""
    w = _b(x)
    sign = (w >> 24) & 0x80
    w = w & 0x7FFFFFFF
    if w < (121 << 23):  # below the smallest normal 2^-6: let the FPU round into the subnormal grid
        r = (_b(_f(w) + _f(141 << 23)) - (141 << 23)) & 0xFF
    else:
        r = ((w + ((7 - 127) << 23) + 0x7FFFF + ((w >> 20) & 1)) >> 20) & 0xFF
    return sign | r


@njit(inline="always")
def fwht(buf: np.ndarray, norm: float) -> None:
    """In-place orthonormal Walsh-Hadamard transform of a power-of-two vector (its own inverse)."""
    n = buf.shape[0]
    h = 1
    while h < n:
        for i in range(0, n, 2 * h):
            for j in range(i, i + h):
                a = buf[j]
                b = buf[j + h]
                buf[j] = a + b
                buf[j + h] = a - b
        h *= 2
    for i in range(n):
        buf[i] = buf[i] * norm
