"""What `LLMEngine.step` and `LLM.generate` return (vLLM's `RequestOutput` / `CompletionOutput` names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprobs:
    """One output token: its log-probability and the top ones at its position, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None  # of token_id in its distribution, 1 = most likely (prompt logprobs only)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprobs] | None = None  # per output token, when SamplingParams.logprobs is set


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # why the engine gave up on this request (finish_reason "abort")
    # per prompt token (None for the first, which nothing predicts), when SamplingParams.prompt_logprobs
    prompt_logprobs: list[TokenLogprobs | None] | None = None
