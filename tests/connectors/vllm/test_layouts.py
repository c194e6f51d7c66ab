"""Paged layouts <-> the canonical chunk: vLLM CPU against vLLM's own cache writer, vLLM CUDA (NHD and
HND memory) against flash-attn's indexing, and every layout against every other (engine-neutral)."""

from __future__ import annotations

import pytest
import torch
from kvstore.connectors.layouts import ENGINE_LAYOUT, VllmCpuAmxLayout, VllmCpuLayout, VllmCudaLayout

from kvstore.errors import InvalidArgument

L, NB, H, BS, D = 3, 6, 3, 32, 64


def tokens_kv(n: int, seed: int, dtype=torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, H, D, generator=gen).to(dtype), torch.randn(n, H, D, generator=gen).to(dtype))


def canonical(
    ks: list[torch.Tensor], vs: list[torch.Tensor], slots: torch.Tensor, blocks: list[int]
) -> torch.Tensor:
    """The chunk `[2, L, len(blocks)*BS, H, D]` of `blocks`, built token by token from where each token went."""
    out = torch.zeros(2, L, len(blocks) * BS, H, D, dtype=ks[0].dtype)
    where = {int(s): i for i, s in enumerate(slots)}
    for j, b in enumerate(blocks):
        for o in range(BS):
            i = where.get(b * BS + o)
            if i is not None:
                for layer in range(L):
                    out[0, layer, j * BS + o] = ks[layer][i]
                    out[1, layer, j * BS + o] = vs[layer][i]
    return out


def test_vllm_cpu_layout_matches_vllms_own_cache_writer() -> None:
    ops = pytest.importorskip("vllm._custom_ops")
    slots = torch.randperm(NB * BS, generator=torch.Generator().manual_seed(1))[: NB * BS - 5].long()
    isas = {"vec": VllmCpuLayout(), "vec16": VllmCpuLayout()}
    if torch.cpu._is_amx_tile_supported():  # the writer needs AMX tiles; the layout itself is tested below
        isas["amx"] = VllmCpuAmxLayout()
    for isa, layout in isas.items():
        caches, ks, vs = [], [], []
        for layer in range(L):
            cache = torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16)
            k_cache, v_cache = cache.view(NB, H, 2 * BS, D).chunk(2, dim=2)  # as vLLM's CPU backend does
            k, v = tokens_kv(len(slots), seed=layer)
            ops.cpu_attn_reshape_and_cache(k, v, k_cache, v_cache, slots, isa)
            caches.append(cache)
            ks.append(k)
            vs.append(v)
        blocks = [4, 1, 5]
        chunk = layout.gather(caches, blocks)
        assert torch.equal(chunk, canonical(ks, vs, slots, blocks)), isa
        # scatter writes exactly what vLLM's writer wrote, including into a partial range of blocks
        fresh = [torch.zeros_like(c) for c in caches]
        layout.scatter(fresh, chunk, blocks)
        for a, b in zip(fresh, caches, strict=True):
            assert torch.equal(a[blocks], b[blocks])
            assert not a[[0, 2, 3]].any()
        fresh = [torch.zeros_like(c) for c in caches]
        layout.scatter(fresh, chunk, [2], first_block=1)  # block 1 of the chunk (cache block 1) -> block 2
        assert all(torch.equal(a[2], b[1]) for a, b in zip(fresh, caches, strict=True))


