"""Model implementations. The Llama code also serves Qwen2 (q/k/v bias) and Mistral (sliding window)."""

from __future__ import annotations

from kvstore.engine.models.llama import LlamaForCausalLM

MODEL_REGISTRY = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
}

__all__ = ["LlamaForCausalLM", "MODEL_REGISTRY"]
