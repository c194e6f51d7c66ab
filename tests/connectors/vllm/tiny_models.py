"""Tiny model directories for the vLLM connector tests, written in the test (nothing downloaded).

`config_dir(kind, root)` writes only a config.json (enough for vLLM's config checks, or for
`load_format="dummy"`); `checkpoint_dir(kind, root)` also writes random weights as safetensors, spread
out so that logits are not flat (embeddings std 1, matrices std 0.08, norms 1 ± 0.1, lm_head std 0.3:
dummy weights are ±1e-3 and hide a wrong load), for the tests where numbers matter.

| kind | what | why |
|---|---|---|
| llama | 4 layers, 4 heads, 2 KV heads of 64 | fp8 at TP=2 (one KV head per rank), config checks |
| llama8 | 2 layers, 8 heads, 4 KV heads of 64 | TP=1, 2 and 4 (one KV head per rank at TP=4) |
| mla | deepseek_v2, kv_lora_rank 512 + qk_rope_head_dim 64 | vLLM CPU's CPU_MLA needs a 576-wide latent |
| gemma3 | gemma3_text, 6 layers, sliding window 256 (5 of 6 layers) | sliding-window with the hybrid manager |
| lfm2 | lfm2: short-conv layers and attention layers | a Mamba-style hybrid (conv state) |
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 512
_COMMON = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, max_position_embeddings=8192,
               bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)  # fmt: skip


def hf_config(kind: str):  # noqa: ANN201 (a transformers config)
    import transformers  # noqa: PLC0415

    if kind == "llama":
        return transformers.LlamaConfig(**_COMMON, num_hidden_layers=4, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=64)  # fmt: skip
    if kind == "llama8":
        return transformers.LlamaConfig(**_COMMON, num_hidden_layers=2, num_attention_heads=8,
                                        num_key_value_heads=4, head_dim=64)  # fmt: skip
    if kind == "mla":
        return transformers.DeepseekV2Config(
            **_COMMON,
            moe_intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            qk_nope_head_dim=32,
            v_head_dim=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=2,
        )  # fmt: skip (every layer dense: no experts to write)
    if kind == "gemma3":
        return transformers.Gemma3TextConfig(**_COMMON, num_hidden_layers=6, num_attention_heads=4,
                                             num_key_value_heads=2, head_dim=64, sliding_window=256)  # fmt: skip
    if kind == "lfm2":
        # vLLM's lfm2 reads the older field names (conv_dim, block_*) too
        return transformers.Lfm2Config(
            **_COMMON, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            layer_types=["conv", "full_attention", "conv", "full_attention"], conv_dim=128, block_dim=128,
            block_ff_dim=256, block_auto_adjust_ff_dim=False, block_multiple_of=64, block_ffn_dim_multiplier=1.0,
            norm_eps=1e-5, conv_L_cache=3,
        )  # fmt: skip
    raise ValueError(kind)


ARCHITECTURES = {"llama": "LlamaForCausalLM", "llama8": "LlamaForCausalLM", "mla": "DeepseekV2ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM", "lfm2": "Lfm2ForCausalLM"}  # fmt: skip


def config_dir(kind: str, root: Path) -> Path:
    out = root / kind
    out.mkdir(parents=True, exist_ok=True)
    config = hf_config(kind)
    config.architectures = [ARCHITECTURES[kind]]  # else vLLM guesses (and may pick a pooling runner)
    config.save_pretrained(out)
    return out


def checkpoint_dir(kind: str, root: Path, seed: int = 0) -> Path:
    """A random-weight checkpoint (safetensors) of `kind` whose logits are spread out."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    out = root / kind
    config = hf_config(kind)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "layernorm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "lm_head" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif p.dim() >= 2:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
            else:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out, safe_serialization=True)
    raw = json.loads((out / "config.json").read_text())
    assert raw.get("model_type"), raw
    return out
