"""RMSNorm as Hugging Face computes it (in fp32, weight applied after casting back); on fp32
activations with the CPU kernels on, one fused kernel call (`cpu_ops.rms_norm`)."""

from __future__ import annotations

import torch
from kvstore.engine.layers import cpu_ops
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.use_cpu_kernels = False

    def process_weights_after_loading(self, use_cpu_kernels: bool) -> None:
        self.use_cpu_kernels = use_cpu_kernels and self.weight.device.type == "cpu"

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """`norm(x)`, or with `residual`: `(norm(x + residual), x + residual)` (the pre-norm pattern;
        the kernel path updates `residual` in place)."""
        if self.use_cpu_kernels and x.dtype == torch.float32:
            out = cpu_ops.rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)
