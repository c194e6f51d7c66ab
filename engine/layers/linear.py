"""Linear layers whose weights are loaded from several checkpoint tensors (vLLM's names).

`QKVLinear` fuses q_proj/k_proj/v_proj and `MergedLinear` fuses gate_proj/up_proj into one matmul;
each parameter carries a `weight_loader(param, tensor, shard_id)` that copies a checkpoint tensor
into its slice.

After loading, `process_weights_after_loading(use_cpu_kernels=True)` (vLLM's name) repacks 16-bit
weights for the CPU kernels (`cpu_ops.gemm_w16`: 16-bit weights, fp32 activations, on AMX CPUs rounded
to bf16 for the tile units) and drops the original; fp32 weights keep torch's `F.linear` (the exactness reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kvstore.engine.layers import cpu_ops
from torch import nn


def default_weight_loader(
    param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
) -> None:
    assert shard_id is None, shard_id
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}"
        )
    param.data.copy_(loaded)


class LinearBase(nn.Module):
    """`y = x @ W.T (+ b)`: torch's F.linear, or the CPU kernel on repacked 16-bit weights."""

    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(self) -> None:
        super().__init__()
        self.packed: torch.Tensor | None = None  # [ceil(out/32), in, 32] for cpu_ops.gemm_w16
        self.out_features = 0
        self._bias_f32: torch.Tensor | None = None

    def process_weights_after_loading(self, use_cpu_kernels: bool, keep_weight: bool = False) -> None:
        """Repack a 16-bit CPU weight for the CPU kernels; `keep_weight` when another module shares it
        (a tied embedding)."""
        w = self.weight
        if not (use_cpu_kernels and w.device.type == "cpu" and w.dtype in (torch.bfloat16, torch.float16)):
            return
        self.out_features = w.shape[0]
        self.packed = cpu_ops.pack_weight(w.data)
        self._bias_f32 = None if self.bias is None else self.bias.data.float().contiguous()
        if not keep_weight:
            self.weight = nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return cpu_ops.gemm_w16(x, self.packed, self.out_features, self._bias_f32)
        return F.linear(x, self.weight, self.bias)


class MergedLinear(LinearBase):
    """`y = x @ W.T (+ b)` with W the row-wise concatenation of `output_sizes` shards."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        self.output_sizes = list(output_sizes)
        self.offsets = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]
        total = sum(self.output_sizes)
        self.weight = nn.Parameter(torch.empty(total, input_size))
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.zeros(total))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def _shard_index(self, shard_id: str | int) -> int:
        assert isinstance(shard_id, int), shard_id
        return shard_id

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        if shard_id is None:  # an already fused checkpoint tensor
            default_weight_loader(param, loaded)
            return
        i = self._shard_index(shard_id)
        expected = (self.output_sizes[i], *param.shape[1:])
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"shape mismatch: shard {shard_id} expects {expected}, checkpoint has {tuple(loaded.shape)}"
            )
        param.data.narrow(0, self.offsets[i], self.output_sizes[i]).copy_(loaded)


class QKVLinear(MergedLinear):
    """q, k and v projections in one matmul; shards are "q", "k", "v"."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, [self.q_size, self.kv_size, self.kv_size], bias=bias)

    def _shard_index(self, shard_id: str | int) -> int:
        return {"q": 0, "k": 1, "v": 2}[shard_id] if isinstance(shard_id, str) else shard_id


class RowLinear(LinearBase):
    """A plain `y = x @ W.T (+ b)` that loads one checkpoint tensor (o_proj, down_proj, lm_head)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.weight.weight_loader = default_weight_loader
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size))
            self.bias.weight_loader = default_weight_loader
        else:
            self.register_parameter("bias", None)
