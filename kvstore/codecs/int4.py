"""`int4`: groupwise asymmetric 4-bit KV, two codes per byte, fp16 scale and zero point per group.

Options (`encode_blob(kv, codec="int4", group_size=64, keys="channel", rotate=False, sink_tokens=1)`):
    group_size: values are quantised per token in groups of `group_size` channels along head_dim
                (a power of two from 8 to 256 that divides head_dim).
    key_group_size: defaults to group_size. With keys="channel", the number of TOKENS per key group;
                with keys="token", channels per key group along head_dim (must divide head_dim).
    keys: "channel" (default) — the KIVI split: each key channel is quantised across
                key_group_size tokens (keys carry persistent outlier channels; values do not);
          "token" — keys are quantised per token like values.
    rotate: multiply every vector that is quantised per token by the orthonormal Hadamard matrix
                (head_dim must be a power of two) before quantising, and undo it on decode.
    sink_tokens: the first `sink_tokens` tokens of a chunk of >= 16 tokens are ALSO stored exactly, in
                the KV dtype, and restored on decode. The first token of a sequence is an attention
                sink whose keys are huge; quantising it dominates the error (bench_codec_quality.py on
                SmolLM2: KL 0.0114 -> 0.0025). Every chunk pays for one exact token (3.56x -> 3.51x
                at 256 tokens) because the codec cannot know which chunk starts a sequence.

Partial chunks with keys="channel": the first T - T % key_group_size tokens are grouped per channel;
the remaining T % key_group_size "tail" tokens are quantised per token like the values (with the
same rotation). So a 1-token chunk is quantised per token too: never a "group of one token" that
would store every key in its fp16 zero point. Its size: D/2 code bytes + 4 bytes per group of every
K and V head vector (3.56x smaller than fp16 at group 64); chunks under 16 tokens keep no sink token.

Payload, in order: codes uint8 `[2, L, T, H, D/2]` (even channel in the low nibble); value scale/zero
fp16 pairs `[L, T, H, D/g, 2]`; key scale/zero pairs — `[L, T/kg, H*D, 2]` then the tail's
`[L, T%kg, H, D/g, 2]` for keys="channel", `[L, T, H, D/kg, 2]` for keys="token"; then the sink
tokens' raw bits `[2, L, sink, H, D]`. Bytes per element: 1/2 + 4/group (+ sinks) -> 3.56x smaller
than fp16 at group 64, 3.76x at 128, 3.2x at 32.

Error bound: |x - x'| <= scale/2 per element (scale = fp16((max - min) / 15) of its group), plus the
fp16 rounding of scale and zero and the rounding to the KV dtype on decode; with rotate=True the
bound holds in the rotated basis (the rotation is orthonormal, so the L2 error per vector is the same).
NaN/Inf in the KV, or values past the fp16 range of the scales, raise CodecError.
Where each part lives is `int4_layout.py`. CPU tensors use the numba kernels (cpu_int4.py), CUDA tensors
the Triton kernels (triton_kernels.py); without rotation
they agree bit for bit, with rotation within one quantisation step (float sums in another order).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from kvstore.codecs import common
from kvstore.codecs.int4_layout import Int4Layout, layout_for, row_jobs
from kvstore.errors import CodecError

__all__ = ["Int4Codec", "Int4Layout", "layout_for"]


def _check_finite(parts: dict[str, np.ndarray]) -> None:
    for name in ("v_sz", "k_sz", "k_tail_sz"):
        if name in parts and parts[name].size and not np.isfinite(parts[name].view(np.float16)).all():
            raise CodecError("int4: KV contains NaN, Inf or values beyond the float16 range of its scales")


class Int4Codec:
    name = "int4"
    codec_id = 2

    def encode(self, kv: torch.Tensor, **options: Any) -> tuple[memoryview, dict]:
        kv = common.check_kv(kv, self.name)
        lay = layout_for(tuple(kv.shape), kv.dtype, **options)
        kv = kv.contiguous()
        if kv.is_cuda:
            from kvstore.codecs import triton_kernels  # noqa: PLC0415 (only with CUDA)

            buf = triton_kernels.int4_encode(kv, lay).cpu().numpy()
            parts = lay.carve(buf)
        else:
            buf = np.empty(lay.nbytes(), np.uint8)
            parts = lay.carve(buf)
            x = common.bits(kv)
            _encode_cpu(x, common.KINDS[kv.dtype], lay, parts)
            parts["sink"][:] = x[:, :, : lay.sink]
        _check_finite(parts)
        return memoryview(buf), lay.params()

    def payload_nbytes(self, params: dict, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        return Int4Layout.from_params(common.check_shape(shape, dtype, self.name), params, dtype).nbytes()

    def decode(
        self,
        payload: bytes | bytearray | memoryview,
        params: dict,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """Decode to a CPU tensor, or with `device="cuda"` on the GPU through the Triton kernel."""
        shape = common.check_shape(shape, dtype, self.name)
        lay = Int4Layout.from_params(shape, params, dtype)
        if len(payload) != lay.nbytes():
            raise CodecError(f"int4: payload is {len(payload)} bytes, shape {shape} needs {lay.nbytes()}")
        if device is not None and torch.device(device).type == "cuda":
            from kvstore.codecs import triton_kernels  # noqa: PLC0415

            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
            return triton_kernels.int4_decode(buf, lay, dtype)
        parts = lay.carve(common.payload_array(payload))
        out, obits = common.empty_bits(shape, dtype)
        _decode_cpu(parts, common.KINDS[dtype], lay, obits)
        obits[:, :, : lay.sink] = parts["sink"]
        return out


def _v(a: np.ndarray, *shape: int) -> np.ndarray:
    """A reshaped VIEW (the kernels write through it); raises instead of silently copying."""
    v = a.view()
    v.shape = shape
    return v


def _c(a: np.ndarray) -> np.ndarray:
    """A C-contiguous input for a kernel (a copy keeps the read-only flag). Every kernel argument is
    C-contiguous so that numba compiles one specialisation per dtype, not one per memory layout."""
    if a.flags.c_contiguous:
        return a
    b = np.ascontiguousarray(a)
    b.flags.writeable = a.flags.writeable
    return b


class _Out:
    """A C-contiguous output for a kernel, copied into the (strided) view on exit when needed."""

    def __init__(self, view: np.ndarray) -> None:
        self.view = view
        self.buf = view if view.flags.c_contiguous else np.empty(view.shape, view.dtype)

    def __enter__(self) -> np.ndarray:
        return self.buf

    def __exit__(self, *exc: object) -> None:
        if self.buf is not self.view and exc[0] is None:
            self.view[...] = self.buf


def _encode_cpu(x: np.ndarray, kind: int, lay: Int4Layout, p: dict[str, np.ndarray]) -> None:
    cpu_int4 = common.cpu_kernels("cpu_int4")
    _, nl, _, nh, d = lay.shape
    norm, tf, codes = np.float32(1 / math.sqrt(d)), lay.full_tokens, p["codes"]

    def rows_job(half: int, ts: slice, group: int, sz: str) -> None:
        rows = (ts.stop - ts.start) * nh
        with _Out(_v(codes[half, :, ts], nl, rows, d // 2)) as c:
            xs = _c(_v(x[half, :, ts], nl, rows, d))
            cpu_int4.encode_rows(xs, kind, group, lay.rotate, norm, c, _v(p[sz], nl, rows, d // group, 2))

    def channels_job() -> None:
        with _Out(_v(codes[0, :, :tf], nl, tf, nh * d // 2)) as c:
            cpu_int4.encode_channels(_c(_v(x[0, :, :tf], nl, tf, nh * d)), kind, lay.key_group, c, p["k_sz"])

    jobs = [lambda j=j: rows_job(*j) for j in row_jobs(lay)] + ([channels_job] if tf else [])
    common.run_parts(jobs)


def _decode_cpu(p: dict[str, np.ndarray], kind: int, lay: Int4Layout, out: np.ndarray) -> None:
    cpu_int4 = common.cpu_kernels("cpu_int4")
    _, nl, _, nh, d = lay.shape
    norm, tf, codes = np.float32(1 / math.sqrt(d)), lay.full_tokens, p["codes"]

    def rows_job(half: int, ts: slice, group: int, sz: str) -> None:
        rows = (ts.stop - ts.start) * nh
        with _Out(_v(out[half, :, ts], nl, rows, d)) as o:
            cs = _c(_v(codes[half, :, ts], nl, rows, d // 2))
            cpu_int4.decode_rows(cs, _c(_v(p[sz], nl, rows, d // group, 2)), kind, group, lay.rotate, norm, o)

    def channels_job() -> None:
        with _Out(_v(out[0, :, :tf], nl, tf, nh * d)) as o:
            cpu_int4.decode_channels(
                _c(_v(codes[0, :, :tf], nl, tf, nh * d // 2)), p["k_sz"], kind, lay.key_group, o
            )

    jobs = [lambda j=j: rows_job(*j) for j in row_jobs(lay)] + ([channels_job] if tf else [])
    common.run_parts(jobs)
