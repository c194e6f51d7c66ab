"""xgrammar's `TokenizerInfo` from the `tokenizers` object the engine already loaded (no transformers
tokenizer needed): the vocabulary in id order, how its tokens encode bytes, and the stop tokens.

Two choices differ from `xgr.TokenizerInfo.from_huggingface` (what vLLM uses):
- special added tokens (`<|im_start|>`, `<repo_name>`, ...) are given no text, so the grammar never
  lets the model "spell" a literal `<|im_start|>` inside a JSON string (xgrammar treats an empty
  token as special and masks it everywhere); the stop tokens are kept and allowed at the end;
- the stop tokens are the engine's EOS set (config + generation_config + tokenizer), not only the
  tokenizer's `eos_token`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

import xgrammar as xgr


def _components(spec: Any, sequence_key: str) -> list[dict]:
    """A tokenizer.json component (decoder, normalizer, ...) as a flat list, `Sequence` unpacked."""
    if not isinstance(spec, dict):
        return []
    if spec.get("type") == "Sequence":
        return [c for c in spec.get(sequence_key) or [] if isinstance(c, dict)]
    return [spec]


def detect_vocab_type(tokenizer_json: dict) -> tuple[xgr.VocabType, bool]:
    """(vocab type, add_prefix_space) from tokenizer.json, by the rules of xgrammar's own detector:
    the first `ByteLevel` / `ByteFallback` decoder decides the type (else RAW); a `Prepend "▁"`
    normalizer or a `Metaspace` pre-tokenizer that prepends means the tokenizer adds a prefix space."""
    vocab_type = xgr.VocabType.RAW
    for decoder in _components(tokenizer_json.get("decoder"), "decoders"):
        if decoder.get("type") == "ByteLevel":
            vocab_type = xgr.VocabType.BYTE_LEVEL
            break
        if decoder.get("type") == "ByteFallback":
            vocab_type = xgr.VocabType.BYTE_FALLBACK
            break
    prepends = any(
        n.get("type") == "Prepend" and n.get("prepend") == "\u2581"
        for n in _components(tokenizer_json.get("normalizer"), "normalizers")
    )
    pre = tokenizer_json.get("pre_tokenizer")
    metaspace = (
        isinstance(pre, dict)
        and pre.get("type") == "Metaspace"
        and pre.get("prepend_scheme") in ("always", "first")
    )
    return vocab_type, prepends or metaspace


def encoded_vocab(tokenizer: Any, vocab_size: int, keep: Iterable[int] = ()) -> list[str]:
    """Token strings indexed by id, `vocab_size` long (the model's logits width, which may differ from
    the tokenizer's). Ids without a token and special added tokens (except `keep`) are empty."""
    vocab = [""] * vocab_size
    for token, idx in tokenizer.get_vocab(with_added_tokens=True).items():
        if 0 <= idx < vocab_size:
            vocab[idx] = token
    keep = set(keep)
    for idx, added in tokenizer.get_added_tokens_decoder().items():
        if added.special and idx < vocab_size and idx not in keep:
            vocab[idx] = ""
    return vocab


def build_tokenizer_info(
    tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]
) -> tuple[xgr.TokenizerInfo, str]:
    """The TokenizerInfo for a `tokenizers.Tokenizer`, and a fingerprint of everything a compiled
    grammar depends on (vocabulary, its encoding, stop tokens) for the compile cache's key."""
    stops = sorted({int(t) for t in stop_token_ids if 0 <= int(t) < vocab_size})
    assert stops, "structured output needs at least one stop token inside the vocabulary"
    spec = json.loads(tokenizer.to_str())
    vocab_type, add_prefix_space = detect_vocab_type(spec)
    vocab = encoded_vocab(tokenizer, vocab_size, keep=stops)
    info = xgr.TokenizerInfo(
        vocab, vocab_type, vocab_size=vocab_size, stop_token_ids=stops, add_prefix_space=add_prefix_space
    )
    digest = hashlib.sha256()
    digest.update(json.dumps([vocab_type.value, add_prefix_space, vocab_size, stops]).encode())
    for token in vocab:
        digest.update(token.encode() + b"\0")
    return info, digest.hexdigest()
