"""How one request is sampled and when it stops (the vLLM `SamplingParams` names)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import InvalidRequest

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """`temperature == 0` is greedy. `top_k <= 0` and `top_p == 1` disable those filters.

    Generation stops at `max_tokens`, at an EOS token (unless `ignore_eos`), at any of
    `stop_token_ids`, or when the text contains one of `stop` (the stop string is not returned).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._check()

    def _check(self) -> None:
        def bad(msg: str) -> InvalidRequest:
            return InvalidRequest(f"invalid sampling parameter: {msg}")

        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise bad(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise bad(f"top_k must be -1, 0 (disabled) or a positive int, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad(f"seed must be an int, got {self.seed!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise bad(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop must be a list of non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids must be a list of non-negative ints")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
