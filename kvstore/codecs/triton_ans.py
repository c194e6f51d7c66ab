"""The rANS stage's decoder in Triton (ans.py's stream, unchanged): compiled on CUDA, interpreted on
CPU in tests (`TRITON_INTERPRET=1` must be set before this module is imported).

The host parses the records as ans_kernels.c does (modes, tables, lengths, each coded segment's lane
table) and raises CodecError for the same streams; the device runs one program per segment: a raw
segment is copied, a coded one decoded with its 8 interleaved states as one vector, the same integer
steps as the C kernel (so the same codes). What only decoding can tell (a lane that would read past
its words, one that ends with words left or not in the encoder's start state) sets the segment's
error flag, and the host raises CodecError: a damaged stream never leaves other codes unreported.
The lanes of a segment depend on their previous steps, so a program's steps are sequential: the
parallelism is 8 lanes x the segments of a blob.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from kvstore.codecs import ans_ref
from kvstore.errors import CodecError

LANES, PROB_SCALE, LOW = ans_ref.LANES, ans_ref.PROB_SCALE, ans_ref.LOW
_BLOCK = 256  # bytes per copy step of a raw segment
_LEN = struct.Struct("<I")


@dataclass(frozen=True)
class Plan:
    """A parsed stream: per segment (mode, n, output offset, raw source offset or table index) and
    (coded segments) each lane's first state, first word's and end's byte offsets in the stream."""

    bits: int
    info: np.ndarray  # int64 [nseg, 4]
    lanes: np.ndarray  # int64 [nseg, 3, LANES]
    freqs: np.ndarray  # int64 [ncoded, 2^bits]


def parse(
    stream: bytes | bytearray | memoryview, ns: Sequence[int], bits: int, offsets: Sequence[int]
) -> Plan:
    """The records of `stream` (ans.py), checked as ans_decode_stream checks them; CodecError else."""
    if bits not in (2, 4, 8):
        raise CodecError(f"ans: cannot decode {bits}-bit codes")
    view, nsym = memoryview(stream).cast("B"), 1 << bits
    size = len(view)
    info = np.zeros((len(ns), 4), np.int64)
    lanes = np.zeros((len(ns), 3, LANES), np.int64)
    freqs: list[np.ndarray] = []
    pos = 0
    for i, (n, at) in enumerate(zip(ns, offsets, strict=True)):
        if pos >= size:
            raise CodecError("ans: stream ends before its segments")
        mode, pos = view[pos], pos + 1
        if mode == 0:
            nbytes = (n * bits + 7) // 8
            if nbytes > size - pos:
                raise CodecError("ans: stream ends inside a raw segment")
            info[i] = (0, n, at, pos)
            pos += nbytes
            continue
        if mode != 1 or 2 * nsym + _LEN.size > size - pos:
            raise CodecError("ans: bad segment record")
        freq = np.frombuffer(view[pos : pos + 2 * nsym], "<u2").astype(np.int64)
        (m,) = _LEN.unpack_from(view, pos + 2 * nsym)
        pos += 2 * nsym + _LEN.size
        if int(freq.sum()) != PROB_SCALE or m > size - pos or m < 4 * LANES:
            raise CodecError("ans: bad segment table or length")
        lens = np.frombuffer(view[pos : pos + 4 * LANES], "<u4").astype(np.int64)
        starts = pos + 4 * LANES + np.concatenate([[0], np.cumsum(lens)[:-1]])
        if (lens < 4).any() or int(lens.sum()) != m - 4 * LANES:
            raise CodecError("ans: damaged rANS lane table")
        for lane, s in enumerate(starts.tolist()):
            lanes[i, 0, lane] = _LEN.unpack_from(view, s)[0]
        lanes[i, 1], lanes[i, 2] = starts + 4, starts + lens
        info[i] = (1, n, at, len(freqs))
        freqs.append(freq)
        pos += m
    if pos != size:
        raise CodecError(f"ans: {size - pos} bytes after the last segment")
    table = np.stack(freqs) if freqs else np.zeros((0, nsym), np.int64)
    return Plan(bits, info, lanes, table)


def _luts(freqs: torch.Tensor) -> torch.Tensor:
    """ans_kernels.c's decoding tables (symbol | (freq - 1) << 8 | cum << 20 per slot) as int32 bits."""
    nc, nsym = freqs.shape
    cum = (torch.cumsum(freqs, 1) - freqs).reshape(-1)
    f = freqs.reshape(-1)
    idx = torch.repeat_interleave(
        torch.arange(nc * nsym, device=freqs.device), f, output_size=nc * PROB_SCALE
    )
    e = (idx % nsym) | ((f[idx] - 1) << 8) | (cum[idx] << 20)
    return torch.where(e >= 1 << 31, e - (1 << 32), e).to(torch.int32)


@triton.jit
def _step(x, p, end, bad, active, src_ptr, lut_ptr):
    """One step of every active lane: (state, read offset, symbol, error) as the C kernel's STEP. The
    lane's next word is read whether the step needs it or not (so the read overlaps the table's),
    never past the lane's end."""
    ok = p + 2 <= end
    w = tl.load(src_ptr + p, mask=ok & active, other=0).to(tl.int64)
    w = w | (tl.load(src_ptr + p + 1, mask=ok & active, other=0).to(tl.int64) << 8)
    slot = x & (4096 - 1)
    e = tl.load(lut_ptr + slot, mask=active, other=0).to(tl.int64) & 0xFFFFFFFF
    f = ((e >> 8) & (4096 - 1)) + 1
    v = f * (x >> 12) + slot - (e >> 20)
    need = (v < 65536) & active
    bad = bad | (need & ~ok).to(tl.int32)
    rd = need & ok
    v = tl.where(rd, (v << 16) | w, v)
    return tl.where(active, v, x), tl.where(rd, p + 2, p), tl.where(active, e & 255, 0), bad


