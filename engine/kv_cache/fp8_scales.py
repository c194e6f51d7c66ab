"""fp8 (e4m3) KV scales: the cache stores K / k_scale and V / v_scale, attention multiplies back.

e4m3 keeps 3 mantissa bits at every magnitude from 2^-6 to 448, so a scale only has to keep the
largest values below 448 (they would saturate) without pushing ordinary ones into the subnormals.
The scales are calibrated once at startup: a fixed text runs through the model and each layer's
|K| and |V| maxima, per KV head ("head") or over all heads ("tensor"), times a headroom of 2, are
rounded up to a power of two (exact to multiply by, and the same for engines whose maxima differ in
the last bits). The same model therefore always gets the same scales; their digest is part of the
KV layout fingerprint, so chunks quantised with other scales never share keys.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from kvstore.engine.attention_metadata import AttentionMetadata
from kvstore.engine.layers.attention import Attention
from kvstore.engine.layers.paged_attention import FP8_MAX
from torch import nn

HEADROOM = 2.0
_BLOCK = 16
CALIBRATION_TEXT = (
    "The history of the lighthouse keepers of the northern coast is a story of storms, patience and small "
    "mechanical miracles. Every evening the keeper climbed the stairs, trimmed the wick and wound the "
    "clockwork that turned the lens.\n\nQuestion: What is the capital of France? Answer: Paris is the "
    "capital of France, with 2.1 million inhabitants in 2024.\n\ndef fibonacci(n: int) -> int:\n"
    "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "| year | revenue (EUR) | growth |\n|------|---------------|--------|\n| 2022 | 1,204,331 | 4.5% |\n"
    "| 2023 | 1,310,872 | 8.8% |\n\nUser: Translate 'good morning' into German and Spanish.\n"
    "Assistant: Guten Morgen; buenos dias. Les mots francais: bonjour, merci, au revoir. "
    '1 + 1 = 2, 3 * 7 = 21, sqrt(2) = 1.41421356. {"name": "Ada", "tags": ["math", "code"]}'
)


@dataclass(frozen=True)
class KVScales:
    scales: torch.Tensor  # [num_layers, 2, num_kv_heads] fp32 powers of two (index 1: 0 = K, 1 = V)
    granularity: str

    def digest(self) -> str:
        """What the layout fingerprint records: the granularity and a hash of the scale values."""
        raw = self.scales.to(torch.float32).contiguous().numpy().tobytes()
        return f"{self.granularity}:{hashlib.blake2b(raw, digest_size=8).hexdigest()}"


def _power_of_two_scale(amax: torch.Tensor) -> torch.Tensor:
    target = (amax.double() * HEADROOM / FP8_MAX).clamp(min=2.0**-60)
    return torch.exp2(torch.ceil(torch.log2(target))).to(torch.float32)


def engine_kv_scales(model: nn.Module, encode, vocab_size: int, max_len: int, granularity: str) -> KVScales:
    """The scales an engine serves with: CALIBRATION_TEXT through its tokenizer (`encode`), keeping the
    ids the model knows and at most `max_len` of them."""
    ids = [t for t in encode(CALIBRATION_TEXT) if t < vocab_size][:max_len]
    return calibrate_kv_scales(model, ids, granularity)


@torch.inference_mode()
def calibrate_kv_scales(model: nn.Module, token_ids: list[int], granularity: str = "head") -> KVScales:
    """Run `token_ids` as one prefill through `model` (a scratch fp32 cache, every layer's real cache
    and scales put back afterwards) and derive the scales from the K/V maxima."""
    assert granularity in ("head", "tensor"), granularity
    assert token_ids, "calibration needs tokens"
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    heads, dim = layers[0].num_kv_heads, layers[0].head_dim
    device = next(model.parameters()).device
    amax = torch.zeros(len(layers), 2, heads, dtype=torch.float32)

    def observe(i: int):
        def hook(module: Attention, args: tuple) -> None:
            _, k, v, _ = args
            for j, x in enumerate((k, v)):
                amax[i, j] = torch.maximum(
                    amax[i, j], x.view(x.shape[0], heads, dim).abs().amax((0, 2)).float().cpu()
                )

        return hook

    n = len(token_ids)
    blocks = -(-n // _BLOCK)
    scratch = torch.zeros(len(layers), 2, blocks, _BLOCK, heads, dim, dtype=torch.float32, device=device)
    saved = [(m.kv_cache, m.k_scale, m.v_scale) for m in layers]
    # the fused C decoder layers never call the Attention modules, so their hooks would see nothing
    fused = [m for m in model.modules() if getattr(m, "use_fused_layers", False)]
    hooks = [m.register_forward_pre_hook(observe(i)) for i, m in enumerate(layers)]
    try:
        for m in fused:
            m.use_fused_layers = False
        for i, m in enumerate(layers):
            m.kv_cache, m.k_scale, m.v_scale = scratch[i], None, None
        meta = AttentionMetadata(
            cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=device),
            context_lens=torch.tensor([n], dtype=torch.int32, device=device),
            slot_mapping=torch.arange(n, dtype=torch.int64, device=device),
            block_tables=torch.arange(blocks, dtype=torch.int32, device=device).view(1, blocks),
            max_q_len=n,
            max_context_len=n,
            block_size=_BLOCK,
        )
        ids = torch.tensor(token_ids, dtype=torch.long, device=device)
        model(ids, torch.arange(n, dtype=torch.long, device=device), meta)
    finally:
        for m in fused:
            m.use_fused_layers = True
        for h in hooks:
            h.remove()
        for m, (cache, ks, vs) in zip(layers, saved, strict=True):
            m.kv_cache, m.k_scale, m.v_scale = cache, ks, vs
    assert (amax > 0).all(), "calibration saw no K/V in some layer"
    if granularity == "tensor":
        amax = amax.amax(-1, keepdim=True).expand_as(amax)
    return KVScales(_power_of_two_scale(amax).contiguous(), granularity)
