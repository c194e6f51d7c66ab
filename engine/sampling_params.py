"""How one request is sampled and when it stops (the vLLM `SamplingParams` names and ranges)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from kvstore.engine.errors import InvalidRequest
from kvstore.engine.structured_output.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_MAX_LOGIT_BIAS = 100.0  # vLLM clamps each bias to [-100, 100]
# Every new token of a request is searched for each of its stop strings on the engine's one thread:
# 85,000 of them (a 1 MiB body) cost 12 ms per token, which every other request would wait for.
# OpenAI allows 4; vLLM sets no limit.
MAX_STOP_STRINGS = 256
MAX_LOGPROBS = 20  # vLLM's default max_logprobs, OpenAI's top_logprobs limit


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _show(v: object) -> str:
    """A short repr for an error message (a 5,000-digit int has no repr in Python 3.11)."""
    if isinstance(v, int) and v.bit_length() > 128:
        return f"an int of {v.bit_length()} bits"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_number(v: object) -> bool:
    """An int or a finite float (a bool is not a number here)."""
    if isinstance(v, bool):
        return False
    return isinstance(v, int) or (isinstance(v, float) and math.isfinite(v))


@dataclass
class SamplingParams:
    """`temperature == 0` is greedy. `top_k` 0 or -1, `top_p == 1` and `min_p == 0` disable those filters.

    Logits are processed in vLLM's order: `logit_bias`, then the repetition / frequency / presence
    penalties (these also steer greedy decoding), then temperature, `min_p`, `top_k` and `top_p`.

    Generation stops at `max_tokens`, at an EOS token (unless `ignore_eos`), at any of
    `stop_token_ids`, or when the text contains one of `stop` (the stop string is cut from the text
    unless `include_stop_str_in_output`). Ranges are vLLM's; a value outside them is an
    InvalidRequest (a 400 from the server), never an error inside the shared engine step. Limits that
    depend on the model (token ids and `top_k` against the vocabulary) are checked by the engine.
    `structured_outputs` constrains the output to a JSON schema, regex, choice or EBNF grammar.
    `logprobs` (None: off): each output token's log-probability and the `logprobs` most likely tokens'
    at its position, from the model's raw logits (vLLM V1's default `raw_logprobs`). `prompt_logprobs`:
    the same for every prompt token after the first (such a request computes its whole prompt: no
    prefix-cache or KV-store hit, as in vLLM).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = self._normalized_logit_bias(self.logit_bias)
        self._check()

    @staticmethod
    def _normalized_logit_bias(bias: object) -> dict[int, float]:
        """{token id (int or decimal string, as JSON keys are): bias} with each bias clamped as vLLM does."""
        if not bias:
            return {}
        if not isinstance(bias, dict):
            raise InvalidRequest(
                "invalid sampling parameter: logit_bias must map token ids to numbers", param="logit_bias"
            )
        out = {}
        for token, value in bias.items():
            if isinstance(token, str) and re.fullmatch(r"-?[0-9]{1,19}", token):
                token = int(token)
            if not _is_int(token) or not _is_number(value):
                raise InvalidRequest(
                    f"invalid sampling parameter: logit_bias maps token ids to finite numbers, got "
                    f"{str(token)[:40]!r}: {str(value)[:40]!r}",
                    param="logit_bias",
                )
            out[token] = float(min(_MAX_LOGIT_BIAS, max(-_MAX_LOGIT_BIAS, value)))
        return out

    def _check(self) -> None:
        def bad(msg: str) -> InvalidRequest:
            return InvalidRequest(f"invalid sampling parameter: {msg}", param=msg.split(" ", 1)[0])

        if not _is_number(self.temperature) or not 0 <= self.temperature <= 2:
            raise bad(f"temperature must be in [0, 2], got {_show(self.temperature)}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {_show(self.top_p)}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT64_MAX:
            raise bad(f"top_k must be -1 or 0 (disabled) or a positive int, got {_show(self.top_k)}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad(f"min_p must be in [0, 1], got {_show(self.min_p)}")
        if self.seed is not None and (not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise bad(f"seed must be an int in [-2**63, 2**63 - 1], got {_show(self.seed)}")
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT64_MAX:
            raise bad(f"max_tokens must be an int >= 1, got {_show(self.max_tokens)}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad(f"min_tokens must be in [0, max_tokens], got {_show(self.min_tokens)}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise bad(f"{name} must be in [-2, 2], got {_show(value)}")
        if not _is_number(self.repetition_penalty) or not self.repetition_penalty > 0:
            raise bad(f"repetition_penalty must be a finite number > 0, got {_show(self.repetition_penalty)}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop must be a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad(f"stop holds at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if not all(_is_int(t) and 0 <= t <= INT64_MAX for t in self.stop_token_ids):
            raise bad("stop_token_ids must be a list of non-negative ints")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be a bool, got {_show(getattr(self, name))}")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise bad(f"logprobs must be an int in [0, {MAX_LOGPROBS}], got {_show(self.logprobs)}")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise bad(
                f"prompt_logprobs must be an int in [0, {MAX_LOGPROBS}], got {_show(self.prompt_logprobs)}"
            )
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise bad(f"structured_outputs must be StructuredOutputsParams, got {type(so).__name__}")

    def check_vocab(self, vocab_size: int) -> None:
        """The limits that depend on the model: token ids inside the vocabulary, top_k at most its size."""
        if self.top_k > vocab_size:
            raise InvalidRequest(
                f"invalid sampling parameter: top_k must be at most the vocabulary size {vocab_size}, "
                f"got {self.top_k}",
                param="top_k",
            )
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias)):
            if any(not 0 <= t < vocab_size for t in ids):
                raise InvalidRequest(
                    f"invalid sampling parameter: {name} token ids must be in [0, {vocab_size})", param=name
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)
