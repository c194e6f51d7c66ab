"""Paged KV layouts <-> the canonical chunk, one vectorised place per engine layout (docs/design.md §2).

Every blob holds a chunk as `[2, num_layers, chunk_tokens, num_kv_heads, head_dim]` whatever the engine
keeps in its paged cache, so KV stored by one engine loads into another. A layout moves whole blocks:
`gather` copies blocks out of every layer's cache into a canonical chunk (a copy, so an asynchronous
save is safe once it returns), `scatter` writes blocks of a canonical chunk back into a request's
blocks. Per layer and call: a strided (permuting) copy of K and one of V per run of consecutive
blocks, or (more than MAX_RUNS runs) one indexed copy of the blocks and the strided ones through a
scratch; no per-token loops.

| layout | per-layer cache tensor | who |
|---|---|---|
| `EngineLayout` | `[2, num_blocks, block_size, H, D]` | the bundled engine |
| `VllmCpuLayout` | `[num_blocks, H, block_size, 2*D]`, contiguous; each (block, head) slab is K **transposed** `[D, block_size]` then V `[block_size, D]` | vLLM's CPU attention backend |
| `VllmCpuAmxLayout` | the same tensor; with AMX tiles (bf16, block_size a multiple of 32) each slab is K as `[block_size/16, D/2, 16, 2]` (16 tokens by pairs of dims) then V as `[D/16, block_size/2, 16, 2]` (16 dims by pairs of tokens) | vLLM's CPU attention on AMX CPUs |
| `VllmMlaLayout` | `[num_blocks, block_size, D]` (CPU: `[num_blocks, 1, block_size, D]`), one latent row per token (`kv_lora_rank` then `qk_rope_head_dim` values); the chunk is `[1, L, T, 1, D]` | vLLM's MLA backends (CPU_MLA, AMX MLA) |
| `VllmCudaLayout` | logical `[num_blocks, H, block_size, 2*D]` (any strides: flash-attn's NHD memory is `[num_blocks, block_size, H, 2*D]`), K = `[..., :D]`, V = `[..., D:]` | vLLM CUDA (flash-attn, FlashInfer NHD/HND) |
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

import torch
from kvstore.connectors import layout_c
from kvstore.connectors.chunks import CacheGeometry, gather_chunk, scatter_chunk

from kvstore.errors import InvalidArgument


class PagedLayout(Protocol):
    name: str

    def geometry(self, kv_caches: Sequence[torch.Tensor]) -> CacheGeometry: ...

    def gather(
        self,
        kv_caches: Sequence[torch.Tensor],
        block_ids: Sequence[int],
        out: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def scatter(
        self,
        kv_caches: Sequence[torch.Tensor],
        chunk: torch.Tensor,
        block_ids: Sequence[int],
        first_block: int = 0,
    ) -> None: ...


class EngineLayout:
    """The bundled engine's cache is already block-major NHD: `kvstore.connectors.chunks` moves it as is."""

    name = "engine"

    def geometry(self, kv_caches: Sequence[torch.Tensor]) -> CacheGeometry:
        return CacheGeometry.of(kv_caches)

    def gather(
        self,
        kv_caches: Sequence[torch.Tensor],
        block_ids: Sequence[int],
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return gather_chunk(kv_caches, block_ids, out)

    def scatter(
        self,
        kv_caches: Sequence[torch.Tensor],
        chunk: torch.Tensor,
        block_ids: Sequence[int],
        first_block: int = 0,
    ) -> None:
        scatter_chunk(kv_caches, chunk, block_ids, first_block)


# Block ids in at most this many runs of consecutive ids are copied run by run, straight between the
# cache and the chunk; more, and one indexed copy through a scratch of the blocks costs less.
MAX_RUNS = 4


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first block id, its index in `block_ids`, length) of each run of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(block_ids):
        if runs and runs[-1][0] + runs[-1][2] == b:
            first, at, r = runs[-1]
            runs[-1] = (first, at, r + 1)
        else:
            runs.append((b, i, 1))
    return runs


