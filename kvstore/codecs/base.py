"""The codec protocol: how a KV tensor becomes a blob payload and back (docs/design.md §3)."""

from __future__ import annotations

from typing import Any, Protocol

import torch


class Codec(Protocol):
    """A codec turns a KV tensor `[2, L, T, H, D]` into payload bytes plus small params, and back.

    `params` must be msgpack-serialisable (ints, floats, strings): they travel in the blob header.
    `decode` gets the original shape and dtype from the header and must return exactly that, on
    `device` (None: the CPU): every codec takes it, and decodes on a CUDA device where it has kernels
    there (fp8, int4, kivi, the `+ans` stage), else on the CPU and moves the result.
    """

    name: str
    codec_id: int

    def encode(self, kv: torch.Tensor, **options: Any) -> tuple[bytes | bytearray | memoryview, dict]: ...

    def decode(
        self,
        payload: bytes | bytearray | memoryview,
        params: dict,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> torch.Tensor: ...

    def payload_nbytes(self, params: dict, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """The exact payload size `encode` gives for this header (CodecError for impossible params):
        every blob is checked against it before a tier stores it or a reader decodes it."""
        ...
