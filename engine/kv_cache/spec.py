"""`--kv-cache-dtype`: what the paged cache stores (torch is imported lazily: the CLI's --help reads
these names)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.engine.errors import InvalidRequest

if TYPE_CHECKING:
    import torch

# vLLM's names; "fp8" is e4m3 (vLLM's default fp8 flavour; e5m2 is not offered)
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3")
KV_SCALE_GRANULARITIES = ("head", "tensor")  # fp8: one scale per KV head of a layer, or per layer


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """ "auto" is the model's dtype."""
    import torch

    if name == "auto":
        return model_dtype
    if name in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    if name in ("bfloat16", "float16", "float32"):
        return getattr(torch, name)
    raise InvalidRequest(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")
