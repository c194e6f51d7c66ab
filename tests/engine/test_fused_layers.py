"""The 16-bit CPU path's two guarantees: `fused_layers.FusedLayers` (all decoder layers of a step in one C
call) is bit-identical to the layer-by-layer kernels, and with every row's attention in the kernel
(`paged_attention(every_row=True)`) a token's KV and hidden state do not depend on how its prompt was
chunked or batched, which is what makes KV loaded from a store and KV recomputed the same bytes.
Tiny architectures cover head_dim != hidden / heads, qkv bias with tied embeddings, and a sliding
window shorter than the sequences; an fp8 cache goes through the C quantiser on the fused path and
through torch's (`paged_attention.quantize_kv`) on the other."""

from __future__ import annotations

import pytest
import torch
from kvstore.engine.layers import cpu_lib, cpu_ops
from kvstore.engine.layers.attention import Attention
from kvstore.engine.layers.fused_layers import FusedLayers
from kvstore.engine.layers.paged_attention import FP8
from kvstore.engine.loader import load_model

from tests.engine.conftest import TINY_ARCHS

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.skipif(not cpu_lib.available(), reason="no AVX-512F CPU or no C compiler"),
]


def _run(model, kv, steps: list[list[tuple[int, list[int]]]]) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [model(*kv.step(batch)) for batch in steps]


@pytest.fixture
def count_fused(monkeypatch) -> list[int]:
    calls = [0]
    real = FusedLayers.__call__

    def counting(self, *args):
        calls[0] += 1
        return real(self, *args)

    monkeypatch.setattr(FusedLayers, "__call__", counting)
    return calls