@pytest.mark.parametrize("memory", ["NHD", "HND"])
def test_vllm_cuda_layout_reads_what_flash_attn_writes(memory: str) -> None:
    slots = torch.randperm(NB * BS, generator=torch.Generator().manual_seed(2))[: NB * BS - 7].long()
    caches, ks, vs = [], [], []
    for layer in range(L):
        if memory == "NHD":  # flash-attn: memory [B, N, H, 2D], handed out as the logical [B, H, N, 2D] view
            cache = torch.zeros(NB, BS, H, 2 * D, dtype=torch.float16).transpose(1, 2)
        else:
            cache = torch.zeros(NB, H, BS, 2 * D, dtype=torch.float16)
        k_cache, v_cache = cache.transpose(1, 2).split(D, dim=-1)  # what vllm's flash_attn.py does
        k, v = tokens_kv(len(slots), seed=10 + layer, dtype=torch.float16)
        k_cache[slots // BS, slots % BS] = k  # reshape_and_cache_flash: [block, offset, head, :]
        v_cache[slots // BS, slots % BS] = v
        caches.append(cache)
        ks.append(k)
        vs.append(v)
    layout = VllmCudaLayout()
    assert layout.geometry(caches).num_blocks == NB
    blocks = [0, 3]
    chunk = layout.gather(caches, blocks)
    assert torch.equal(chunk, canonical(ks, vs, slots, blocks))
    fresh = [torch.zeros_like(c) for c in caches]
    layout.scatter(fresh, chunk, blocks)
    for a, b in zip(fresh, caches, strict=True):
        assert a.stride() == b.stride() and torch.equal(a[blocks], b[blocks]) and not a[[1, 2, 4, 5]].any()


def test_a_chunk_moves_between_every_pair_of_layouts_unchanged() -> None:
    gen = torch.Generator().manual_seed(3)
    want = torch.randn(2, L, 2 * BS, H, D, generator=gen).to(torch.bfloat16)
    caches = {
        "engine": (ENGINE_LAYOUT, [torch.zeros(2, NB, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]),
        "cpu": (VllmCpuLayout(), [torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16) for _ in range(L)]),
        "cpu-amx": (
            VllmCpuAmxLayout(),
            [torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16) for _ in range(L)],
        ),
        "cuda": (
            VllmCudaLayout(),
            [torch.zeros(NB, BS, H, 2 * D, dtype=torch.bfloat16).transpose(1, 2) for _ in range(L)],
        ),
    }
    for layout, cache in caches.values():
        layout.scatter(cache, want, [5, 2])
    for src in caches.values():
        chunk = src[0].gather(src[1], [5, 2])
        assert torch.equal(chunk, want)
        for layout, cache in caches.values():
            layout.scatter(cache, chunk, [1, 3])
            assert torch.equal(layout.gather(cache, [1, 3]), want)
    # the CPU layout really is not the engine's: the same bytes in the wrong layout would be wrong KV
    assert not torch.equal(caches["cpu"][1][0][5].flatten(), caches["engine"][1][0][:, 5].flatten())
    assert not torch.equal(caches["cpu"][1][0][5], caches["cpu-amx"][1][0][5])


def test_bad_caches_are_refused() -> None:
    with pytest.raises(InvalidArgument):
        VllmCpuLayout().geometry([torch.zeros(2, NB, BS, H, D)])  # the engine's 5-D cache
    with pytest.raises(InvalidArgument):
        VllmCpuLayout().geometry([torch.zeros(NB, BS, H, 2 * D).transpose(1, 2)])  # not contiguous
    with pytest.raises(InvalidArgument, match="tiled by 16"):
        VllmCpuAmxLayout().geometry(
            [torch.zeros(NB, H, 24, 2 * D, dtype=torch.bfloat16)]
        )  # AMX: 16-token tiles
    with pytest.raises(InvalidArgument):
        VllmCudaLayout().geometry(
            [torch.zeros(NB, H, BS, 2 * D), torch.zeros(NB, H, BS, 2 * D, dtype=torch.float16)]
        )
    geo = VllmCpuLayout().geometry([torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16)] * L)
    assert (geo.num_layers, geo.num_blocks, geo.block_size, geo.num_kv_heads, geo.head_dim) == (
        L,
        NB,
        BS,
        H,
        D,
    )
    with pytest.raises(InvalidArgument):
        VllmCpuLayout().scatter([torch.zeros(NB, H, BS, 2 * D)] * L, torch.zeros(2, L, BS, H, D), [0, 1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_vllm_cuda_layout_matches_vllms_own_flash_cache_writer() -> None:
    ops = pytest.importorskip("vllm._custom_ops")
    dev = torch.device("cuda")
    slots = torch.randperm(NB * BS, generator=torch.Generator().manual_seed(4))[: NB * BS - 3].long()
    caches, ks, vs = [], [], []
    for layer in range(L):
        cache = torch.zeros(NB, BS, H, 2 * D, dtype=torch.bfloat16, device=dev).transpose(1, 2)  # NHD memory
        k_cache, v_cache = cache.transpose(1, 2).split(D, dim=-1)
        k, v = tokens_kv(len(slots), seed=20 + layer)
        one = torch.ones((), dtype=torch.float32, device=dev)
        ops.reshape_and_cache_flash(k.to(dev), v.to(dev), k_cache, v_cache, slots.to(dev), "auto", one, one)
        caches.append(cache)
        ks.append(k)
        vs.append(v)
    layout = VllmCudaLayout()
    chunk = layout.gather(caches, [2, 0, 5])
    assert torch.equal(chunk.cpu(), canonical(ks, vs, slots, [2, 0, 5]))
    fresh = [torch.zeros_like(c) for c in caches]
    layout.scatter(fresh, chunk.cpu(), [2, 0, 5])  # a chunk decoded on the host goes straight to the device
    assert all(torch.equal(a[[2, 0, 5]], b[[2, 0, 5]]) for a, b in zip(fresh, caches, strict=True))


@pytest.mark.parametrize(
    ("blocks", "runs"), [([3, 4, 5, 6, 7, 8], 1), ([9, 10, 2, 3, 0, 1], 3), ([9, 1, 7, 3, 11, 5], 6)]
)
def test_blocks_in_runs_and_scattered_blocks_move_alike(blocks: list[int], runs: int, monkeypatch) -> None:
    """Block ids in a few runs are copied run by run, more through the scratch: the caches and chunks
    they make are the same either way, in every block-major layout."""
    from kvstore.connectors import layouts  # noqa: PLC0415

    assert len(layouts.block_runs(blocks)) == runs
    want = torch.randn(2, L, len(blocks) * BS, H, D, generator=torch.Generator().manual_seed(5))
    made = {}
    for max_runs in (layouts.MAX_RUNS, 0):  # 0: every call takes the indexed path
        monkeypatch.setattr(layouts, "MAX_RUNS", max_runs)
        for layout in (VllmCpuLayout(), VllmCpuAmxLayout(), VllmCudaLayout()):
            cache = [torch.zeros(12, H, BS, 2 * D, dtype=torch.bfloat16) for _ in range(L)]
            layout.scatter(cache, want, blocks)
            out = layout.gather(cache, blocks)
            assert torch.equal(out, want.to(torch.bfloat16)), (layout.name, max_runs)
            untouched = [b for b in range(12) if b not in blocks]
            assert not any(c[untouched].any() for c in cache)
            made.setdefault(layout.name, []).append(cache)
    for first, second in made.values():
        assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bs", [16, 128, 12])  # 12: not a multiple of the 8x8 tiles
def test_the_c_path_moves_vllm_cpu_caches_as_the_torch_path_does(dtype, bs: int, monkeypatch) -> None:
    """connectors/layout_kernels.c against the torch path, bit for bit: scatter (whole and from a later
    block of the chunk) and gather, for every element size the kernel takes."""
    from kvstore.connectors import layout_c  # noqa: PLC0415

    if layout_c._lib() is None:
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(6)
    chunk = torch.randn(2, L, 3 * bs, H, D, generator=gen).to(dtype)
    made = []
    for c_path in (True, False):
        monkeypatch.setattr(layout_c, "_lib", layout_c._lib if c_path else lambda: None)
        layout = VllmCpuLayout()
        cache = [torch.zeros(NB, H, bs, 2 * D, dtype=dtype) for _ in range(L)]
        layout.scatter(cache, chunk, [4, 0])
        layout.scatter(cache, chunk, [2], first_block=2)
        made.append((cache, layout.gather(cache, [4, 0, 2]), layout.gather(cache, [1])))
    (c_cache, c_all, c_none), (t_cache, t_all, t_none) = made
    assert all(torch.equal(a, b) for a, b in zip(c_cache, t_cache, strict=True))
    assert torch.equal(c_all, t_all) and torch.equal(c_all, chunk) and not c_none.any()


def test_the_c_path_refuses_block_ids_outside_the_cache() -> None:
    from kvstore.connectors import layout_c  # noqa: PLC0415

    if layout_c._lib() is None:
        pytest.skip("no C compiler")
    cache = [torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16) for _ in range(L)]
    chunk = torch.zeros(2, L, BS, H, D, dtype=torch.bfloat16)
    for bad in ([NB], [-1]):
        with pytest.raises(InvalidArgument):
            layout_c.scatter(cache, chunk, bad, 0)
        with pytest.raises(InvalidArgument):
            layout_c.gather(cache, bad, chunk)
    assert not any(c.any() for c in cache)
