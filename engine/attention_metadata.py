"""What one model step needs to read and write the paged KV cache. The contract between the runner
(which builds it from the scheduled sequences) and the attention layers (which consume it).

Every step is "varlen paged": sequence i contributes q_len_i new tokens (a prefill chunk, or 1 when
decoding) on top of context_len_i - q_len_i tokens already in the cache. Token j of sequence i (global
row cu_seqlens_q[i] + j) sits at position context_len_i - q_len_i + j and attends causally to every
cached and new token at positions <= its own. Prefill, chunked prefill and decode are the same
computation; `is_decode` only says that every q_len is 1 so the decode kernel applies.

KV cache per layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]` (0 = K, 1 = V). Token at
position p of a sequence lives in block block_tables[i, p // block_size] at offset p % block_size;
slot = block * block_size + offset. New tokens' K/V are written to `slot_mapping` before attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    cu_seqlens_q: torch.Tensor  # [B + 1] int32, prefix sums of q_len
    context_lens: torch.Tensor  # [B] int32, cached + new tokens per sequence
    slot_mapping: torch.Tensor  # [num_new_tokens] int64, cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with -1
    max_q_len: int
    max_context_len: int
    block_size: int

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def is_decode(self) -> bool:
        return self.max_q_len == 1
