"""`raw`: the KV as it is, bit-exact."""

from __future__ import annotations

import math
from typing import Any

import torch

from kvstore.errors import CodecError, CorruptBlob


class RawCodec:
    name = "raw"
    codec_id = 0

    def encode(self, kv: torch.Tensor, **options: Any) -> tuple[memoryview, dict]:
        if options:
            raise CodecError(f"raw codec takes no options, got {sorted(options)}")
        kv = kv.detach().to("cpu").contiguous()
        # view as bytes without a copy (bfloat16 has no numpy dtype, so go through uint8)
        return memoryview(kv.view(torch.uint8).numpy()).cast("B"), {}

    def payload_nbytes(self, params: dict, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        if params:
            raise CodecError(f"raw codec has no params, got {sorted(params)!r:.80}")
        return math.prod(shape) * dtype.itemsize  # python ints: a forged shape cannot wrap

    def decode(
        self,
        payload: bytes | bytearray | memoryview,
        params: dict,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """The KV as stored, on the CPU or copied to `device`."""
        expected = self.payload_nbytes(params, shape, dtype)
        if len(payload) != expected:
            raise CorruptBlob(f"raw payload is {len(payload)} bytes, shape {shape} needs {expected}")
        out = torch.empty(shape, dtype=dtype)
        out.view(torch.uint8).view(-1).numpy()[:] = memoryview(payload).cast("B")
        return out if device is None else out.to(device)
