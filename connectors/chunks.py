"""Engine blocks <-> store chunks.

The engine keeps KV per layer in paged caches `[2, num_blocks, block_size, kv_heads, head_dim]`; the
store keeps one blob per `chunk_size` tokens holding every layer, `[2, num_layers, chunk_size,
kv_heads, head_dim]` (docs/design.md §2). A chunk is `chunk_size // block_size` consecutive blocks of
a request's block table. `gather_chunk` copies a chunk out of the cache (the copy is what makes an
asynchronous save safe: the blocks may be freed the moment it returns); `scatter_chunk` writes a
loaded chunk, or a block-aligned part of it, back into the request's blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kvstore.errors import InvalidArgument
from kvstore.keys import KVLayout, hash_block, hash_partials, root_key


@dataclass(frozen=True)
class CacheGeometry:
    """The paged cache as registered by the engine."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    planes: int = 2  # K and V; 1 for an MLA cache's latent (one vector per token)

    @classmethod
    def of(cls, kv_caches: Sequence[torch.Tensor]) -> CacheGeometry:
        if not kv_caches:
            raise InvalidArgument("register_kv_caches needs at least one layer")
        first = kv_caches[0]
        if first.dim() != 5 or first.shape[0] != 2:
            raise InvalidArgument(
                f"a layer's KV cache must be [2, num_blocks, block_size, kv_heads, head_dim], got {tuple(first.shape)}"
            )
        for i, c in enumerate(kv_caches):
            if c.shape != first.shape or c.dtype != first.dtype or c.device != first.device:
                raise InvalidArgument(f"layer {i} KV cache {tuple(c.shape)} {c.dtype} differs from layer 0")
        _, nb, bs, h, d = first.shape
        return cls(len(kv_caches), nb, bs, h, d, first.dtype)

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        return (self.planes, self.num_layers, num_tokens, self.num_kv_heads, self.head_dim)


def _index(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(list(block_ids), dtype=torch.long, device=device)


def gather_chunk(
    kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], out: torch.Tensor | None = None
) -> torch.Tensor:
    """Blocks `block_ids` of every layer, in order, as `[2, L, len(block_ids) * block_size, H, D]`.

    A copy: into `out` when given (a reused buffer saves the page faults of a fresh one, which cost
    more than the copy itself), else into a fresh tensor on the caches' device.
    """
    first = kv_caches[0]
    _, _, bs, h, d = first.shape
    n = len(block_ids)
    shape = (2, len(kv_caches), n * bs, h, d)
    if out is None:
        out = torch.empty(shape, dtype=first.dtype, device=first.device)
    assert tuple(out.shape) == shape and out.dtype == first.dtype and out.is_contiguous(), out.shape
    idx = _index(block_ids, first.device)
    blocks = out.view(2, len(kv_caches), n, bs, h, d)
    for layer, cache in enumerate(kv_caches):
        for kv in (0, 1):  # cache[kv] and blocks[kv, layer] are contiguous: one gather, no temporary
            torch.index_select(cache[kv], 0, idx, out=blocks[kv, layer])
    return out


def scatter_chunk(
    kv_caches: Sequence[torch.Tensor], chunk: torch.Tensor, block_ids: Sequence[int], first_block: int = 0
) -> None:
    """Write blocks `first_block .. first_block + len(block_ids)` of `chunk` into `block_ids`."""
    first = kv_caches[0]
    _, _, bs, h, d = first.shape
    n = len(block_ids)
    lo, hi = first_block * bs, (first_block + n) * bs
    if chunk.dim() != 5 or chunk.shape[:2] != (2, len(kv_caches)) or chunk.shape[2] < hi:
        raise InvalidArgument(
            f"chunk {tuple(chunk.shape)} does not cover blocks {first_block}..{first_block + n}"
        )
    if chunk.shape[3:] != (h, d):
        raise InvalidArgument(
            f"chunk {tuple(chunk.shape)} does not match the cache's heads/head_dim {(h, d)}"
        )
    src = chunk.to(device=first.device, dtype=first.dtype)
    if first.dtype == torch.float8_e4m3fn:  # index_copy_ has no fp8 kernel: copy the bytes
        src, kv_caches = src.view(torch.uint8), [c.view(torch.uint8) for c in kv_caches]
    idx = _index(block_ids, first.device)
    for layer, cache in enumerate(kv_caches):
        for kv in (0, 1):
            cache[kv].index_copy_(0, idx, src[kv, layer, lo:hi].view(n, bs, h, d))


def key_extra(request: object) -> bytes:
    """Spec 1's extra keys of a request: its `cache_salt` (vLLM's per-request cache isolation) and its
    LoRA adapter, so that a salted or adapted request never shares KV with another. Empty for a plain
    request, whose keys are then those of `kvstore.keys.chunk_keys`."""
    parts = []
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(b"salt:" + str(salt).encode())
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(b"lora:" + str(getattr(lora, "lora_name", lora)).encode())
    return b"\0".join(parts)


class ChunkKeys:
    """Chained chunk keys of one growing token sequence (Spec 1), extended as chunks fill up.

    Equal to `kvstore.keys.chunk_keys(tokens, layout, namespace, extra)` for every prefix; each new
    chunk costs one hash, so calling `update` every engine step stays cheap. `partial_keys` gives the
    keys a trailing partial chunk of these tokens would have been stored under (Spec 1's partial keys).
    """

    def __init__(self, layout: KVLayout, namespace: str = "", extra: bytes = b"") -> None:
        self.chunk_size = layout.chunk_size
        self.extra = extra
        self.parents: list[bytes] = [root_key(layout, namespace)]  # parents[i]: the parent of chunk i
        self._last_chunk: list[int] = []
        self.keys: list[str] = []

    def update(self, tokens: Sequence[int]) -> list[str]:
        n = self.chunk_size
        have = len(self.keys)
        assert list(tokens[(have - 1) * n : have * n]) == self._last_chunk if have else True, (
            "a request's tokens never change, they only grow"
        )
        for i in range(have, len(tokens) // n):
            self._last_chunk = list(tokens[i * n : (i + 1) * n])
            self.parents.append(hash_block(self.parents[-1], self._last_chunk, self.extra))
            self.keys.append(self.parents[-1].hex())
        return self.keys

    def partial_keys(self, tokens: Sequence[int], chunk: int, lengths: Iterable[int]) -> list[str]:
        """Keys of partial chunks at chunk index `chunk` holding the first `n` tokens of it, per n."""
        assert chunk <= len(self.keys), "update() the keys up to the chunk first"
        start = chunk * self.chunk_size
        lengths = list(lengths)
        assert all(n < self.chunk_size for n in lengths), lengths
        body = tokens[start : start + max(lengths, default=0)]
        return [k.hex() for k in hash_partials(self.parents[chunk], body, lengths, self.extra)]
