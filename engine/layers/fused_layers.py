"""Every decoder layer of a decode step in one call of the CPU kernel library (`decoder_layers` in
`cpu_kernels.c`): the layers' packed weights, norms and KV caches in one table the C side walks."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from kvstore.engine.layers.cpu_lib import KV_TYPES, W_TYPES, check_rows, check_scales, lib, ptr_of


class _DecodeLayer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in (
        "qkv", "o", "gate_up", "down", "qkv_bias", "o_bias", "gate_up_bias", "down_bias", "in_norm", "post_norm",
        "k_cache", "v_cache", "k_scale", "v_scale")] + [("window", ctypes.c_int64)]  # fmt: skip


class _DecodeShape(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in (
        "hidden", "inter", "Hq", "Hkv", "D", "block_size", "s_block", "s_tok", "s_head", "wtype", "norm_type",
        "kv_type")] + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]  # fmt: skip


@dataclass
class DecodeLayerWeights:
    """What `decoder_layers` reads of one decoder layer: packed weights [panels, K, 32] with their fp32
    biases (or None), the two RMSNorm weights, the layer's K and V caches and its sliding window; an fp8
    cache's scales per KV head (fp32 [Hkv]; None for 16/32-bit caches)."""

    qkv: tuple[torch.Tensor, torch.Tensor | None]
    o: tuple[torch.Tensor, torch.Tensor | None]
    gate_up: tuple[torch.Tensor, torch.Tensor | None]
    down: tuple[torch.Tensor, torch.Tensor | None]
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    window: int | None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


class FusedLayers:
    """Every decoder layer of a step in one C call, running the same kernels in the same order as the
    layer-by-layer path with every row's attention in the kernel (bit-identical results), without its
    ~10 Python calls per layer. Single-threaded: use it when torch runs one intra-op thread."""

    def __init__(self, layers: list[DecodeLayerWeights], *, num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate_size: int, eps: float, scale: float) -> None:  # fmt: skip
        first = layers[0]
        hidden = first.in_norm.shape[0]
        nb, bs, hkv, d = first.k_cache.shape
        assert hkv == num_kv_heads and d == head_dim and d % 16 == 0 and num_heads % num_kv_heads == 0
        assert first.k_cache.dtype in KV_TYPES
        fp8 = first.k_cache.dtype == torch.float8_e4m3fn
        self.sizes = (hidden, num_heads * head_dim, num_kv_heads * head_dim, intermediate_size)
        self._keep: list[torch.Tensor] = []  # every tensor the C side points into stays alive
        table = (_DecodeLayer * len(layers))()
        for entry, w in zip(table, layers, strict=True):
            assert (
                w.k_cache.stride() == first.k_cache.stride() and w.v_cache.stride() == first.k_cache.stride()
            )
            assert w.k_cache.dtype == w.v_cache.dtype == first.k_cache.dtype and w.in_norm.is_contiguous()
            for name in ("qkv", "o", "gate_up", "down"):
                packed, bias = getattr(w, name)
                assert packed.dtype == layers[0].qkv[0].dtype and packed.is_contiguous()
                assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
                setattr(entry, name, packed.data_ptr())
                setattr(entry, f"{name}_bias", ptr_of(bias))
                self._keep += [packed] + ([bias] if bias is not None else [])
            entry.in_norm, entry.post_norm = w.in_norm.data_ptr(), w.post_norm.data_ptr()
            entry.k_cache, entry.v_cache = w.k_cache.data_ptr(), w.v_cache.data_ptr()
            entry.window = int(w.window or 0)
            check_scales(hkv, fp8, w.k_scale, w.v_scale)
            entry.k_scale, entry.v_scale = ptr_of(w.k_scale), ptr_of(w.v_scale)
            self._keep += [s for s in (w.k_scale, w.v_scale) if s is not None]
            self._keep += [w.in_norm, w.post_norm, w.k_cache, w.v_cache]
        sb, st, sh, _ = first.k_cache.stride()
        self._shape = _DecodeShape(
            hidden, intermediate_size, num_heads, num_kv_heads, head_dim, bs, sb, st, sh,
            W_TYPES[first.qkv[0].dtype], W_TYPES[first.in_norm.dtype], KV_TYPES[first.k_cache.dtype], eps, scale,
        )  # fmt: skip
        self._table = table
        self.num_layers = len(layers)
        self._cache_ptrs = (first.k_cache.data_ptr(), ptr_of(first.k_scale))

    def serves(self, k_cache: torch.Tensor, k_scale: torch.Tensor | None) -> bool:
        """Whether the table still points at this cache and these fp8 scales (the first layer's)."""
        return self._cache_ptrs == (k_cache.data_ptr(), ptr_of(k_scale))

    def __call__(self, res: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, slots: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """res [M, hidden] fp32 embeddings (becomes the residual stream, in place) -> (the last layer's
        MLP output, res); the model's final norm is of their sum. Row r's attention: `block_tables[r]`
        and `context_lens[r]` (AttentionPlan.per_row)."""
        check_rows(res)
        m = res.shape[0]
        assert res.is_contiguous() and m == positions.shape[0] == slots.shape[0] == context_lens.shape[0]
        assert (
            positions.dtype == slots.dtype == torch.int64
            and positions.is_contiguous()
            and slots.is_contiguous()
        )
        assert block_tables.dtype == context_lens.dtype == torch.int32 and block_tables.stride(1) == 1
        assert cos_sin.dtype == torch.float32 and cos_sin.is_contiguous()
        hidden, qs, kvs, inter = self.sizes
        x, normed = torch.empty(m, hidden), torch.empty(m, hidden)
        qkv, attn = torch.empty(m, qs + 2 * kvs), torch.empty(m, qs)
        gu, act = torch.empty(m, 2 * inter), torch.empty(m, inter)
        lib().decoder_layers(ctypes.addressof(self._table), self.num_layers, ctypes.addressof(self._shape),
                             res.data_ptr(), x.data_ptr(), normed.data_ptr(), qkv.data_ptr(), attn.data_ptr(),
                             gu.data_ptr(), act.data_ptr(), positions.data_ptr(), cos_sin.data_ptr(),
                             slots.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
                             context_lens.data_ptr(), m)  # fmt: skip
        return x, res
