"""Benchmark requests: `--dataset random` (seeded token ids, varied lengths) or a JSONL file.

A JSONL line is `{"prompt": "text"}` or `{"prompt_token_ids": [1, 2, ...]}`, optionally with
`"output_len"` (or `"max_tokens"`); lines without one generate `--output-len` tokens. Every system in a
comparison gets the same token ids, so text prompts are tokenized once, with the engine's tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from kvstore.engine.errors import InvalidRequest

# Random prompts stay clear of the special tokens at the start of the vocabulary.
_FIRST_RANDOM_TOKEN = 100


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    prompt: str | None = None  # the text, when the dataset had text (bench serve sends it as is)


def random_lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float) -> list[int]:
    """`n` lengths uniform in length * [1 - range_ratio, 1 + range_ratio] (vLLM's random dataset)."""
    lo, hi = max(1, round(length * (1 - range_ratio))), max(1, round(length * (1 + range_ratio)))
    return rng.integers(lo, hi + 1, size=n).tolist()


def random_requests(
    vocab_size: int,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[BenchRequest]:
    if not 0 <= range_ratio < 1:
        raise InvalidRequest(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise InvalidRequest("--num-prompts, --input-len and --output-len must be positive")
    if vocab_size <= _FIRST_RANDOM_TOKEN:
        raise InvalidRequest(f"a vocabulary of {vocab_size} tokens is too small for random prompts")
    rng = np.random.default_rng(seed)
    in_lens = random_lengths(rng, num_prompts, input_len, range_ratio)
    out_lens = random_lengths(np.random.default_rng(seed + 1), num_prompts, output_len, range_ratio)
    return [
        BenchRequest(rng.integers(_FIRST_RANDOM_TOKEN, vocab_size, size=k).tolist(), n)
        for k, n in zip(in_lens, out_lens, strict=True)
    ]


def jsonl_requests(
    path: str | Path, encode: Callable[[str], list[int]], output_len: int, num_prompts: int | None = None
) -> list[BenchRequest]:
    """The first `num_prompts` lines of a JSONL file (all of them when None)."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"cannot read dataset {path}: {e}") from e
    requests = []
    for lineno, line in enumerate(lines, 1):
        if num_prompts is not None and len(requests) >= num_prompts:
            break
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise InvalidRequest(f"{path}:{lineno}: not JSON: {e}") from e
        requests.append(_parse_record(record, encode, output_len, f"{path}:{lineno}"))
    if not requests:
        raise InvalidRequest(f"dataset {path} has no requests")
    return requests


def _parse_record(
    record: object, encode: Callable[[str], list[int]], output_len: int, where: str
) -> BenchRequest:
    if not isinstance(record, dict):
        raise InvalidRequest(f"{where}: a line is a JSON object with 'prompt' or 'prompt_token_ids'")
    n = record.get("output_len", record.get("max_tokens", output_len))
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise InvalidRequest(f"{where}: output_len must be a positive int, got {n!r}")
    if "prompt_token_ids" in record:
        ids = record["prompt_token_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise InvalidRequest(f"{where}: prompt_token_ids must be a non-empty list of token ids")
        return BenchRequest(list(ids), n)
    text = record.get("prompt")
    if not isinstance(text, str) or not text:
        raise InvalidRequest(f"{where}: a line needs a non-empty 'prompt' string or 'prompt_token_ids'")
    ids = encode(text)
    if not ids:
        raise InvalidRequest(f"{where}: the prompt encodes to no tokens")
    return BenchRequest(ids, n, prompt=text)


def load_requests(
    dataset: str,
    *,
    vocab_size: int,
    encode: Callable[[str], list[int]],
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[BenchRequest]:
    """`dataset` is "random" or the path of a JSONL file."""
    if dataset == "random":
        return random_requests(vocab_size, num_prompts, input_len, output_len, range_ratio, seed)
    return jsonl_requests(dataset, encode, output_len, num_prompts)
