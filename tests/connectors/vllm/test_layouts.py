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


def test_vllm_mla_layout_matches_vllms_own_cpu_mla_cache_writer() -> None:
    """An MLA cache holds one latent row per token (kv_lora_rank values, then the rope part of the key):
    the chunk is `[1, L, T, 1, 576]`, and scatter writes back exactly what vLLM's writer wrote."""
    pytest.importorskip("vllm._custom_ops")
    from kvstore.connectors.mla_layout import VllmMlaLayout  # noqa: PLC0415

    op = getattr(torch.ops._C, "concat_and_cache_mla_cpu", None)
    if op is None:
        pytest.skip("this vLLM build has no CPU MLA cache writer")
    layout, d, bs = VllmMlaLayout(), 576, 16
    slots = torch.randperm(NB * bs, generator=torch.Generator().manual_seed(2))[: NB * bs - 3].long()
    caches, latents = [], []
    for layer in range(L):
        cache = torch.zeros(NB, 1, bs, d, dtype=torch.bfloat16)
        lat = torch.randn(len(slots), d, generator=torch.Generator().manual_seed(layer)).to(torch.bfloat16)
        op(lat[:, :512].contiguous(), lat[:, 512:].contiguous(), cache.view(NB, bs, d), slots)
        caches.append(cache)
        latents.append(lat)
    assert layout.geometry(caches).chunk_shape(32) == (1, L, 32, 1, d)
    blocks = [4, 1, 5]
    chunk = layout.gather(caches, blocks)
    where = {int(s): i for i, s in enumerate(slots)}
    for j, b in enumerate(blocks):
        for o in range(bs):
            i = where.get(b * bs + o)
            want = [
                latents[layer][i] if i is not None else torch.zeros(d, dtype=torch.bfloat16)
                for layer in range(L)
            ]
            for layer in range(L):
                assert torch.equal(chunk[0, layer, j * bs + o, 0], want[layer])
    fresh = [torch.zeros_like(c) for c in caches]
    layout.scatter(fresh, chunk, blocks)
    for a, b in zip(fresh, caches, strict=True):
        assert torch.equal(a[blocks], b[blocks]) and not a[[0, 2, 3]].any()


def test_an_mla_layout_is_one_latent_per_token_on_every_rank() -> None:
    from kvstore.keys import KVLayout, model_layout  # noqa: PLC0415

    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "hidden_size": 128,
              "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32}  # fmt: skip
    mla = model_layout(config, model="m", kv_dtype="bfloat16", mla=True)
    assert (mla["num_kv_heads"], mla["head_dim"], mla["kv_format"]) == (1, 576, "mla")
    # the same whatever the TP size (the latent is whole on every rank)
    assert model_layout(config, model="m", kv_dtype="bfloat16", mla=True, tp_rank=1, tp_world_size=2) == mla
    mha = model_layout(
        config, model="m", kv_dtype="bfloat16"
    )  # VLLM_MLA_DISABLE=1: another cache, other keys
    assert "kv_format" not in mha and KVLayout(**mha).fingerprint() != KVLayout(**mla).fingerprint()


def test_grouped_layout_moves_each_groups_layers_with_its_own_blocks_and_skips_null_window_blocks() -> None:
    """vLLM's hybrid manager: layers 0, 2 in a sliding-window group (1), layers 1, 3 in a full one (0);
    block ids are (group 0's, group 1's) pairs; a window group's early blocks are the null block 0."""
    from kvstore.connectors.grouped_layout import GroupedLayout  # noqa: PLC0415

    inner = VllmCpuLayout()
    layout = GroupedLayout(inner, [1, 0, 1, 0], windowed={1})
    caches = [torch.randn(NB, H, BS, 2 * D, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
              for i in range(4)]  # fmt: skip
    blocks = [(1, 4), (2, 5), (3, 0)]  # position 2 of the window group is null (out of its window)
    chunk = layout.gather(caches, blocks)
    assert chunk.shape == (2, 4, 3 * BS, H, D)
    for layer, g in enumerate([1, 0, 1, 0]):
        ids = [b[g] for b in blocks]
        assert torch.equal(chunk[:, layer], inner.gather([caches[layer]], ids)[:, 0]), layer
    fresh = [torch.zeros_like(c) for c in caches]
    layout.scatter(fresh, chunk, blocks)
    for layer, g in enumerate([1, 0, 1, 0]):
        ids = [b[g] for b in blocks if b[g] != 0]
        assert torch.equal(fresh[layer][ids], caches[layer][ids])
    assert not fresh[0][0].any() and not fresh[2][0].any(), "the null block was written"
    # a load of the chunk's second and third blocks only (first_block 1)
    part = [torch.zeros_like(c) for c in caches]
    layout.scatter(part, chunk, blocks[1:], first_block=1)
    assert torch.equal(part[1][2], caches[1][2]) and torch.equal(part[0][5], caches[0][5])  # position 1
