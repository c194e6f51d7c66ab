"""Engine blocks <-> store chunks: gather/scatter on real paged caches, incremental chunk keys."""

from __future__ import annotations

import random

import pytest
import torch
from kvstore.connectors.chunks import CacheGeometry, ChunkKeys, gather_chunk, scatter_chunk

from kvstore.errors import InvalidArgument
from kvstore.keys import KVLayout, chunk_keys

L, NB, BS, H, D = 4, 64, 16, 2, 8


def caches(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, NB, BS, H, D, generator=g).to(dtype) for _ in range(L)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gather_is_the_blocks_in_order(dtype: torch.dtype) -> None:
    kv = caches(dtype)
    blocks = random.Random(1).sample(range(NB), 16)
    chunk = gather_chunk(kv, blocks)
    assert chunk.shape == (2, L, 16 * BS, H, D) and chunk.dtype == dtype and chunk.is_contiguous()
    for i, b in enumerate(blocks):
        for layer in range(L):
            assert torch.equal(chunk[:, layer, i * BS : (i + 1) * BS], kv[layer][:, b])


def test_gather_is_a_copy_the_cache_can_overwrite() -> None:
    kv = caches()
    chunk = gather_chunk(kv, [3, 4, 5])
    snapshot = chunk.clone()
    for c in kv:
        c.zero_()
    assert torch.equal(chunk, snapshot)


def test_scatter_round_trip_and_partial_range() -> None:
    src = caches()
    src_blocks = random.Random(2).sample(range(NB), 16)
    chunk = gather_chunk(src, src_blocks)
    dst = [torch.zeros_like(c) for c in src]
    dst_blocks = random.Random(3).sample(range(NB), 16)
    scatter_chunk(dst, chunk, dst_blocks)
    for layer in range(L):
        assert torch.equal(dst[layer][:, dst_blocks], src[layer][:, src_blocks])

    # only blocks 10..15 of the chunk (the engine already holds 0..9 itself)
    part = [torch.zeros_like(c) for c in src]
    scatter_chunk(part, chunk, dst_blocks[10:], first_block=10)
    for layer in range(L):
        assert torch.equal(part[layer][:, dst_blocks[10:]], src[layer][:, src_blocks[10:]])
        untouched = [b for b in range(NB) if b not in dst_blocks[10:]]
        assert not part[layer][:, untouched].any()


def test_scatter_rejects_a_chunk_that_does_not_cover_the_blocks() -> None:
    kv = caches()
    chunk = gather_chunk(kv, [0, 1])
    with pytest.raises(InvalidArgument):
        scatter_chunk(kv, chunk, [5, 6, 7])
    with pytest.raises(InvalidArgument):
        scatter_chunk(kv[:2], chunk, [5, 6])  # wrong number of layers


def test_geometry_checks_layers() -> None:
    kv = caches()
    assert CacheGeometry.of(kv) == CacheGeometry(L, NB, BS, H, D, torch.float32)
    with pytest.raises(InvalidArgument):
        CacheGeometry.of([])
    with pytest.raises(InvalidArgument):
        CacheGeometry.of([kv[0], kv[1][:, :10]])
    with pytest.raises(InvalidArgument):
        CacheGeometry.of([torch.zeros(NB, BS, H, D)])


def test_incremental_chunk_keys_equal_spec_keys_for_every_length() -> None:
    layout = KVLayout("m", "c" * 32, L, H, D, "float32", chunk_size=32)
    rng = random.Random(4)
    tokens = [rng.randrange(50_000) for _ in range(200)]
    ck = ChunkKeys(layout, namespace="ns")
    for n in (0, 5, 31, 32, 33, 64, 100, 160, 199, 200):
        assert ck.update(tokens[:n]) == chunk_keys(tokens[:n], layout, namespace="ns")
    assert len(ck.keys) == 6
    other = ChunkKeys(layout, namespace="other")
    assert other.update(tokens)[0] != ck.keys[0]
