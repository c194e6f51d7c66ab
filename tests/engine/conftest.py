"""Shared engine fixtures: tiny random HF checkpoints and the real SmolLM2 directory.

The tiny checkpoints have PERTURBED biases and norm weights (std ~0.08): with the default init (bias 0,
norm 1) a model that forgets a bias or a norm weight would still match Hugging Face.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

TINY_ARCHS = ("llama", "qwen2", "mistral")


def _tiny_config(arch: str):
    import transformers

    common = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "llama":
        # head_dim 32 != hidden / heads (16): checks that head_dim is read, not derived.
        return transformers.LlamaConfig(
            **common, head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 5000.0}
        )
    if arch == "qwen2":
        return transformers.Qwen2Config(
            **{**common, "tie_word_embeddings": True},
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        )
    if arch == "mistral":
        # A window smaller than the test sequences, so that ignoring it shows.
        return transformers.MistralConfig(
            **common, sliding_window=7, rope_parameters={"rope_type": "default", "rope_theta": 20000.0}
        )
    raise ValueError(arch)


def _perturb(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.08)
            elif p.dim() == 2:
                # Larger weights than the 0.02 init: sharper attention, so position bugs show.
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def make_tiny_checkpoint(arch: str, out: Path, seed: int = 0) -> Path:
    import transformers

    config = _tiny_config(arch)
    torch.manual_seed(seed)
    cls = {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "mistral": transformers.MistralForCausalLM,
    }[arch]
    model = cls(config).to(torch.float32).eval()
    _perturb(model, seed + 1)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """`{arch: model_dir}` for tiny llama / qwen2 / mistral checkpoints."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: make_tiny_checkpoint(arch, root / arch, seed=i) for i, arch in enumerate(TINY_ARCHS)}


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct as an HF directory (converted once, cached in ~/.cache/kvstore)."""
    from engine.convert import ensure_smollm2

    return ensure_smollm2()