@triton.jit
def _decode_segments(src_ptr, out_ptr, info_ptr, lanes_ptr, lut_ptr, err_ptr, BITS: tl.constexpr,
                     PER: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """One segment per program; lanes as [8 / PER, PER]: lane g * PER + j's symbols fill bits j * BITS
    of byte g of each step's 8 / PER bytes."""
    seg = tl.program_id(0)
    mode = tl.load(info_ptr + seg * 4)
    n = tl.load(info_ptr + seg * 4 + 1)
    dst = tl.load(info_ptr + seg * 4 + 2)
    arg = tl.load(info_ptr + seg * 4 + 3)
    if mode == 0:
        size = (n * BITS + 7) // 8
        for b in range(0, size, BLOCK):
            offs = b + tl.arange(0, BLOCK)
            v = tl.load(src_ptr + arg + offs, mask=offs < size)
            tl.store(out_ptr + dst + offs, v, mask=offs < size)
        tl.store(err_ptr + seg, 0)
    else:
        G: tl.constexpr = 8 // PER
        gi = tl.arange(0, G)
        j = tl.arange(0, PER)[None, :]
        lane = gi[:, None] * PER + j
        x = tl.load(lanes_ptr + seg * 24 + lane)
        p = tl.load(lanes_ptr + seg * 24 + 8 + lane)
        end = tl.load(lanes_ptr + seg * 24 + 16 + lane)
        lut = lut_ptr + arg * 4096
        bad = tl.zeros((G, PER), tl.int32)
        every = lane >= 0
        steps = n // 8
        for k in range(steps):
            x, p, sym, bad = _step(x, p, end, bad, every, src_ptr, lut)
            byte = tl.sum(sym << (j * BITS), axis=1)
            tl.store(out_ptr + dst + k * G + gi, byte.to(tl.uint8))
        rem = n - steps * 8
        x, p, sym, bad = _step(x, p, end, bad, lane < rem, src_ptr, lut)
        byte = tl.sum(sym << (j * BITS), axis=1)
        tl.store(out_ptr + dst + steps * G + gi, byte.to(tl.uint8), mask=gi * PER < rem)
        bad = bad | ((p != end) | (x != 65536)).to(tl.int32)
        tl.store(err_ptr + seg, tl.max(tl.max(bad, axis=1), axis=0))


def decode_plan(src: torch.Tensor, plan: Plan, out: torch.Tensor) -> None:
    """The segments of a parsed stream (`src`: its bytes, uint8 on the device) into the uint8 tensor
    `out` on the same device; CodecError if any segment's rANS stream turns out damaged."""
    nseg = len(plan.info)
    if nseg == 0:
        return
    dev = out.device
    info = torch.from_numpy(plan.info).to(dev)
    lanes = torch.from_numpy(plan.lanes).to(dev)
    lut = _luts(torch.from_numpy(plan.freqs).to(dev)) if len(plan.freqs) else info
    err = torch.empty(nseg, dtype=torch.int32, device=dev)
    _decode_segments[(nseg,)](src, out, info, lanes, lut, err, plan.bits, 8 // plan.bits, _BLOCK, num_warps=1)
    if bool(err.any()):
        raise CodecError("ans: damaged rANS stream")


def decode_into(
    stream: bytes | bytearray | memoryview,
    ns: Sequence[int],
    bits: int,
    out: torch.Tensor,
    offsets: Sequence[int],
    src: torch.Tensor | None = None,
) -> None:
    """ans.decode_into with `out` a uint8 tensor on the device: the host parses `stream`, the device
    decodes `src` (the same bytes on the device; copied there when not given)."""
    sizes = [(n * bits + 7) // 8 for n in ns]
    if len(offsets) != len(ns) or any(
        o < 0 or o + s > out.numel() for o, s in zip(offsets, sizes, strict=True)
    ):
        raise ValueError("ans: segment offsets outside the output")
    assert out.dtype == torch.uint8 and out.is_contiguous()
    plan = parse(stream, ns, bits, offsets)
    if src is None:
        src = torch.frombuffer(bytearray(stream), dtype=torch.uint8).to(out.device)
    decode_plan(src, plan, out)


def decode_base(base: Any, buf: torch.Tensor, params: dict, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A `+ans` codec's base payload, already on the device, through its base codec's Triton kernels."""
    from kvstore.codecs import triton_kernels  # noqa: PLC0415 (their modules import this one's users)
    from kvstore.codecs.fp8 import Fp8Codec  # noqa: PLC0415
    from kvstore.codecs.int4_layout import Int4Layout  # noqa: PLC0415
    from kvstore.codecs.kivi import KiviCodec, KiviLayout  # noqa: PLC0415

    if isinstance(base, KiviCodec):
        from kvstore.codecs import triton_kivi  # noqa: PLC0415

        return triton_kivi.kivi_decode(buf, KiviLayout.from_params(shape, params, dtype, base.bits), dtype)
    if isinstance(base, Fp8Codec):
        n = math.prod(shape)
        scales = buf[n:] if n % 4 == 0 else buf[n:].clone()  # float32 views need aligned storage
        return triton_kernels.fp8_decode(buf[:n], scales.view(torch.float32), params["scale"], shape, dtype)
    return triton_kernels.int4_decode(buf, Int4Layout.from_params(shape, params, dtype), dtype)


__all__ = ["Plan", "decode_base", "decode_into", "decode_plan", "parse"]
