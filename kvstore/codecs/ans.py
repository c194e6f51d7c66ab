"""The entropy stage: quantised codes, segment by segment, through rANS (lossless).

A segment is a run of `n` codes `bits` wide (2, 4 or 8; packed as the codecs pack them) with one
probability table, e.g. one layer's keys. Its record in a stream, little-endian:

    u8 mode: 0 the packed codes as they are (where coding would not shrink them), 1 rANS
    mode 1:  u16 x 2^bits frequencies (12-bit: they sum to 4096), u32 length m, m bytes of rANS
             (ans_kernels.c: 8 interleaved 32-bit states, 16-bit renormalisation)

A stream is its segments' records back to back; the reader knows each segment's n and bits from the
blob's header. `decode_segments` raises CodecError for any stream that is not exactly such records
(a table that does not sum to 4096, a length past the end, a rANS stream that does not end in the
encoder's start state or leaves bytes over), so a damaged stream is a miss, never other codes.

The C kernel (compiled on first use, kvstore.c_build) and ans_ref.py (pure Python: the
reference, and the fallback without a C compiler; KVSTORE_ANS_KERNEL=0 forces it) write the same
bytes. The C decoder assumes a little-endian CPU, as the blob format does; on an AVX-512 CPU it
decodes 4 segments at once (KVSTORE_ANS_SIMD=0: the scalar C path only, same bytes).
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from kvstore.c_build import load_library
from kvstore.codecs import ans_ref
from kvstore.errors import CodecError

_SRC = Path(__file__).with_name("ans_kernels.c")
_FLAGS = ("-O3", "-shared", "-fPIC", "-std=c11")  # no -march: the .so may run on another CPU
PROB_SCALE = ans_ref.PROB_SCALE
_LEN = struct.Struct("<I")


@functools.cache
def _lib() -> ctypes.CDLL | None:
    lib = load_library(_SRC, _FLAGS, "KVSTORE_ANS_KERNEL", "the Python fallback decodes ~1 µs a code")
    if lib is None:
        return None
    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.ans_encode.argtypes, lib.ans_encode.restype = [p, i64, i, p, p, i64], i64
    lib.ans_decode_stream.argtypes, lib.ans_decode_stream.restype = [p, i64, p, i64, i, p, p, i], i
    return lib


def kernel_available() -> bool:
    return _lib() is not None


def packed_nbytes(n: int, bits: int) -> int:
    return (n * bits + 7) // 8


def counts(codes: np.ndarray, bits: int) -> np.ndarray:
    """How often each symbol occurs in packed codes (every bit of the bytes: pad symbols count too)."""
    mask = (1 << bits) - 1
    return sum(np.bincount((codes >> (k * bits)) & mask, minlength=1 << bits) for k in range(8 // bits))


def normalize(count: np.ndarray) -> np.ndarray:
    """12-bit frequencies summing to 4096: every symbol that occurs gets at least 1 (deterministic)."""
    count = count.astype(np.int64)
    total = int(count.sum())
    freq = np.where(count > 0, np.maximum(1, count * PROB_SCALE // max(total, 1)), 0)
    while (excess := int(freq.sum()) - PROB_SCALE) != 0:  # at most 2^bits rounds
        s = int(np.argmax(freq)) if excess > 0 else int(np.argmax(count))
        freq[s] -= min(excess, int(freq[s]) - 1) if excess > 0 else excess
    return freq.astype("<u2")


def _encode_one(codes: np.ndarray, n: int, bits: int, freq: np.ndarray, use_c: bool) -> bytes | None:
    lib = _lib() if use_c else None
    if lib is None:
        return ans_ref.encode(codes, n, bits, freq)
    cap = 2 * n + 64
    out = np.empty(cap, np.uint8)
    codes = np.ascontiguousarray(codes)
    m = lib.ans_encode(codes.ctypes.data, n, bits, freq.ctypes.data, out.ctypes.data, cap)
    return None if m < 0 else out[:m].tobytes()


def encode_segments(
    segments: Sequence[np.ndarray], ns: Sequence[int], bits: int, use_c: bool = True
) -> bytes:
    """The stream of packed code segments (`ns[i]` codes in `segments[i]`)."""
    out: list[bytes] = []
    for codes, n in zip(segments, ns, strict=True):
        codes = np.ascontiguousarray(codes).reshape(-1)
        assert codes.size == packed_nbytes(n, bits), (codes.size, n, bits)
        freq = normalize(counts(codes, bits))
        coded = _encode_one(codes, n, bits, freq, use_c)
        if coded is None or 1 + freq.nbytes + _LEN.size + len(coded) >= 1 + codes.size:
            out += [b"\0", codes.tobytes()]
        else:
            out += [b"\1", freq.tobytes(), _LEN.pack(len(coded)), coded]
    return b"".join(out)


def decode_into(
    stream: bytes | bytearray | memoryview,
    ns: Sequence[int],
    bits: int,
    out: np.ndarray | torch.Tensor,
    offsets: Sequence[int],
    use_c: bool = True,
) -> None:
    """Every segment's packed codes written into the uint8 array `out` at `offsets[i]` (segments must
    not overlap; the bytes between them are left as they are): with the C kernel one call for the
    whole stream, tables and records parsed in C; `out` a torch tensor (CUDA, or CPU under
    TRITON_INTERPRET=1): the Triton decoder, triton_ans.py. CodecError unless `stream` is exactly such records."""
    if isinstance(out, torch.Tensor):
        from kvstore.codecs import triton_ans  # noqa: PLC0415 (Triton: only on this path)

        return triton_ans.decode_into(stream, ns, bits, out, offsets)
    sizes = [packed_nbytes(n, bits) for n in ns]
    if len(offsets) != len(ns) or any(o < 0 or o + s > out.size for o, s in zip(offsets, sizes, strict=True)):
        raise ValueError("ans: segment offsets outside the output")
    lib = _lib() if use_c else None
    if lib is None:
        for codes, at, size in zip(decode_segments(stream, ns, bits, use_c), offsets, sizes, strict=True):
            out[at : at + size] = codes
        return
    assert out.dtype == np.uint8 and out.flags.c_contiguous and out.flags.writeable
    src = np.frombuffer(memoryview(stream).cast("B"), np.uint8)
    n_arr, at_arr = np.array(ns, np.int64), np.array(offsets, np.int64)
    dst, at = out.ctypes.data, at_arr.ctypes.data
    simd = int(os.environ.get("KVSTORE_ANS_SIMD", "1") != "0")
    if lib.ans_decode_stream(src.ctypes.data, src.size, n_arr.ctypes.data, n_arr.size, bits, dst, at, simd):
        raise CodecError("ans: damaged stream (a bad record, table or rANS stream, or bytes over)")


def decode_segments(
    stream: bytes | bytearray | memoryview, ns: Sequence[int], bits: int, use_c: bool = True
) -> list[np.ndarray]:
    """The packed codes of every segment; CodecError unless `stream` is exactly such records."""
    if use_c and _lib() is not None:
        sizes = [packed_nbytes(n, bits) for n in ns]
        offsets = np.cumsum([0, *sizes])
        out = np.empty(int(offsets[-1]), np.uint8)
        decode_into(stream, ns, bits, out, offsets[:-1].tolist())
        return [out[a:b] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)]
    view, pos, out = memoryview(stream).cast("B"), 0, []
    nsym = 1 << bits
    for n in ns:
        size = packed_nbytes(n, bits)
        if pos >= len(view):
            raise CodecError("ans: stream ends before its segments")
        mode, pos = view[pos], pos + 1
        if mode == 0:
            if pos + size > len(view):
                raise CodecError("ans: stream ends inside a raw segment")
            out.append(np.frombuffer(view[pos : pos + size], np.uint8))
            pos += size
            continue
        if mode != 1 or pos + 2 * nsym + _LEN.size > len(view):
            raise CodecError("ans: bad segment record")
        freq = np.frombuffer(view[pos : pos + 2 * nsym], "<u2")
        (m,) = _LEN.unpack_from(view, pos + 2 * nsym)
        pos += 2 * nsym + _LEN.size
        if int(freq.astype(np.int64).sum()) != PROB_SCALE or m > len(view) - pos:
            raise CodecError("ans: bad segment table or length")
        codes = ans_ref.decode(view[pos : pos + m], n, bits, freq)
        if codes is None:
            raise CodecError("ans: damaged rANS stream")
        out.append(codes)
        pos += m
    if pos != len(view):
        raise CodecError(f"ans: {len(view) - pos} bytes after the last segment")
    return out
