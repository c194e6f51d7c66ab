"""`ModelConfig`: what the engine needs from a Hugging Face `config.json` (Llama, Qwen2, Mistral).

Reads both the transformers 5 layout (`rope_parameters: {rope_type, rope_theta}`) and the older one
(top-level `rope_theta` / `rope_scaling`), and `generation_config.json` for the stop tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from kvstore.engine.errors import ModelLoadError, UnsupportedModel

from kvstore.keys import model_identity_hash

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
_DEFAULT_ROPE_THETA = {"llama": 10000.0, "qwen2": 1_000_000.0, "mistral": 10000.0}
_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def parse_dtype(name: str | torch.dtype | None, default: torch.dtype = torch.float32) -> torch.dtype:
    if name is None:
        return default
    if isinstance(name, torch.dtype):
        return name
    key = str(name).removeprefix("torch.")
    if key not in _DTYPES:
        raise UnsupportedModel(f"unsupported dtype {name!r}; use one of {sorted(set(_DTYPES))}")
    return _DTYPES[key]


def resolve_dtype(
    name: str, checkpoint_dtype: torch.dtype, device: str | torch.device = "cpu"
) -> torch.dtype:
    """`--dtype`. "auto", as in vLLM: bfloat16 on CPU whatever the checkpoint holds (the CPU kernels'
    fast path: 16-bit weights, fp32 arithmetic); on a GPU the checkpoint's 16-bit dtype, bfloat16 for
    an fp32 checkpoint."""
    if name != "auto":
        return parse_dtype(name)
    if torch.device(device).type == "cpu" or checkpoint_dtype not in (torch.float16, torch.bfloat16):
        return torch.bfloat16
    return checkpoint_dtype


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return data


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@dataclass(frozen=True)
class ModelConfig:
    model_name: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v (Qwen2); o_proj never has one in this family
    mlp_bias: bool
    sliding_windows: tuple[int | None, ...]  # per layer: attend to the last N positions, or everything
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: torch.dtype
    config_hash: str
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False, hash=False)

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return self.num_key_value_heads

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, model_name: str | None = None) -> ModelConfig:
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise ModelLoadError(f"model directory {model_dir} does not exist")
        if not (model_dir / "config.json").is_file():
            raise ModelLoadError(f"{model_dir} has no config.json")
        raw = _read_json(model_dir / "config.json")
        generation = {}
        if (model_dir / "generation_config.json").is_file():
            generation = _read_json(model_dir / "generation_config.json")
        return cls.from_dict(raw, model_name or model_dir.name, generation)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], model_name: str, generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = raw.get("architectures")
            raise UnsupportedModel(
                f"model_type {model_type!r} (architectures {archs}) is not supported; "
                f"the engine serves {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            layers = int(raw["num_hidden_layers"])
            kv_heads = int(raw.get("num_key_value_heads") or heads)
            head_dim = int(raw.get("head_dim") or hidden // heads)
            intermediate = int(raw["intermediate_size"])
            vocab = int(raw["vocab_size"])
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"config.json of {model_name} lacks or mangles a field: {e!r}") from e
        if heads % kv_heads:
            raise ModelLoadError(
                f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"hidden_act {raw.get('hidden_act')!r} is not supported (only silu)")

        rope = raw.get("rope_parameters") or {}
        if "rope_type" not in rope and raw.get("rope_scaling"):
            rope = {**raw["rope_scaling"], **rope}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise UnsupportedModel(f"rope_type {rope_type!r} is not supported (only default RoPE)")
        rope_theta = float(rope.get("rope_theta") or raw.get("rope_theta") or _DEFAULT_ROPE_THETA[model_type])

        # Qwen2 always has q/k/v biases (its config has no flag for it).
        attention_bias = model_type == "qwen2" or bool(raw.get("attention_bias", False))
        windows = _sliding_windows(raw, model_type, layers)

        generation = generation or {}
        eos = _ids(generation.get("eos_token_id")) or _ids(raw.get("eos_token_id"))
        bos = generation.get("bos_token_id", raw.get("bos_token_id"))
        return cls(
            model_name=model_name,
            model_type=model_type,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=vocab,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_windows=windows,
            eos_token_ids=eos,
            bos_token_id=int(bos) if bos is not None else None,
            dtype=parse_dtype(raw.get("dtype") or raw.get("torch_dtype"), torch.float32),
            config_hash=model_identity_hash(raw),
            raw=raw,
        )


def _sliding_windows(raw: dict[str, Any], model_type: str, layers: int) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    if model_type == "qwen2" and not raw.get("use_sliding_window", False):
        window = None
    if not window:
        return (None,) * layers
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != layers:
            raise ModelLoadError(f"layer_types has {len(layer_types)} entries for {layers} layers")
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    if model_type == "qwen2":
        # Qwen2: layers from max_window_layers on use the window (transformers' rule).
        first = int(raw.get("max_window_layers", layers))
        return tuple(int(window) if i >= first else None for i in range(layers))
    return (int(window),) * layers
