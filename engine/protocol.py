"""OpenAI request bodies (pydantic) and their mapping to SamplingParams.

Unknown fields are ignored, as OpenAI clients send many; fields we cannot honour with a non-default
value (n > 1, logprobs, echo, penalties) are rejected with a 400 rather than silently dropped.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def check_supported(self) -> None:
        if self.n != 1:
            raise InvalidRequest("only n=1 is supported")
        if self.logprobs not in (None, False, 0):
            raise InvalidRequest("logprobs are not supported")
        if self.presence_penalty or self.frequency_penalty:
            raise InvalidRequest("presence_penalty and frequency_penalty are not supported")


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        self.check_supported()
        if self.echo:
            raise InvalidRequest("echo is not supported")
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequest("the prompt is empty")
        if all(isinstance(t, int) for t in p):
            return [list(p)]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    def plain_messages(self) -> list[dict[str, str]]:
        self.check_supported()
        out = []
        for m in self.messages:
            content = m.content
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.get("type") != "text":
                        raise InvalidRequest(
                            f"only text content parts are supported, got {part.get('type')!r}"
                        )
                    parts.append(str(part.get("text", "")))
                content = "".join(parts)
            out.append({"role": m.role, "content": content or ""})
        return out


def sampling_params_from(req: _SamplingFields, default_max_tokens: int) -> SamplingParams:
    max_tokens = getattr(req, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = req.max_tokens
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,
        seed=req.seed,
        max_tokens=default_max_tokens if max_tokens is None else max_tokens,
        min_tokens=req.min_tokens,
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        skip_special_tokens=req.skip_special_tokens,
    )
