"""Helpers for the engine tests: real SmolLM2, real prompts, engines with and without the store."""

from __future__ import annotations

import functools
import socket
from typing import Any

from kvstore.engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ENGINE = {"max_model_len": 1024, "kv_cache_memory": "48MiB", "num_threads": 1}

_TEXT = (
    "The history of the lighthouse keepers of the northern coast is a story of storms, patience and small "
    "mechanical miracles. Every evening the keeper climbed the stairs, trimmed the wick, wound the clockwork "
    "that turned the lens, and wrote the weather into a leather book. "
)


@functools.cache
def _tokenizer():
    from kvstore.engine.convert import ensure_smollm2  # noqa: PLC0415
    from kvstore.engine.tokenizer import Tokenizer  # noqa: PLC0415

    return Tokenizer.from_pretrained(ensure_smollm2())


def doc(n_tokens: int, topic: int) -> list[int]:
    """A prompt of exactly n_tokens real-text tokens; different topics differ from the first token on."""
    text = f"Document {topic}. " + f"Chapter {topic}: " + _TEXT * (n_tokens // 40 + 2)
    ids = _tokenizer().encode(text)
    assert len(ids) >= n_tokens
    return list(ids[:n_tokens])


def llm(**kw: Any) -> LLM:
    return LLM("smollm2", **{**ENGINE, **kw})


def generate(engine: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY)]


def store_metrics(engine: LLM) -> dict[str, float]:
    connector = engine.engine.scheduler.connector
    assert connector is not None, "this engine runs without the store"
    connector_worker = engine.engine.runner.connector
    connector_worker.flush()
    return connector.metrics.snapshot()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
