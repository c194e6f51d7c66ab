"""Rotary position embedding in the Hugging Face `rotate_half` layout (first half / second half of
each head, not interleaved pairs). The cos/sin table is computed once in fp32; the model looks up the
step's positions once and every layer applies them."""

from __future__ import annotations

import torch
from torch import nn


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [N, num_heads, head_dim], k: [N, num_kv_heads, head_dim], cos/sin: [N, 1, head_dim]."""
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float) -> None:
        super().__init__()
        assert head_dim % 2 == 0, head_dim
        self.head_dim = head_dim
        self.max_position = max_position
        self.base = base
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [N] -> (cos, sin), each [N, 1, head_dim]."""
        return (
            self.cos_cache.index_select(0, positions).unsqueeze(1),
            self.sin_cache.index_select(0, positions).unsqueeze(1),
        )
