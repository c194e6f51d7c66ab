"""The paged attention layer: stores the step's K/V into `kv_cache`, then attends over the cache.

`kv_cache` ([2, num_blocks, block_size, num_kv_heads, head_dim]) is assigned by the model runner as a
view of its one big cache tensor; until then it is an empty tensor. On CUDA, decode steps use the
Triton kernels (`triton_attention.py`); everything else takes the torch path (`paged_attention.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.errors import EngineError
from engine.layers.paged_attention import paged_attention, store_kvcache


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
        # None: the Triton kernels on CUDA, torch elsewhere. True/False force it (tests run the kernels
        # on CPU under TRITON_INTERPRET=1, or the torch path on CUDA for comparison).
        self.use_triton: bool | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """q: [N, num_heads * head_dim], k/v: [N, num_kv_heads * head_dim] -> [N, num_heads * head_dim]."""
        if self.kv_cache.dim() != 5:
            raise EngineError(
                "Attention.kv_cache is not set: the model runner assigns it before the first step"
            )
        n = q.shape[0]
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.use_triton or (self.use_triton is None and q.is_cuda):
            from engine.layers import triton_attention

            triton_attention.store_kvcache(k, v, self.kv_cache, attn_metadata.slot_mapping)
            if attn_metadata.is_decode:
                o = triton_attention.paged_decode_attention(
                    q, self.kv_cache, attn_metadata, self.scale, self.sliding_window
                )
                return o.view(n, -1)
        else:
            store_kvcache(k, v, self.kv_cache, attn_metadata.slot_mapping)
        key, value = (k, v) if k.dtype == self.kv_cache.dtype else (None, None)
        o = paged_attention(q, self.kv_cache, attn_metadata, self.scale, self.sliding_window, key, value)
        return o.view(n, -1)
