"""vLLM's hybrid KV cache manager: several KV cache groups, each with its own block table, moved through
one inner layout into and out of one chunk of all layers."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from kvstore.connectors.chunks import CacheGeometry
from kvstore.connectors.layouts import PagedLayout


class GroupedLayout:
    """vLLM's hybrid KV cache manager (HMA): layers in several KV cache groups, each with its own block
    table. Block ids are then tuples, one id per group (`block_ids[j][g]`: the j-th block of group g);
    every group's layers move through `inner` with their own ids, into and out of one chunk of all layers.
    A sliding-window group (`windowed`) keeps only its last window of blocks: vLLM gives the others as
    its null block (id 0), which a load skips (a window layer needs only its window; the chunk holds it)."""

    NULL_BLOCK = 0

    def __init__(self, inner: PagedLayout, layer_groups: Sequence[int], windowed: set[int]) -> None:
        self.inner = inner
        self.name = f"{inner.name}+groups"
        self.windowed = set(windowed)
        self._layers: dict[int, list[int]] = {}
        for layer, g in enumerate(layer_groups):
            self._layers.setdefault(g, []).append(layer)

    def geometry(self, kv_caches: Sequence[torch.Tensor]) -> CacheGeometry:
        return self.inner.geometry(kv_caches)

    def gather(
        self,
        kv_caches: Sequence[torch.Tensor],
        block_ids: Sequence[Sequence[int]],
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        parts = {}
        for g, layers in self._layers.items():
            ids = [b[g] for b in block_ids]
            parts[g] = (layers, self.inner.gather([kv_caches[i] for i in layers], ids))
        first = next(iter(parts.values()))[1]
        shape = (first.shape[0], len(kv_caches), *first.shape[2:])
        if out is None:
            out = torch.empty(shape, dtype=first.dtype, device=first.device)
        for layers, part in parts.values():
            out[:, layers] = part
        return out

    def scatter(
        self,
        kv_caches: Sequence[torch.Tensor],
        chunk: torch.Tensor,
        block_ids: Sequence[Sequence[int]],
        first_block: int = 0,
    ) -> None:
        for g, layers in self._layers.items():
            ids = [b[g] for b in block_ids]
            caches = [kv_caches[i] for i in layers]
            sub = chunk[:, layers]
            j = 0
            while j < len(ids):  # each run of real blocks (a window group's are a suffix: one run)
                if g in self.windowed and ids[j] == self.NULL_BLOCK:
                    j += 1
                    continue
                k = j
                while k < len(ids) and not (g in self.windowed and ids[k] == self.NULL_BLOCK):
                    k += 1
                self.inner.scatter(caches, sub, ids[j:k], first_block + j)
                j = k
