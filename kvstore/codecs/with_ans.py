"""`<codec>+ans`: a quantising codec whose codes then go through the lossless rANS stage (ans.py).

`kivi4+ans` (id 5), `kivi2+ans` (id 6), `int4+ans` (id 7), `fp8+ans` (id 8) take their base codec's
options and decode to exactly what the base codec decodes to. The codes are coded per layer and per
K/V half, one probability table each (the statistics of a layer's keys differ from its values').

Payload: the rANS stream of every code segment (keys of layer 0..L-1, then values), then the base
payload without its code sections, in order. Params: the base codec's, plus `ans` = the stream's
length (the reader checks it against the bounds a stream of these segments can have).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from kvstore.codecs import ans, common
from kvstore.codecs.fp8 import Fp8Codec
from kvstore.codecs.int4 import Int4Codec
from kvstore.codecs.int4_layout import Int4Layout
from kvstore.codecs.kivi import KiviCodec, KiviLayout
from kvstore.errors import CodecError

Section = tuple[int, int, int]  # offset, bytes, segments (each section splits into equal segments)


def _offsets(sections: common.Sections) -> dict[str, tuple[int, int]]:
    out, pos = {}, 0
    for name, t, s in sections:
        n = common.sections_nbytes([(name, t, s)])
        out[name] = (pos, n)
        pos += n
    return out


class AnsCodec:
    def __init__(self, base: Any, codec_id: int) -> None:
        self.base, self.codec_id, self.name = base, codec_id, f"{base.name}+ans"

    def code_sections(
        self, params: dict, shape: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[int, list[Section]]:
        """(bits, the code sections of the base payload) for these base params."""
        nl = shape[1]
        if isinstance(self.base, KiviCodec):
            lay = KiviLayout.from_params(shape, params, dtype, self.base.bits)
            at = _offsets(lay.sections())
            return lay.bits, [(*at["k_codes"], nl), (*at["v_codes"], nl)]
        if isinstance(self.base, Int4Codec):
            at = _offsets(Int4Layout.from_params(shape, params, dtype).sections())
            return 4, [(*at["codes"], 2 * nl)]
        self.base.payload_nbytes(params, shape, dtype)  # fp8: validates the params
        return 8, [(0, math.prod(shape), 2 * nl)]

    def _split(self, params: dict, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[dict, int, int, list]:
        if "ans" not in params or type(params["ans"]) is not int:
            raise CodecError(f"{self.name}: bad params {params!r:.80}")
        base_params = {k: v for k, v in params.items() if k != "ans"}
        bits, sections = self.code_sections(base_params, shape, dtype)
        return base_params, params["ans"], bits, sections

    def encode(self, kv: torch.Tensor, **options: Any) -> tuple[bytes, dict]:
        payload, params = self.base.encode(kv, **options)
        return self.wrap(payload, params, tuple(kv.shape), kv.dtype)

    def wrap(
        self,
        payload: bytes | bytearray | memoryview,
        params: dict,
        shape: tuple[int, ...],
        dtype: torch.dtype,
    ) -> tuple[bytes, dict]:
        """A base codec's payload and params with its codes through the rANS stage."""
        data = np.frombuffer(memoryview(payload).cast("B"), np.uint8)
        bits, sections = self.code_sections(params, shape, dtype)
        segments, ns, rest, pos = [], [], [], 0
        for off, size, nseg in sections:
            rest.append(data[pos:off])
            part = data[off : off + size].reshape(nseg, -1)
            segments += list(part)
            ns += [part.shape[1] * 8 // bits] * nseg
            pos = off + size
        rest.append(data[pos:])
        stream = ans.encode_segments(segments, ns, bits)
        return b"".join([stream, *(r.tobytes() for r in rest)]), {**params, "ans": len(stream)}

    def payload_nbytes(self, params: dict, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        shape = common.check_shape(shape, dtype, self.name)
        base_params, n, _, sections = self._split(params, shape, dtype)
        codes, nseg = sum(s for _, s, _ in sections), sum(k for *_, k in sections)
        if not nseg <= n <= codes + nseg:  # each segment: a mode byte, then at most its raw codes
            raise CodecError(f"{self.name}: a stream of {n} bytes cannot hold these codes")
        return n + self.base.payload_nbytes(base_params, shape, dtype) - codes

    def decode(
        self,
        payload: bytes | bytearray | memoryview,
        params: dict,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """Decode to a CPU tensor, or with `device="cuda"` on the GPU through the Triton kernels."""
        if device is not None and torch.device(device).type == "cuda":
            return self.decode_device(payload, params, shape, dtype, device)
        base, base_params = self.unwrap(payload, params, shape, dtype)
        return self.base.decode(base, base_params, common.check_shape(shape, dtype, self.name), dtype)

    def _plan(
        self, view: memoryview, params: dict, shape: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[dict, int, int, list[int], list[int], list[tuple[int, int, int]], int]:
        """(base params, stream length, bits, each segment's n and offset in the base payload, the
        (source, destination, length) copies of the base payload between its code sections, its size)."""
        if len(view) != self.payload_nbytes(params, shape, dtype):
            raise CodecError(f"{self.name}: payload of {len(view)} bytes does not match its params")
        base_params, n, bits, sections = self._split(params, shape, dtype)
        ns = [size // nseg * 8 // bits for _, size, nseg in sections for _ in range(nseg)]
        at = [off + k * size // nseg for off, size, nseg in sections for k in range(nseg)]
        total = self.base.payload_nbytes(base_params, shape, dtype)
        copies, src, pos = [], n, 0
        for off, size, _ in sections:  # the base payload between its code sections, as it was
            copies.append((src, pos, off - pos))
            src += off - pos
            pos = off + size
        copies.append((src, pos, total - pos))
        return base_params, n, bits, ns, at, copies, total

    def unwrap(
        self,
        payload: bytes | bytearray | memoryview,
        params: dict,
        shape: tuple[int, ...],
        dtype: torch.dtype,
    ) -> tuple[memoryview, dict]:
        """The base codec's payload and params (CodecError for a payload that does not decode)."""
        shape = common.check_shape(shape, dtype, self.name)
        view = memoryview(payload).cast("B")
        base_params, n, bits, ns, at, copies, total = self._plan(view, params, shape, dtype)
        out = np.empty(total, np.uint8)
        for src, dst, size in copies:
            out[dst : dst + size] = view[src : src + size]
        ans.decode_into(view[:n], ns, bits, out, at)  # the codes straight into their sections
        return memoryview(out), base_params

    def decode_device(
        self,
        payload: bytes | bytearray | memoryview,
        params: dict,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> torch.Tensor:
        """The KV on `device` (CUDA; a CPU device under TRITON_INTERPRET=1 in tests): the payload
        copied there once, the codes decoded there (triton_ans.py), then the base codec's kernels."""
        from kvstore.codecs import triton_ans  # noqa: PLC0415 (Triton: only on this path)

        shape = common.check_shape(shape, dtype, self.name)
        view = memoryview(payload).cast("B")
        base_params, n, bits, ns, at, copies, total = self._plan(view, params, shape, dtype)
        src = torch.frombuffer(bytearray(view), dtype=torch.uint8).to(device)
        out = torch.empty(total, dtype=torch.uint8, device=src.device)
        for s, d, size in copies:
            out[d : d + size] = src[s : s + size]
        triton_ans.decode_into(view[:n], ns, bits, out, at, src=src[:n])
        return triton_ans.decode_base(self.base, out, base_params, shape, dtype)


def codecs() -> list[AnsCodec]:
    return [
        AnsCodec(KiviCodec(4, codec_id=3), 5),
        AnsCodec(KiviCodec(2, codec_id=4), 6),
        AnsCodec(Int4Codec(), 7),
        AnsCodec(Fp8Codec(), 8),
    ]


__all__ = ["AnsCodec", "codecs"]
