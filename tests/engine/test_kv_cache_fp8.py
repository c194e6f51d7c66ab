"""`--kv-cache-dtype fp8`: the paged cache stores e4m3 with a scale per KV head (or layer), attention
dequantises on read. The model with an fp8 cache must equal the same model with a full-precision cache
holding the dequantised values (fake quantisation), through prefill chunks, decode and mixed batches,
on the torch path and on the CPU kernels; the cache holds twice the tokens at the same memory; the
scales are calibrated deterministically and are part of the layout fingerprint."""

from __future__ import annotations

import pytest
import torch
from kvstore.engine.engine_args import EngineArgs
from kvstore.engine.kv_cache.fp8_scales import KVScales, calibrate_kv_scales
from kvstore.engine.layers import cpu_lib
from kvstore.engine.layers.attention import Attention
from kvstore.engine.layers.paged_attention import FP8, FP8_MAX, dequantize_kv, quantize_kv
from kvstore.engine.llm_engine import LLMEngine
from kvstore.engine.loader import load_model
from kvstore.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")
KERNELS = [
    False,
    pytest.param(True, marks=pytest.mark.skipif(not cpu_lib.available(), reason="no CPU kernels")),
]


def _attach_scales(model, scales: torch.Tensor) -> None:
    for layer, m in enumerate(m for m in model.modules() if isinstance(m, Attention)):
        m.k_scale, m.v_scale = scales[layer, 0].contiguous(), scales[layer, 1].contiguous()


def _fake_quantise(model, scales: torch.Tensor) -> list:
    """Hooks that round each layer's new K/V through fp8 before a full-precision cache stores them."""
    handles = []
    for layer, m in enumerate(m for m in model.modules() if isinstance(m, Attention)):

        def hook(mod, args, layer=layer):
            q, k, v, meta = args
            h, d = mod.num_kv_heads, mod.head_dim
            ks, vs = scales[layer, 0], scales[layer, 1]
            k = dequantize_kv(quantize_kv(k.view(-1, h, d), FP8, ks), k.dtype, ks).view(k.shape)
            v = dequantize_kv(quantize_kv(v.view(-1, h, d), FP8, vs), v.dtype, vs).view(v.shape)
            return q, k, v, meta

        handles.append(m.register_forward_pre_hook(hook))
    return handles


@pytest.mark.parametrize("use_cpu_kernels", KERNELS, ids=["torch", "kernels"])
@pytest.mark.parametrize("arch", ["llama", "mistral"])  # mistral: a sliding window over fp8 blocks
def test_fp8_cache_equals_a_fake_quantised_full_precision_cache(
    tiny_checkpoints, paged_kv, arch: str, use_cpu_kernels: bool
) -> None:
    model_dir = tiny_checkpoints[arch]
    fp8_model, cfg = load_model(model_dir, use_cpu_kernels=use_cpu_kernels)
    ref_model, _ = load_model(model_dir, use_cpu_kernels=use_cpu_kernels)
    g = torch.Generator().manual_seed(7)
    # powers of two around the tiny model's K/V magnitudes, different per layer and head
    scales = torch.exp2(
        torch.randint(-9, -5, (cfg.num_hidden_layers, 2, cfg.num_key_value_heads), generator=g)
    )
    fp8_kv = paged_kv.for_model(fp8_model, num_blocks=40, block_size=4, dtype=FP8)
    ref_kv = paged_kv.for_model(ref_model, num_blocks=40, block_size=4, dtype=torch.float32)
    _attach_scales(fp8_model, scales)
    _fake_quantise(ref_model, scales)
    seqs = {s: torch.randint(0, cfg.vocab_size, (30,), generator=g).tolist() for s in range(3)}
    steps = [
        [(0, seqs[0][:9])],  # a prefill from position 0
        [(0, seqs[0][9:14]), (1, seqs[1][:7])],  # a chunk on a partial cache + a fresh prefill
        [(0, [seqs[0][14]]), (1, [seqs[1][7]]), (2, seqs[2][:12])],  # decode rows in a mixed batch
        *[
            [(0, [seqs[0][15 + i]]), (1, [seqs[1][8 + i]]), (2, [seqs[2][12 + i]])] for i in range(8)
        ],  # decode
    ]
    saw_decode = False
    with torch.no_grad():
        for batch in steps:
            ids, pos, meta = fp8_kv.step(batch)
            got = fp8_model.compute_logits(fp8_model(ids, pos, meta))
            ids, pos, meta_ref = ref_kv.step(batch)
            want = ref_model.compute_logits(ref_model(ids, pos, meta_ref))
            torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
            saw_decode |= meta.is_decode
    assert saw_decode
    assert fp8_kv.kv_cache.dtype == FP8 and fp8_kv.kv_cache.view(torch.uint8).any()
    # the cache holds exactly the quantised values the reference dequantised
    flat = fp8_kv.kv_cache[0, 0].view(-1, cfg.num_key_value_heads, cfg.head_dim)
    ref_flat = ref_kv.kv_cache[0, 0].view(-1, cfg.num_key_value_heads, cfg.head_dim)
    torch.testing.assert_close(dequantize_kv(flat, torch.float32, scales[0, 0]), ref_flat, atol=0, rtol=0)


