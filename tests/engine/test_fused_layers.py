"""The 16-bit CPU path's two guarantees: `cpu_ops.FusedLayers` (all decoder layers of a step in one C
call) is bit-identical to the layer-by-layer kernels, and with every row's attention in the kernel
(`paged_attention(every_row=True)`) a token's KV and hidden state do not depend on how its prompt was
chunked or batched, which is what makes KV loaded from a store and KV recomputed the same bytes.
Tiny architectures cover head_dim != hidden / heads, qkv bias with tied embeddings, and a sliding
window shorter than the sequences."""

from __future__ import annotations

import pytest
import torch

from engine.layers import cpu_ops
from engine.loader import load_model
from tests.engine.conftest import TINY_ARCHS

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.skipif(not cpu_ops.available(), reason="no AVX-512F CPU or no C compiler"),
]


def _run(model, kv, steps: list[list[tuple[int, list[int]]]]) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [model(*kv.step(batch)) for batch in steps]


@pytest.fixture
def count_fused(monkeypatch) -> list[int]:
    calls = [0]
    real = cpu_ops.FusedLayers.__call__

    def counting(self, *args):
        calls[0] += 1
        return real(self, *args)

    monkeypatch.setattr(cpu_ops.FusedLayers, "__call__", counting)
    return calls


def _tokens(config, n: int, seed: int) -> list[int]:
    return torch.randint(3, config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16])
def test_fused_layers_are_bit_identical_to_the_layer_by_layer_path(
    tiny_checkpoints, paged_kv, count_fused, arch: str, wdtype: torch.dtype
) -> None:
    model, config = load_model(tiny_checkpoints[arch], dtype=wdtype)
    inner = model.model
    assert inner.use_fused_layers  # 16-bit weights on the CPU kernels
    a, b, c = (_tokens(config, n, seed) for n, seed in ((5, 1), (11, 2), (30, 3)))
    steps = [[(0, a), (1, b)]]  # two prefills
    steps += [
        [(0, [t]), (1, [u])] for t, u in zip(_tokens(config, 12, 4), _tokens(config, 12, 5), strict=True)
    ]
    steps += [[(0, [7]), (2, c[:13]), (1, [9])], [(2, c[13:]), (0, [8])]]  # a chunked prefill among decodes
    got = {}
    for fused in (True, False):
        inner.use_fused_layers = fused
        kv = paged_kv.for_model(model, num_blocks=40, block_size=4, dtype=wdtype)
        before = count_fused[0]
        got[fused] = (_run(model, kv, steps), kv.kv_cache)
        assert count_fused[0] - before == (len(steps) if fused else 0)
    for x, y in zip(got[True][0], got[False][0], strict=True):
        assert torch.equal(x, y)
    assert torch.equal(got[True][1], got[False][1])
    assert got[True][1].abs().sum() > 0


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
    """More than one torch thread (the layers split rows over threads), an fp8 cache (quantised by
    torch, not by the C store), fp32 weights (the exactness reference: torch GEMMs and attention)."""
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
    paged_kv.for_model(model, num_blocks=16, block_size=4, dtype=torch.float8_e4m3fn)
    assert model.model._fused_layers() is None
    fp32, _ = load_model(tiny_checkpoints["llama"], dtype="float32")
    assert not fp32.model.use_fused_layers and fp32.model._fused_layers() is None
    assert not any(getattr(m, "every_row", False) for m in fp32.modules())
