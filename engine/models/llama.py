"""Llama / Qwen2 / Mistral for the paged engine (nano-vllm style).

All tokens of a step (prefill chunks and decode tokens of many sequences) travel as one flat batch
[N, hidden]; `AttentionMetadata` tells attention where each sequence's tokens and cached KV are.

Activations run in the weights' dtype, except with 16-bit weights on the CPU kernels
(`process_weights_after_loading(use_cpu_kernels=True)`): then they are fp32 and only the weights (and
the KV cache) are 16-bit, which is both faster and closer to fp32 on CPUs without bf16 arithmetic.
"""

from __future__ import annotations

import torch
from kvstore.engine.attention_metadata import AttentionMetadata
from kvstore.engine.config import ModelConfig
from kvstore.engine.layers import cpu_lib
from kvstore.engine.layers.activation import SiluAndMul
from kvstore.engine.layers.attention import Attention
from kvstore.engine.layers.fused_layers import DecodeLayerWeights, FusedLayers
from kvstore.engine.layers.huge_pages import to_huge_pages
from kvstore.engine.layers.layernorm import RMSNorm
from kvstore.engine.layers.linear import MergedLinear, QKVLinear, RowLinear
from kvstore.engine.layers.paged_attention import get_plan
from kvstore.engine.layers.rotary_embedding import RoPEStep, RotaryEmbedding
from torch import nn


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVLinear(
            config.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, bias=config.attention_bias
        )
        self.o_proj = RowLinear(self.q_size, config.hidden_size)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            sliding_window=config.sliding_windows[layer_idx],
        )

    def forward(
        self, rope: RoPEStep, hidden_states: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = rope.apply(q, k, self.num_heads, self.num_kv_heads)
        return self.o_proj(self.attn(q, k, v, attn_metadata))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [size, size], bias=config.mlp_bias)
        self.down_proj = RowLinear(size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        rope: RoPEStep,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(rope, hidden_states, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # One table for all layers (as in HF); its positions are looked up once per step.
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.act_dtype: torch.dtype | None = None  # None: the weights' dtype
        # every layer of a step in one C call (set with 16-bit weights on the CPU kernels; built on
        # first use, once the runner has assigned the KV cache)
        self.use_fused_layers = False
        self._fused: FusedLayers | None = None

    def _fused_layers(self) -> FusedLayers | None:
        first = self.layers[0].self_attn.attn
        cache = first.kv_cache
        if not (
            self.use_fused_layers
            and torch.get_num_threads() == 1
            and cache.dim() == 5
            and cache.dtype in cpu_lib.KV_TYPES
        ):
            return None
        if self._fused is None or not self._fused.serves(cache[0], first.k_scale):
            cfg = self.config
            attn = [layer.self_attn.attn for layer in self.layers]

            def linear(m: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
                return m.packed, m._bias_f32

            self._fused = FusedLayers(
                [
                    DecodeLayerWeights(
                        linear(layer.self_attn.qkv_proj), linear(layer.self_attn.o_proj),
                        linear(layer.mlp.gate_up_proj), linear(layer.mlp.down_proj),
                        layer.input_layernorm.weight.data, layer.post_attention_layernorm.weight.data,
                        a.kv_cache[0], a.kv_cache[1], a.sliding_window, a.k_scale, a.v_scale,
                    )  # fmt: skip
                    for layer, a in zip(self.layers, attn, strict=True)
                ],
                num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                intermediate_size=cfg.intermediate_size, eps=cfg.rms_norm_eps, scale=attn[0].scale,
            )  # fmt: skip
        return self._fused

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        if self.act_dtype is not None:
            hidden_states = hidden_states.to(self.act_dtype)
        rope = self.rotary_emb(positions)
        fused = self._fused_layers()
        if fused is not None:
            tables, lens = get_plan(attn_metadata).per_row
            hidden_states, residual = fused(
                hidden_states.contiguous(),
                rope.positions,
                rope.cos_sin,
                attn_metadata.slot_mapping,
                tables,
                lens,
            )
        else:
            residual = None
            for layer in self.layers:
                hidden_states, residual = layer(rope, hidden_states, residual, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    # checkpoint name -> (fused parameter name, shard id); how the loader fills fused weights
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = RowLinear(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def process_weights_after_loading(self, use_cpu_kernels: bool) -> None:
        """After the load (and the cast to the serving dtype) every layer prepares for its kernels: the
        paged decode attention kernel serves any dtype; with 16-bit weights the GEMMs, norms, RoPE
        and SiLU run in the CPU kernels too, on fp32 activations. fp32 weights keep torch's GEMMs."""
        weights = self.model.embed_tokens.weight
        w16 = (
            use_cpu_kernels
            and weights.device.type == "cpu"
            and weights.dtype in (torch.bfloat16, torch.float16)
        )
        tied = self.config.tie_word_embeddings
        for module in self.modules():
            if isinstance(module, Attention):
                module.process_weights_after_loading(use_cpu_kernels, every_row=w16)
            elif module is self.lm_head:
                module.process_weights_after_loading(w16, keep_weight=tied)
            elif module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading(w16)
        if w16:  # the GEMMs' weights, streamed by every decode step, on huge pages
            linears = [m for m in self.modules() if getattr(m, "packed", None) is not None]
            for m, packed in zip(linears, to_huge_pages([m.packed for m in linears]), strict=True):
                m.packed = packed
        self.model.act_dtype = torch.float32 if w16 else None
        self.model.use_fused_layers = w16 and all(
            layer.self_attn.attn.every_row for layer in self.model.layers
        )

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions: [N] -> hidden states [N, hidden_size]."""
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> fp32 logits [n, vocab_size]."""
        return self.lm_head(hidden_states).float()