def test_quantize_saturates_instead_of_overflowing() -> None:
    x = torch.tensor([[[1e6, -1e6, 3.0, 0.0]]])
    q = quantize_kv(x, FP8, torch.ones(1))
    assert q.float().tolist() == [[[FP8_MAX, -FP8_MAX, 3.0, 0.0]]]


def test_calibrated_scales_are_deterministic_powers_of_two_with_headroom(tiny_checkpoints) -> None:
    model, cfg = load_model(tiny_checkpoints["qwen2"])
    tokens = list(range(5, 120))
    a = calibrate_kv_scales(model, tokens, "head")
    b = calibrate_kv_scales(model, tokens, "head")
    t = calibrate_kv_scales(model, tokens, "tensor")
    assert a.scales.shape == (cfg.num_hidden_layers, 2, cfg.num_key_value_heads)
    assert torch.equal(a.scales, b.scales) and a.digest() == b.digest()
    assert torch.equal(torch.exp2(torch.log2(a.scales).round()), a.scales)  # powers of two
    assert (t.scales == t.scales[..., :1]).all() and torch.equal(t.scales.amax(-1), a.scales.amax(-1))
    assert t.digest() != a.digest() and t.digest().startswith("tensor:")
    # the calibration text's own K/V fit with headroom: |x| / scale <= 448 / 2
    amax = torch.zeros_like(a.scales)

    def record(layer):
        def hook(mod, args):
            _, k, v, _ = args
            for j, x in enumerate((k, v)):
                amax[layer, j] = x.view(x.shape[0], mod.num_kv_heads, -1).abs().amax((0, 2))

        return hook

    layers = [m for m in model.modules() if isinstance(m, Attention)]
    handles = [m.register_forward_pre_hook(record(i)) for i, m in enumerate(layers)]
    calibrate_kv_scales(model, tokens, "head")
    for h in handles:
        h.remove()
    assert (amax / a.scales <= FP8_MAX / 2 + 1e-3).all() and (amax / a.scales > FP8_MAX / 8).all()
    assert all(m.kv_cache.numel() == 0 and m.k_scale is None for m in layers)  # nothing left attached


def test_calibration_sees_the_kv_of_the_fused_cpu_layers(tiny_checkpoints) -> None:
    """With one torch thread the 16-bit CPU path runs all decoder layers in one C call, past the
    Attention modules: calibration must still see every layer's K/V (it once got none, and every
    scale fell to the 2^-60 floor: fp8 output was noise)."""
    model, _ = load_model(tiny_checkpoints["llama"], dtype="bfloat16")
    if not model.model.use_fused_layers:
        pytest.skip("no fused CPU layers here (no AVX-512 kernels)")
    tokens = list(range(5, 120))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        fused = calibrate_kv_scales(model, tokens, "head")
        torch.set_num_threads(2)  # the per-layer path
        per_layer = calibrate_kv_scales(model, tokens, "head")
    finally:
        torch.set_num_threads(threads)
    assert model.model.use_fused_layers  # put back
    assert torch.equal(fused.scales, per_layer.scales) and (fused.scales > 2.0**-20).all()


def test_fp8_engine_holds_twice_the_tokens_and_keys_its_scales(tiny_engine_dir) -> None:
    common = dict(model=str(tiny_engine_dir), dtype="bfloat16", kv_cache_memory="2MiB", max_model_len=128)
    bf16 = LLMEngine(EngineArgs(**common))
    fp8 = LLMEngine(EngineArgs(**common, kv_cache_dtype="fp8"))
    fp8_again = LLMEngine(EngineArgs(**common, kv_cache_dtype="fp8"))
    per_tensor = LLMEngine(EngineArgs(**common, kv_cache_dtype="fp8", kv_scale_granularity="tensor"))
    assert fp8.kv_cache_dtype == FP8 and fp8.runner.kv_cache.dtype == FP8
    assert fp8.block_manager.num_blocks == 2 * bf16.block_manager.num_blocks
    assert fp8.runner.kv_cache.numel() <= 2 * 2**20  # one byte per value
    assert isinstance(fp8.kv_scales, KVScales) and bf16.kv_scales is None
    roots = {e.block_manager.root_hash for e in (bf16, fp8, per_tensor)}
    assert len(roots) == 3  # fp8 never shares keys with bf16, nor with other scales
    assert fp8_again.block_manager.root_hash == fp8.block_manager.root_hash  # ... but with itself, always
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for engine in (fp8, per_tensor):
        seq = engine.add_request(list(range(100, 140)), params)
        while engine.has_unfinished_requests():
            engine.step()
        assert len(seq.output_token_ids) == 8
