"""kivi4 / kivi2 decode in Triton (kivi.py's payload): compiled on CUDA, interpreted on CPU in tests
(`TRITON_INTERPRET=1` must be set before this module is imported).

One kernel serves keys and values: each program takes rows of one head's channels (a layer, a token,
a head), unpacks their b-bit codes from wherever they sit in the payload (16-bit metadata is read
byte by byte: a payload's sections need not be aligned), dequantises them with the CPU path's float32
operations in its order (no fused multiply-add), rotates values back through the Hadamard butterflies
(common.hadamard_rows' order, which the CPU decodes use) and rounds to the KV dtype to nearest even.
The sink keys' raw bits are copied by torch on the device.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np
import torch
import triton
import triton.language as tl

from kvstore.codecs.triton_kernels import _out, _out_view

_BLOCK_R = 16  # head rows per program
_EXACT = {"enable_fp_fusion": False}  # the CPU path rounds after every float32 operation
POW = torch.tensor([2.0 ** (-c / 16) for c in range(256)], dtype=torch.float32)  # kivi._POW (a test checks)


class KiviLayout(Protocol):
    """What this module reads of a kivi.KiviLayout (not imported: kivi.py imports this module)."""

    shape: tuple[int, int, int, int, int]
    bits: int
    key_tokens: int
    value_group: int
    sink: int
    itemsize: int
    value_meta: str
    rotate_values: bool
    key_meta: str

    @property
    def key_groups(self) -> int: ...

    def sections(self) -> list[tuple[str, type, tuple[int, ...]]]: ...


@triton.jit
def _ld16(buf_ptr, off, mask):
    """Little-endian 16-bit words at byte offsets `off` (any alignment), as int32 0..65535."""
    lo = tl.load(buf_ptr + off, mask=mask, other=0).to(tl.int32)
    return lo | (tl.load(buf_ptr + off + 1, mask=mask, other=0).to(tl.int32) << 8)


@triton.jit
def _f16(w):
    """float16 bits (int32 0..65535) -> float32."""
    return tl.where(w >= 32768, w - 65536, w).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _butterflies(x, R: tl.constexpr, D: tl.constexpr, LOG_D: tl.constexpr):
    """The unnormalised Walsh-Hadamard transform of each row: stages of span 1, 2, 4, ... D/2, each
    (a, b) -> (a + b, a - b) in float32."""
    for s in tl.static_range(LOG_D):  # s is a constant: the shapes are
        y = tl.permute(tl.reshape(x, (R, D >> (s + 1), 2, 1 << s)), (0, 1, 3, 2))
        a, b = tl.split(y)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (R, D))
    return x


@triton.jit
def _decode_rows(buf_ptr, pow_ptr, out_ptr, ROWS, NT, H, D, T_OUT, TOK0, ROW_BYTES, CODES, META, REF,
                 TDIV, A, MDIV, M, SCALE, BITS: tl.constexpr, META8: tl.constexpr, ROTATE: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, LOG_D: tl.constexpr,
                 BF16: tl.constexpr):  # fmt: skip
    """Rows r = (layer, token, head) of NT tokens -> out [L, T_OUT, H, D] at token TOK0 + token. A
    code's group metadata sits at index (layer * A + token // TDIV) * M + channel // MDIV (fp16 pairs,
    or a uint16 with an fp16 reference per layer * M + channel // MDIV when META8)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    dd = tl.arange(0, BLOCK_D)
    mask = (r < ROWS)[:, None] & (dd < D)[None, :]
    rt, h = r // H, r % H
    layer, t = rt // NT, rt % NT
    c = h[:, None] * D + dd[None, :]
    bit = c * BITS
    byte = tl.load(buf_ptr + CODES + rt[:, None] * ROW_BYTES + bit // 8, mask=mask, other=0).to(tl.int32)
    q = ((byte >> (bit % 8)) & ((1 << BITS) - 1)).to(tl.float32)
    m = c // MDIV
    idx = (layer * A + t // TDIV)[:, None] * M + m
    if META8:
        u = _ld16(buf_ptr, META + 2 * idx, mask)
        ref = _f16(_ld16(buf_ptr, REF + 2 * (layer[:, None] * M + m), mask))
        s = tl.load(pow_ptr + (u & 255), mask=mask, other=0.0) * ref
        x = (q - (u >> 8).to(tl.float32) * 0.0625) * s
    else:
        s = _f16(_ld16(buf_ptr, META + 4 * idx, mask))
        z = _f16(_ld16(buf_ptr, META + 4 * idx + 2, mask))
        x = q * s + z
    if ROTATE:
        x = _butterflies(x, BLOCK_R, BLOCK_D, LOG_D) * SCALE
    o = ((layer * T_OUT + TOK0 + t) * H + h)[:, None] * D + dd[None, :]
    tl.store(out_ptr + o, _out(x, BF16).to(out_ptr.dtype.element_ty), mask=mask)


def _offsets(lay: KiviLayout) -> dict[str, int]:
    """Each section's byte offset in the payload."""
    out, pos = {}, 0
    for name, npdt, shape in lay.sections():
        out[name] = pos
        pos += math.prod(shape) * np.dtype(npdt).itemsize
    return out


def kivi_decode(buf: torch.Tensor, lay: KiviLayout, dtype: torch.dtype) -> torch.Tensor:
    """A kivi payload as a uint8 tensor on the device -> the KV [2, L, T, H, D] on the same device."""
    _, nl, nt, nh, d = lay.shape
    c, sink = nh * d, lay.sink
    at = _offsets(lay)
    out = torch.empty(lay.shape, dtype=dtype, device=buf.device)
    ov, bf16 = _out_view(out)
    pow_table = POW.to(buf.device)
    bd = triton.next_power_of_2(d)
    kmeta8, vmeta8 = lay.key_meta == "8bit", lay.value_meta == "8bit"
    jobs = [  # (half, tokens, first output token, codes, meta, ref, TDIV, A, MDIV, M, 8bit, rotate)
        (0, nt - sink, sink, at["k_codes"], at["k_meta" if kmeta8 else "k_sz"], at.get("k_ref", 0),
         lay.key_tokens, lay.key_groups, 1, c, kmeta8, False),
        (1, nt, 0, at["v_codes"], at["v_meta" if vmeta8 else "v_sz"], at.get("v_ref", 0),
         1, nt, lay.value_group, c // lay.value_group, vmeta8, lay.rotate_values),
    ]  # fmt: skip
    for half, tokens, tok0, codes, meta, ref, tdiv, a, mdiv, m, meta8, rotate in jobs:
        rows = nl * tokens * nh
        if rows == 0:
            continue
        _decode_rows[(triton.cdiv(rows, _BLOCK_R),)](
            buf, pow_table, ov[half], rows, tokens, nh, d, nt, tok0, c * lay.bits // 8, codes, meta, ref,
            tdiv, a, mdiv, m, 1 / math.sqrt(d), lay.bits, meta8, rotate, _BLOCK_R, bd, int(math.log2(bd)),
            bf16, **_EXACT,
        )  # fmt: skip
    if sink:
        isz = lay.itemsize
        src = buf[at["sink"] : at["sink"] + nl * sink * c * isz].view(nl, sink, c * isz)
        out.view(torch.uint8).view(2, nl, nt, c * isz)[0, :, :sink] = src
    return out


__all__ = ["kivi_decode"]
