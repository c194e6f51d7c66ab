"""The paged attention layer: stores the step's K/V into `kv_cache`, then attends over the cache.

`kv_cache` ([2, num_blocks, block_size, num_kv_heads, head_dim]) is assigned by the model runner as a
view of its one big cache tensor; until then it is an empty tensor. An fp8 cache also gets `k_scale`
and `v_scale` ([num_kv_heads] fp32). On CUDA, decode steps use the Triton kernels
(`triton_attention.py`); on CPU with the C kernels (`cpu_ops`) and fp32 activations the K/V store
and decode rows run there; everything else takes the torch path (`paged_attention.py`).
"""

from __future__ import annotations

import torch
from kvstore.engine.attention_metadata import AttentionMetadata
from kvstore.engine.errors import EngineError
from kvstore.engine.layers import cpu_ops
from kvstore.engine.layers.paged_attention import FP8, paged_attention, store_kvcache
from torch import nn


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.kv_cache = torch.tensor([])
        self.k_scale: torch.Tensor | None = None  # fp8 caches: K = k_scale[head] * stored value
        self.v_scale: torch.Tensor | None = None
        # None: the Triton kernels on CUDA, torch elsewhere. True/False force it (tests run the kernels
        # on CPU under TRITON_INTERPRET=1, or the torch path on CUDA for comparison).
        self.use_triton: bool | None = None
        self.use_cpu_kernels = False
        self.every_row = False  # prefill rows through the kernel too (see paged_attention)

    def process_weights_after_loading(self, use_cpu_kernels: bool, every_row: bool = False) -> None:
        group = self.num_heads // self.num_kv_heads
        self.use_cpu_kernels = (
            use_cpu_kernels and self.head_dim % 16 == 0 and self.head_dim <= 256 and group <= 16
        )
        self.every_row = self.use_cpu_kernels and every_row

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """q: [N, num_heads * head_dim], k/v: [N, num_kv_heads * head_dim] -> [N, num_heads * head_dim]."""
        cache = self.kv_cache
        if cache.dim() != 5:
            raise EngineError(
                "Attention.kv_cache is not set: the model runner assigns it before the first step"
            )
        n = q.shape[0]
        fp8 = cache.dtype == FP8
        if fp8 and (self.k_scale is None or self.v_scale is None):
            raise EngineError("an fp8 KV cache needs Attention.k_scale and v_scale")
        kernels = self.use_cpu_kernels and q.dtype == torch.float32 and q.device.type == "cpu"
        q3 = q.view(n, self.num_heads, self.head_dim)
        k3 = k.view(n, self.num_kv_heads, self.head_dim)
        v3 = v.view(n, self.num_kv_heads, self.head_dim)
        if self.use_triton or (self.use_triton is None and q.is_cuda):
            if fp8:
                raise EngineError("the Triton attention kernels do not read fp8 KV caches yet")
            from kvstore.engine.layers import triton_attention

            triton_attention.store_kvcache(k3, v3, cache, attn_metadata.slot_mapping)
            if attn_metadata.is_decode:
                o = triton_attention.paged_decode_attention(
                    q3, cache, attn_metadata, self.scale, self.sliding_window
                )
                return o.view(n, -1)
        elif kernels and not fp8:
            cpu_ops.store_kv(k, v, cache[0], cache[1], attn_metadata.slot_mapping)
        else:
            store_kvcache(k3, v3, cache, attn_metadata.slot_mapping, self.k_scale, self.v_scale)
        o = paged_attention(
            q3, cache, attn_metadata, self.scale, self.sliding_window, k3, v3, self.k_scale, self.v_scale,
            use_cpu_kernels=kernels, every_row=self.every_row,
        )  # fmt: skip
        return o.view(n, -1)