class _BlockMajorLayout:
    """Shared by the vLLM layouts: a per-layer cache `[num_blocks, H, block_size, 2*D]` whose blocks are
    copied run by run where the block ids are a few runs of consecutive ids (vLLM's free-block queue
    hands them out so), else selected with one `index_select` / `index_copy_` into a per-thread scratch;
    subclasses say how K and V sit inside a block (`_split`)."""

    name = "block-major"
    c_path = False  # connectors/layout_c.py moves this layout's blocks (where it can; else torch)
    k_pairs = False  # K's last dim is pairs of 2-byte values contiguous on both sides: copied as int32

    def __init__(self) -> None:
        self._scratch = threading.local()  # loads run on several threads, saves on the engine's
        self._whole: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _kv_of(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) views of every block of `cache` (`_split` of the whole cache, made once per cache)."""
        got = self._whole.get(id(cache))
        if got is None or got[0] is not cache:
            got = self._whole[id(cache)] = (cache, *self._split(cache))
        return got[1], got[2]

    def _check(self, cache: torch.Tensor) -> None:
        """Subclasses refuse a tensor whose memory they cannot read."""

    def geometry(self, kv_caches: Sequence[torch.Tensor]) -> CacheGeometry:
        if not kv_caches:
            raise InvalidArgument("register_kv_caches needs at least one layer")
        first = kv_caches[0]
        if first.dim() != 4 or first.shape[-1] % 2:
            raise InvalidArgument(
                f"a {self.name} KV cache is [num_blocks, kv_heads, block_size, 2*head_dim], got {tuple(first.shape)}"
            )
        for i, c in enumerate(kv_caches):
            if c.shape != first.shape or c.dtype != first.dtype or c.device != first.device:
                raise InvalidArgument(f"layer {i} KV cache {tuple(c.shape)} {c.dtype} differs from layer 0")
            self._check(c)
        nb, h, bs, d2 = first.shape
        return CacheGeometry(len(kv_caches), nb, bs, h, d2 // 2, first.dtype)

    def _blocks(self, cache: torch.Tensor, n: int) -> torch.Tensor:
        """This thread's reusable `[n, H, block_size, 2*D]` buffer on the cache's device."""
        shape = (n, *cache.shape[1:])
        buf = getattr(self._scratch, "buf", None)
        if (
            buf is None
            or buf.dtype != cache.dtype
            or buf.device != cache.device
            or buf.numel() < cache[0].numel() * n
        ):
            buf = self._scratch.buf = torch.empty(
                cache[0].numel() * n, dtype=cache.dtype, device=cache.device
            )
        return buf[: cache[0].numel() * n].view(shape)

    def _split(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of `blocks` `[n, H, bs, 2*D]`, each viewed as `[n, block_size, H, D]` or as a shape
        that only splits those dimensions (a tiled block cannot be one strided view of them)."""
        raise NotImplementedError

    def gather(
        self,
        kv_caches: Sequence[torch.Tensor],
        block_ids: Sequence[int],
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        first = kv_caches[0]
        _, h, bs, d2 = first.shape
        n = len(block_ids)
        shape = (2, len(kv_caches), n * bs, h, d2 // 2)
        if out is None:
            out = torch.empty(shape, dtype=first.dtype, device=first.device)
        assert tuple(out.shape) == shape and out.dtype == first.dtype and out.is_contiguous(), out.shape
        if self.c_path and layout_c.gather(kv_caches, block_ids, out):
            return out
        view = out.view(2, len(kv_caches), n, bs, h, d2 // 2)
        runs = block_runs(block_ids)
        if len(runs) <= MAX_RUNS:  # straight out of the cache: no scratch, no indexed copy
            for layer, cache in enumerate(kv_caches):
                k, v = self._kv_of(cache)
                for b, i, r in runs:
                    kb, vb, dst = k[b : b + r], v[b : b + r], view[:, layer, i : i + r]
                    _copy_k(dst[0].view(kb.shape), kb, self.k_pairs)
                    dst[1].view(vb.shape).copy_(vb)
            return out
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=first.device)
        for layer, cache in enumerate(kv_caches):
            blocks = torch.index_select(cache, 0, idx, out=self._blocks(cache, n))
            k, v = self._split(blocks)
            _copy_k(view[0, layer].view(k.shape), k, self.k_pairs)
            view[1, layer].view(v.shape).copy_(v)
        return out

    def scatter(
        self,
        kv_caches: Sequence[torch.Tensor],
        chunk: torch.Tensor,
        block_ids: Sequence[int],
        first_block: int = 0,
    ) -> None:
        first = kv_caches[0]
        _, h, bs, d2 = first.shape
        n = len(block_ids)
        lo, hi = first_block * bs, (first_block + n) * bs
        if chunk.dim() != 5 or chunk.shape[:2] != (2, len(kv_caches)) or chunk.shape[2] < hi:
            raise InvalidArgument(
                f"chunk {tuple(chunk.shape)} does not cover blocks {first_block}..{first_block + n}"
            )
        if chunk.shape[3:] != (h, d2 // 2):
            raise InvalidArgument(
                f"chunk {tuple(chunk.shape)} does not match the cache's heads/head_dim {(h, d2 // 2)}"
            )
        if self.c_path and layout_c.scatter(kv_caches, chunk, block_ids, first_block):
            return
        runs = block_runs(block_ids)
        if len(runs) <= MAX_RUNS:  # straight into the cache: no scratch, no indexed copy
            for layer, cache in enumerate(kv_caches):
                k, v = self._kv_of(cache)
                for b, i, r in runs:
                    kb, vb, src = (
                        k[b : b + r],
                        v[b : b + r],
                        chunk[:, layer, lo + i * bs : lo + (i + r) * bs],
                    )
                    _copy_k(kb, src[0].view(kb.shape), self.k_pairs)  # casts and moves to the cache's device
                    vb.copy_(src[1].view(vb.shape))
            return
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=first.device)
        for layer, cache in enumerate(kv_caches):
            blocks = self._blocks(cache, n)
            k, v = self._split(blocks)
            _copy_k(
                k, chunk[0, layer, lo:hi].view(k.shape), self.k_pairs
            )  # casts, moves to the cache's device
            v.copy_(chunk[1, layer, lo:hi].view(v.shape))
            cache.index_copy_(0, idx, blocks)


def _copy_k(dst: torch.Tensor, src: torch.Tensor, pairs: bool) -> None:
    """dst.copy_(src); with `pairs` (both end in a dim of 2 contiguous 2-byte values of one dtype) as
    int32 pairs: a strided copy of half as many elements, ~4x faster than one of bf16 values."""
    if pairs and dst.dtype == src.dtype and dst.element_size() == 2 and dst.device == src.device:
        try:
            dst.view(torch.int32).copy_(src.view(torch.int32))
            return
        except RuntimeError:  # a view the dtype change cannot take (a last dim that is not contiguous)
            pass
    dst.copy_(src)


class VllmCpuLayout(_BlockMajorLayout):
    """vLLM's CPU attention: a (block, head) slab of `2 * block_size * D` elements is K as `[D, block_size]`
    followed by V as `[block_size, D]` (checked against vLLM's own `cpu_attn_reshape_and_cache` by the
    connector at startup and by the tests)."""

    name = "vllm-cpu"
    c_path = True

    def _check(self, cache: torch.Tensor) -> None:
        if not cache.is_contiguous():
            raise InvalidArgument("vLLM's CPU KV cache is contiguous; this one is not (another backend?)")

    def _split(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, h, bs, d2 = blocks.shape
        slab = blocks.view(n, h, 2, bs * (d2 // 2))
        k = slab[:, :, 0].view(n, h, d2 // 2, bs).permute(0, 3, 1, 2)  # [n, bs, H, D]
        v = slab[:, :, 1].view(n, h, bs, d2 // 2).permute(0, 2, 1, 3)
        return k, v


class VllmCpuAmxLayout(VllmCpuLayout):
    """vLLM's CPU attention on AMX tiles (what `_get_attn_isa` picks for bf16 with a block_size that is
    a multiple of 32 on a CPU with AMX): per (block, head) slab, K as `[block_size/16, D/2, 16, 2]` and
    V as `[D/16, block_size/2, 16, 2]` (checked against vLLM's writer at startup and by the tests)."""

    name = "vllm-cpu-amx"
    c_path = False  # tiles: the torch path
    k_pairs = True  # K tiles hold (token, pair of dims): the pairs move as int32

    def _check(self, cache: torch.Tensor) -> None:
        super()._check(cache)
        _, _, bs, d2 = cache.shape
        if bs % 16 or (d2 // 2) % 16:
            raise InvalidArgument(f"an AMX block is tiled by 16: block_size {bs}, head_dim {d2 // 2}")

    def _split(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, h, bs, d2 = blocks.shape
        d = d2 // 2
        slab = blocks.view(n, h, 2, bs * d)
        # K[t, j] = tile t // 16, pair j // 2, token t % 16, j % 2 -> [n, bs/16, 16, H, D/2, 2]
        k = slab[:, :, 0].view(n, h, bs // 16, d // 2, 16, 2).permute(0, 2, 4, 1, 3, 5)
        # V[t, j] = tile j // 16, pair t // 2, dim j % 16, t % 2 -> [n, bs/2, 2, H, D/16, 16]
        v = slab[:, :, 1].view(n, h, d // 16, bs // 2, 16, 2).permute(0, 3, 5, 1, 2, 4)
        return k, v


class VllmCudaLayout(_BlockMajorLayout):
    """vLLM on CUDA: the per-layer tensor is the logical `[num_blocks, H, block_size, 2*D]` view with K
    in the first and V in the second half of the last dim, whatever its strides (NHD or HND memory)."""

    name = "vllm-cuda"

    def _split(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = blocks.shape[-1] // 2
        return blocks[..., :d].transpose(1, 2), blocks[..., d:].transpose(1, 2)


ENGINE_LAYOUT = EngineLayout()
