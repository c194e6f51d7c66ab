"""ModelConfig parsing: the three families, both RoPE layouts, stop ids, and typed errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from kvstore.engine.config import ModelConfig, parse_dtype
from kvstore.engine.errors import EngineError, ModelLoadError, UnsupportedModel

from kvstore.keys import config_hash

pytestmark = pytest.mark.usefixtures("single_thread")

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "rope_theta": 500000.0,
    "eos_token_id": [7, 9],
    "bos_token_id": 5,
    "torch_dtype": "bfloat16",
}


def _write(tmp_path: Path, config: dict, generation: dict | None = None) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


def test_old_style_llama(tmp_path: Path) -> None:
    cfg = ModelConfig.from_pretrained(_write(tmp_path, LLAMA), model_name="m")
    assert (cfg.model_name, cfg.model_type, cfg.num_layers, cfg.num_kv_heads) == ("m", "llama", 3, 2)
    assert cfg.head_dim == 32  # hidden / heads when absent
    assert cfg.rope_theta == 500000.0 and cfg.rms_norm_eps == 1e-6
    assert cfg.eos_token_ids == (7, 9) and cfg.bos_token_id == 5
    assert cfg.dtype == torch.bfloat16 and not cfg.attention_bias and not cfg.tie_word_embeddings
    assert cfg.sliding_windows == (None, None, None)
    assert cfg.config_hash == config_hash(LLAMA)  # kvstore.keys.config_hash of config.json


def test_new_style_rope_and_generation_config(tmp_path: Path) -> None:
    raw = {k: v for k, v in LLAMA.items() if k not in ("rope_theta", "torch_dtype")}
    raw |= {
        "rope_parameters": {"rope_type": "default", "rope_theta": 1234.0},
        "dtype": "float32",
        "head_dim": 64,
    }
    cfg = ModelConfig.from_pretrained(_write(tmp_path, raw, {"eos_token_id": 3, "bos_token_id": 4}))
    assert cfg.rope_theta == 1234.0 and cfg.head_dim == 64 and cfg.dtype == torch.float32
    assert cfg.eos_token_ids == (3,) and cfg.bos_token_id == 4  # generation_config.json wins
    assert cfg.model_name == tmp_path.name


def test_qwen2_has_qkv_bias_and_no_window_unless_enabled() -> None:
    raw = LLAMA | {"model_type": "qwen2", "sliding_window": 32, "use_sliding_window": False}
    raw.pop("rope_theta")
    cfg = ModelConfig.from_dict(raw, "q")
    assert cfg.attention_bias and cfg.rope_theta == 1_000_000.0 and cfg.sliding_windows == (None,) * 3
    on = ModelConfig.from_dict(raw | {"use_sliding_window": True, "max_window_layers": 1}, "q")
    assert on.sliding_windows == (None, 32, 32)


def test_mistral_window(tiny_checkpoints) -> None:
    cfg = ModelConfig.from_pretrained(tiny_checkpoints["mistral"])
    assert cfg.sliding_windows == (7, 7) and cfg.model_type == "mistral"
    nulls = ModelConfig.from_dict(LLAMA | {"model_type": "mistral", "sliding_window": None}, "m")
    assert nulls.sliding_windows == (None,) * 3
    typed = ModelConfig.from_dict(
        LLAMA
        | {
            "model_type": "mistral",
            "sliding_window": 5,
            "layer_types": ["full_attention", "sliding_attention", "full_attention"],
        },
        "m",
    )
    assert typed.sliding_windows == (None, 5, None)


def test_tiny_checkpoints_parse(tiny_checkpoints) -> None:
    llama = ModelConfig.from_pretrained(tiny_checkpoints["llama"])
    assert llama.head_dim == 32 and llama.num_attention_heads == 4 and llama.rope_theta == 5000.0
    qwen = ModelConfig.from_pretrained(tiny_checkpoints["qwen2"])
    assert qwen.tie_word_embeddings and qwen.attention_bias and qwen.rope_theta == 1_000_000.0


def test_smollm2(smollm2_dir) -> None:
    cfg = ModelConfig.from_pretrained(smollm2_dir)
    assert cfg.model_name == "SmolLM2-135M-Instruct"
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (30, 3, 64, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.eos_token_ids == (2,)
    assert len(cfg.config_hash) == 32


def test_config_hash_ignores_key_order_and_tool_metadata() -> None:
    a = ModelConfig.from_dict(LLAMA, "m")
    b = ModelConfig.from_dict(dict(reversed(list(LLAMA.items()))), "m")
    c = ModelConfig.from_dict(LLAMA | {"rms_norm_eps": 1e-5}, "m")
    assert a.config_hash == b.config_hash != c.config_hash
    resaved = LLAMA | {"transformers_version": "9.9.9", "_name_or_path": "/elsewhere", "use_cache": False}
    assert ModelConfig.from_dict(resaved, "m").config_hash == a.config_hash


@pytest.mark.parametrize(
    "change, error",
    [
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, UnsupportedModel),
        ({"model_type": None}, UnsupportedModel),
        ({"hidden_act": "gelu"}, UnsupportedModel),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, UnsupportedModel),
        ({"num_key_value_heads": 3}, ModelLoadError),
        ({"hidden_size": "wide"}, ModelLoadError),
    ],
)
def test_bad_configs(change: dict, error: type) -> None:
    with pytest.raises(error):
        ModelConfig.from_dict(LLAMA | change, "m")


def test_missing_field_and_directory_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError):
        ModelConfig.from_dict({k: v for k, v in LLAMA.items() if k != "num_hidden_layers"}, "m")
    with pytest.raises(ModelLoadError, match="does not exist"):
        ModelConfig.from_pretrained(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(ModelLoadError):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(EngineError):
        ModelConfig.from_pretrained(tmp_path)


def test_parse_dtype() -> None:
    assert parse_dtype("torch.bfloat16") == torch.bfloat16
    assert parse_dtype(None, torch.float16) == torch.float16
    assert parse_dtype(torch.float32) == torch.float32
    with pytest.raises(UnsupportedModel):
        parse_dtype("int8")