def _tokens(config, n: int, seed: int) -> list[int]:
    return torch.randint(3, config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _attach_fp8_scales(model, seed: int) -> None:
    """Scales per layer and KV head around the tiny models' K/V magnitudes, not powers of two (the
    division rounds), small enough that some values saturate."""
    g = torch.Generator().manual_seed(seed)
    for m in (m for m in model.modules() if isinstance(m, Attention)):
        m.k_scale = (torch.rand(m.num_kv_heads, generator=g) * 0.01 + 0.0004).contiguous()
        m.v_scale = (torch.rand(m.num_kv_heads, generator=g) * 0.01 + 0.0004).contiguous()


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize(
    "wdtype,cache", [(torch.bfloat16, None), (torch.float16, None), (torch.bfloat16, FP8)]
)
def test_fused_layers_are_bit_identical_to_the_layer_by_layer_path(
    tiny_checkpoints, paged_kv, count_fused, arch: str, wdtype: torch.dtype, cache: torch.dtype | None
) -> None:
    model, config = load_model(tiny_checkpoints[arch], dtype=wdtype)
    inner = model.model
    assert inner.use_fused_layers  # 16-bit weights on the CPU kernels
    if cache is FP8:
        _attach_fp8_scales(model, seed=5)
    a, b, c = (_tokens(config, n, seed) for n, seed in ((5, 1), (11, 2), (30, 3)))
    steps = [[(0, a), (1, b)]]  # two prefills
    steps += [
        [(0, [t]), (1, [u])] for t, u in zip(_tokens(config, 12, 4), _tokens(config, 12, 5), strict=True)
    ]
    steps += [[(0, [7]), (2, c[:13]), (1, [9])], [(2, c[13:]), (0, [8])]]  # a chunked prefill among decodes
    got = {}
    for fused in (True, False):
        inner.use_fused_layers = fused
        kv = paged_kv.for_model(model, num_blocks=40, block_size=4, dtype=cache or wdtype)
        before = count_fused[0]
        got[fused] = (_run(model, kv, steps), kv.kv_cache)
        assert count_fused[0] - before == (len(steps) if fused else 0)
    for x, y in zip(got[True][0], got[False][0], strict=True):
        assert torch.equal(x, y)
    fused_kv, layers_kv = (got[f][1].view(torch.uint8) if cache is FP8 else got[f][1] for f in (True, False))
    assert torch.equal(fused_kv, layers_kv)
    assert got[True][1].float().abs().sum() > 0
    if cache is FP8:  # the scales are small enough that some values saturate (448 = 0x7E)
        assert 0x7E in (fused_kv & 0x7F).unique().tolist()


def test_c_fp8_store_rounds_like_torch() -> None:
    """Ties (both ways), subnormals, the smallest normal, saturation, signed zeros and NaN: the C
    quantiser writes the bytes `quantize_kv` (torch's float8_e4m3fn cast) gives."""
    from kvstore.engine.layers.paged_attention import quantize_kv

    hkv, d = 2, 16
    special = [0.0, -0.0, 448.0, 449.0, 464.0, 1e9, -1e9, float("nan"), 2**-6, 2**-7, 2**-9, 2**-10, 3 * 2**-10,
               2**-6 * (1 + 1 / 16), 2**-6 * (1 + 3 / 16), 1.0625, 1.1875, -1.0625, 240.0, 232.0, 2**-12]  # fmt: skip
    g = torch.Generator().manual_seed(0)
    wide = torch.exp2(torch.rand(2000, generator=g) * 30 - 14) * torch.sign(torch.randn(2000, generator=g))
    vals = torch.cat([torch.tensor(special), wide, torch.randn(2000, generator=g) * 100])
    n = -(-vals.numel() // (hkv * d))
    x = torch.zeros(n * hkv * d)
    x[: vals.numel()] = vals
    x = x.view(n, hkv * d)
    scale = torch.tensor([1.0, 0.37])
    cache = torch.zeros(2, n, 1, hkv, d, dtype=FP8)
    slots = torch.arange(n, dtype=torch.int64)
    cpu_ops.store_kv(x, x, cache[0], cache[1], slots, scale, scale)
    want = quantize_kv(x.view(n, hkv, d), FP8, scale).view(torch.uint8)
    got = cache[0].view(torch.uint8).view(n, hkv, d)
    nan = torch.isnan(x.view(n, hkv, d) / scale[:, None])
    assert torch.equal(got[~nan], want[~nan]) and torch.equal(got, cache[1].view(torch.uint8).view(n, hkv, d))
    assert bool(nan.any()) and torch.isnan(cache[0].view(n, hkv, d)[nan].float()).all()


@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("fused", [True, False])
def test_kv_and_logits_do_not_depend_on_chunking_or_batching(
    tiny_checkpoints, paged_kv, arch: str, fused: bool
) -> None:
    model, config = load_model(tiny_checkpoints[arch], dtype="bfloat16")
    model.model.use_fused_layers = fused
    prompt, other = _tokens(config, 23, 11), _tokens(config, 9, 12)
    schedules = {
        "whole": [[(0, prompt)]],
        "chunks of 5": [[(0, prompt[i : i + 5])] for i in range(0, 23, 5)],
        "beside another": [[(1, other), (0, prompt[:10])], [(1, [4]), (0, prompt[10:])]],
        "token by token": [[(0, [t])] for t in prompt],
    }
    results = {}
    for name, steps in schedules.items():
        kv = paged_kv.for_model(model, num_blocks=40, block_size=4, dtype=torch.bfloat16, seed=3)
        hidden = _run(model, kv, steps)
        last = hidden[-1][-1]  # the prompt's last token is the last row of every schedule's last step
        table = kv.tables[0]
        blocks = kv.kv_cache[:, :, table].flatten(2, 3)[:, :, :23]  # [layers, 2, 23 tokens, heads, dim]
        results[name] = (last, blocks)
    ref_last, ref_blocks = results["whole"]
    for name, (last, blocks) in results.items():
        assert torch.equal(blocks, ref_blocks), name
        assert torch.equal(last, ref_last), name


def test_fused_layers_step_aside(tiny_checkpoints, paged_kv, count_fused) -> None:
    """More than one torch thread (the layers split rows over threads) and fp32 weights (the exactness
    reference: torch GEMMs and attention)."""
    model, config = load_model(tiny_checkpoints["llama"], dtype="bfloat16")
    kv = paged_kv.for_model(model, num_blocks=16, block_size=4, dtype=torch.bfloat16)
    _run(model, kv, [[(0, [3, 4, 5])], [(0, [6])]])
    assert count_fused[0] == 2
    torch.set_num_threads(2)
    try:
        _run(
            model, paged_kv.for_model(model, num_blocks=16, block_size=4, dtype=torch.bfloat16), [[(0, [3])]]
        )
    finally:
        torch.set_num_threads(1)
    assert count_fused[0] == 2
    fp32, _ = load_model(tiny_checkpoints["llama"], dtype="float32")
    assert not fp32.model.use_fused_layers and fp32.model._fused_layers() is None
    assert not any(getattr(m, "every_row", False) for m in fp32.modules())
