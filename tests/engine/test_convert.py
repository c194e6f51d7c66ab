"""GGUF -> HF conversion: a tiny synthetic GGUF round trip, the real SmolLM2, and the error paths."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from kvstore.engine.convert import SMOLLM2_NAME, convert_gguf, ensure_smollm2, is_complete, smollm2_gguf_path
from kvstore.engine.errors import ConversionError
from safetensors.numpy import load_file

pytestmark = pytest.mark.usefixtures("single_thread")

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, FFN, VOCAB = 4, 2, 8, 32, 48, 6


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k rows (the inverse of our un-permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny_gguf(path: Path, arch: str = "llama") -> dict[str, np.ndarray]:
    import gguf

    rng = np.random.default_rng(0)
    hf = {
        "model.embed_tokens.weight": rng.standard_normal((VOCAB, HIDDEN)),
        "model.norm.weight": rng.standard_normal(HIDDEN),
        "model.layers.0.input_layernorm.weight": rng.standard_normal(HIDDEN),
        "model.layers.0.post_attention_layernorm.weight": rng.standard_normal(HIDDEN),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((HEADS * HEAD_DIM, HIDDEN)),
        "model.layers.0.self_attn.k_proj.weight": rng.standard_normal((KV_HEADS * HEAD_DIM, HIDDEN)),
        "model.layers.0.self_attn.v_proj.weight": rng.standard_normal((KV_HEADS * HEAD_DIM, HIDDEN)),
        "model.layers.0.self_attn.o_proj.weight": rng.standard_normal((HIDDEN, HEADS * HEAD_DIM)),
        "model.layers.0.mlp.gate_proj.weight": rng.standard_normal((FFN, HIDDEN)),
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((FFN, HIDDEN)),
        "model.layers.0.mlp.down_proj.weight": rng.standard_normal((HIDDEN, FFN)),
    }
    hf = {k: v.astype(np.float32) for k, v in hf.items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(["<s>", "</s>", "a", "b", "ab", "Ġ"])
    w.add_token_types([3, 3, 1, 1, 1, 1])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "model.layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
        "model.layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
        "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
        "model.layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
        "model.layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
        "model.layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
        "model.layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
        "model.layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
        "model.layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    }
    for hf_name, gguf_name in names.items():
        t = hf[hf_name]
        if gguf_name == "blk.0.attn_q.weight":
            t = _llama_cpp_permute(t, HEADS)
        elif gguf_name == "blk.0.attn_k.weight":
            t = _llama_cpp_permute(t, KV_HEADS)
        w.add_tensor(gguf_name, np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def test_tiny_gguf_round_trip(tmp_path: Path) -> None:
    src = tmp_path / "tiny.gguf"
    expected = _write_tiny_gguf(src)
    out = convert_gguf(src, tmp_path / "models" / "tiny")
    assert is_complete(out)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 8)
    assert config["rms_norm_eps"] == 1e-6 and config["rope_parameters"]["rope_theta"] == 10000.0
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == VOCAB
    tensors = load_file(out / "model.safetensors")
    assert set(tensors) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)  # q/k un-permuted exactly
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"].startswith("{% for m in messages %}")
    assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<s>", "</s>")
    # No temp directories left behind next to the output.
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny"]


def test_convert_is_idempotent(tmp_path: Path) -> None:
    src = tmp_path / "tiny.gguf"
    _write_tiny_gguf(src)
    out = convert_gguf(src, tmp_path / "tiny")
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    src.unlink()  # a complete directory is reused without reading the source again
    assert convert_gguf(src, tmp_path / "tiny") == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_incomplete_directory_is_rebuilt(tmp_path: Path) -> None:
    src = tmp_path / "tiny.gguf"
    _write_tiny_gguf(src)
    out = tmp_path / "tiny"
    out.mkdir()
    (out / "config.json").write_text("{}")  # left by an interrupted run: no completion marker
    convert_gguf(src, out)
    assert is_complete(out) and json.loads((out / "config.json").read_text())["hidden_size"] == HIDDEN


def test_errors_are_typed(tmp_path: Path) -> None:
    with pytest.raises(ConversionError):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ConversionError):
        convert_gguf(bad, tmp_path / "out2")
    other = tmp_path / "other.gguf"
    _write_tiny_gguf(other, arch="gpt2")
    with pytest.raises(ConversionError, match="llama"):
        convert_gguf(other, tmp_path / "out3")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out3").exists()


def test_smollm2_directory(smollm2_dir: Path) -> None:
    assert smollm2_dir.name == SMOLLM2_NAME and is_complete(smollm2_dir)
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["rope_parameters"]["rope_theta"] == 100000.0 and config["tie_word_embeddings"] is True
    assert "<|im_start|>" in json.loads((smollm2_dir / "tokenizer_config.json").read_text())["chat_template"]
    assert json.loads((smollm2_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    assert ensure_smollm2(smollm2_dir.parent) == smollm2_dir  # reused, not reconverted


def test_smollm2_qk_match_transformers_unpermute(smollm2_dir: Path) -> None:
    """Our un-permute of the real q/k weights equals transformers' own GGUF loader."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    reader = GGUFReader(str(smollm2_gguf_path()))
    proc = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    with safe_open(smollm2_dir / "model.safetensors", framework="np") as f:
        for gguf_name, hf_name in (
            ("blk.3.attn_q.weight", "model.layers.3.self_attn.q_proj.weight"),
            ("blk.3.attn_k.weight", "model.layers.3.self_attn.k_proj.weight"),
        ):
            t = next(t for t in reader.tensors if t.name == gguf_name)
            raw = dequantize(t.data, t.tensor_type).astype(np.float32)
            ref = proc.process(raw, gguf_name).weights
            np.testing.assert_array_equal(f.get_tensor(hf_name), ref)


def test_cache_dir_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.engine.convert import default_cache_dir

    monkeypatch.setenv("KVSTORE_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path / "models"
    monkeypatch.delenv("KVSTORE_CACHE_DIR")
    assert default_cache_dir() == Path(os.path.expanduser("~")) / ".cache" / "kvstore" / "models"
