"""SiLU-and-multiply over a fused [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kvstore.engine.layers import cpu_ops
from torch import nn


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.use_cpu_kernels = False

    def process_weights_after_loading(self, use_cpu_kernels: bool) -> None:
        self.use_cpu_kernels = use_cpu_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_cpu_kernels and x.dtype == torch.float32 and x.device.type == "cpu":
            return cpu_ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
