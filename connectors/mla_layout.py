"""vLLM's MLA caches <-> the canonical chunk's one latent plane (the `VllmMlaLayout` row of
`kvstore.connectors.layouts`' table)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from kvstore.connectors.chunks import CacheGeometry

from kvstore.errors import InvalidArgument


class VllmMlaLayout:
    """vLLM's MLA caches: a per-layer tensor whose blocks are `block_size` rows of the latent (the
    compressed KV, then the rope part of the key), written by `concat_and_cache_mla` (checked against
    vLLM's own CPU writer by the connector at startup and by the tests). The chunk holds one plane:
    `[1, L, T, 1, D]`."""

    name = "vllm-mla"

    @staticmethod
    def _rows(cache: torch.Tensor) -> torch.Tensor:
        """`[num_blocks, block_size, D]` over the cache."""
        return cache.view(cache.shape[0], cache.shape[-2], cache.shape[-1])

    def geometry(self, kv_caches: Sequence[torch.Tensor]) -> CacheGeometry:
        if not kv_caches:
            raise InvalidArgument("register_kv_caches needs at least one layer")
        first = kv_caches[0]
        if (
            first.dim() not in (3, 4)
            or (first.dim() == 4 and first.shape[1] != 1)
            or not first.is_contiguous()
        ):
            raise InvalidArgument(
                f"an MLA KV cache is a contiguous [num_blocks, (1,) block_size, D], got {tuple(first.shape)}"
            )
        for i, c in enumerate(kv_caches):
            if c.shape != first.shape or c.dtype != first.dtype or c.device != first.device:
                raise InvalidArgument(f"layer {i} KV cache {tuple(c.shape)} {c.dtype} differs from layer 0")
        nb, bs, d = first.shape[0], first.shape[-2], first.shape[-1]
        return CacheGeometry(len(kv_caches), nb, bs, 1, d, first.dtype, planes=1)

    def gather(
        self,
        kv_caches: Sequence[torch.Tensor],
        block_ids: Sequence[int],
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        first = kv_caches[0]
        bs, d = first.shape[-2], first.shape[-1]
        n = len(block_ids)
        shape = (1, len(kv_caches), n * bs, 1, d)
        if out is None:
            out = torch.empty(shape, dtype=first.dtype, device=first.device)
        assert tuple(out.shape) == shape and out.dtype == first.dtype and out.is_contiguous(), out.shape
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=first.device)
        for layer, cache in enumerate(kv_caches):
            torch.index_select(self._rows(cache), 0, idx, out=out[0, layer].view(n, bs, d))
        return out

    def scatter(
        self,
        kv_caches: Sequence[torch.Tensor],
        chunk: torch.Tensor,
        block_ids: Sequence[int],
        first_block: int = 0,
    ) -> None:
        first = kv_caches[0]
        bs, d = first.shape[-2], first.shape[-1]
        n = len(block_ids)
        lo, hi = first_block * bs, (first_block + n) * bs
        if (
            chunk.dim() != 5
            or chunk.shape[:2] != (1, len(kv_caches))
            or chunk.shape[2] < hi
            or chunk.shape[3:] != (1, d)
        ):
            raise InvalidArgument(
                f"chunk {tuple(chunk.shape)} does not cover blocks {first_block}..{first_block + n} of a latent of {d}"
            )
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=first.device)
        for layer, cache in enumerate(kv_caches):
            src = chunk[0, layer, lo:hi, 0].to(device=first.device, dtype=first.dtype)
            self._rows(cache).index_copy_(0, idx, src.reshape(n, bs, d))
