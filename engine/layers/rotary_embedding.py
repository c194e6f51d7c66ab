"""Rotary position embedding in the Hugging Face `rotate_half` layout (first half / second half of
each head, not interleaved pairs). The cos/sin table is computed once in fp32; the model looks up the
step's positions once (`RotaryEmbedding(positions)` -> `RoPEStep`) and every layer applies them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvstore.engine.layers import cpu_ops
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


@dataclass
class RoPEStep:
    """One step's rotary inputs: cos/sin rows of its positions (torch path), or the positions and the
    whole [max_position, head_dim] cos|sin table (CPU kernel path, which rotates in place)."""

    positions: torch.Tensor
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    cos_sin: torch.Tensor | None = None

    def apply(
        self, q: torch.Tensor, k: torch.Tensor, num_heads: int, num_kv_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [N, num_heads * head_dim], k: [N, num_kv_heads * head_dim] (views of one qkv output are
        fine) -> rotated q, k of the same shapes."""
        n = q.shape[0]
        if self.cos_sin is not None and q.dtype == torch.float32:
            cpu_ops.rope(q, k, self.positions, self.cos_sin, num_heads, num_kv_heads)
            return q, k
        d = q.shape[1] // num_heads
        if self.cos is None:
            self.cos = self.cos_sin[:, : d // 2].repeat(1, 2).index_select(0, self.positions).unsqueeze(1)
            self.sin = self.cos_sin[:, d // 2 :].repeat(1, 2).index_select(0, self.positions).unsqueeze(1)
        q, k = apply_rotary_emb(q.view(n, num_heads, d), k.view(n, num_kv_heads, d), self.cos, self.sin)
        return q.reshape(n, -1), k.reshape(n, -1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float) -> None:
        super().__init__()
        assert head_dim % 2 == 0, head_dim
        self.head_dim = head_dim
        self.max_position = max_position
        self.base = base
        freqs = self._freqs()
        emb = torch.cat((freqs, freqs), dim=-1)
        # (model.to(dtype) rounds these to the model's dtype, as HF's cos/sin are before use)
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)
        # [max_position, head_dim]: cos | sin of the half-dim frequencies (the CPU kernels' table, fp32)
        self.register_buffer("cos_sin", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)
        self.use_cpu_kernels = False

    def _freqs(self) -> torch.Tensor:
        d = self.head_dim
        inv_freq = 1.0 / (self.base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        return torch.outer(torch.arange(self.max_position, dtype=torch.float32), inv_freq)

    def process_weights_after_loading(self, use_cpu_kernels: bool) -> None:
        self.use_cpu_kernels = use_cpu_kernels and self.cos_sin.device.type == "cpu"
        if self.use_cpu_kernels and self.cos_sin.dtype != torch.float32:  # fp32 activations, fp32 table
            freqs = self._freqs()
            self.cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(self.cos_sin.device)

    def forward(self, positions: torch.Tensor) -> RoPEStep:
        """positions: [N] -> this step's rotary inputs."""
        if self.use_cpu_kernels:
            return RoPEStep(positions.contiguous(), cos_sin=self.cos_sin)
        return RoPEStep(
            positions,
            self.cos_cache.index_select(0, positions).unsqueeze(1),
            self.sin_cache.index_select(0, positions).unsqueeze(1),
        )
