"""The fused decode step (`cpu_ops.FusedDecode`, all decoder layers in one C call) against the
layer-by-layer kernel path: the same hidden states and the same KV cache bytes, bit for bit, on every
tiny architecture (head_dim != hidden / heads, qkv bias with tied embeddings, a sliding window that the
decode steps pass), with 16-bit weights and ragged batches; and the cases where it must step aside."""

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


def _run(model, kv, prompts: list[list[int]], decode_tokens: torch.Tensor) -> list[torch.Tensor]:
    hidden = []
    with torch.inference_mode():
        hidden.append(model(*kv.step(list(enumerate(prompts)))))
        for step in decode_tokens.tolist():  # rows of decode_tokens: one token per sequence
            hidden.append(model(*kv.step([(i, [t]) for i, t in enumerate(step)])))
    return hidden


@pytest.fixture
def count_fused(monkeypatch) -> list[int]:
    calls = [0]
    real = cpu_ops.FusedDecode.__call__

    def counting(self, *args):
        calls[0] += 1
        return real(self, *args)

    monkeypatch.setattr(cpu_ops.FusedDecode, "__call__", counting)
    return calls


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16])
def test_fused_decode_is_bit_identical_to_the_layer_by_layer_path(
    tiny_checkpoints, paged_kv, count_fused, arch: str, wdtype: torch.dtype
) -> None:
    model, config = load_model(tiny_checkpoints[arch], dtype=wdtype)
    inner = model.model
    assert inner.use_fused_decode  # 16-bit weights on the CPU kernels
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=g).tolist() for n in (5, 11, 2)]
    decode = torch.randint(3, config.vocab_size, (12, len(prompts)), generator=g)  # past mistral's window 7
    got = {}
    for fused in (True, False):
        inner.use_fused_decode = fused
        kv = paged_kv.for_model(model, num_blocks=40, block_size=4, dtype=wdtype)
        before = count_fused[0]
        got[fused] = (_run(model, kv, prompts, decode), kv.kv_cache)
        assert count_fused[0] - before == (len(decode) if fused else 0)
    for a, b in zip(got[True][0], got[False][0], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(got[True][1], got[False][1])
    assert got[True][1].abs().sum() > 0


def test_fused_decode_steps_aside(tiny_checkpoints, paged_kv, count_fused) -> None:
    """More than one torch thread (the layers split rows over threads), an fp8 cache (quantised by
    torch, not by the C store), fp32 weights (the exactness reference: torch GEMMs), prefill steps."""
    model, config = load_model(tiny_checkpoints["llama"], dtype="bfloat16")
    kv = paged_kv.for_model(model, num_blocks=16, block_size=4, dtype=torch.bfloat16)
    decode = torch.tensor([[5], [6]])
    _run(model, kv, [[3, 4, 5]], decode)
    assert count_fused[0] == 2  # the prefill step took the layers
    torch.set_num_threads(2)
    try:
        _run(
            model, paged_kv.for_model(model, num_blocks=16, block_size=4, dtype=torch.bfloat16), [[3]], decode
        )
    finally:
        torch.set_num_threads(1)
    assert count_fused[0] == 2
    paged_kv.for_model(model, num_blocks=16, block_size=4, dtype=torch.float8_e4m3fn)
    assert model.model._fused_decode() is None
    fp32, _ = load_model(tiny_checkpoints["llama"], dtype="float32")
    assert not fp32.model.use_fused_decode and fp32.model._fused_decode() is None
