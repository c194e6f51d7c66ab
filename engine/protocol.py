"""OpenAI request bodies (pydantic) and their mapping to SamplingParams.

Unknown fields are ignored (and logged), as OpenAI clients send many. Fields this server knows but
cannot honour (`best_of`, `suffix`, `tools`, `prompt_logprobs`, ...) are a 400 naming the field whenever they
carry anything but their no-op value: nothing a client asks for is silently dropped. Structured output
comes as `response_format` or `structured_outputs` (engine/structured_output/protocol.py).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, TypeVar

from kvstore.engine.errors import InvalidRequest
from kvstore.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from kvstore.engine.structured_output.protocol import (
    ResponseFormat,
    StructuredOutputsRequest,
    structured_outputs_params,
)
from pydantic import BaseModel, ConfigDict, Field, ValidationError

logger = logging.getLogger(__name__)
_R = TypeVar("_R", bound="_SamplingFields")
MAX_PROMPTS_PER_REQUEST = 2048  # OpenAI's own limit on a prompt array; also on prompts x n
MAX_N = 128  # OpenAI's limit on n

# field -> the values that mean "not used"; any other value is a 400 naming the field.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logprob_token_ids": (None,),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "truncate_prompt_tokens": (None,),
    "prompt_embeds": (None,),
    "continue_final_message": (None, False),
    "chat_template": (None,),
    "documents": (None,),
    "mm_processor_kwargs": (None,),
    "priority": (None, 0),
    "cache_salt": (None,),
    "kv_transfer_params": (None,),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    "spaces_between_special_tokens": (None, True),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "vllm_xargs": (None,),
    "repetition_detection": (None,),
    "thinking_token_budget": (None, -1),
    # vLLM removed these and ignores them silently; here they are a 400 (use structured_outputs)
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structural_tag": (None,),
}


def _is_noop(value: Any, noops: tuple[Any, ...]) -> bool:
    # type-exact: `best_of: true` is not the no-op 1, `echo: 0` not the no-op false
    return any(value is None if n is None else (type(value) is type(n) and value == n) for n in noops)


def check_unsupported(body: dict[str, Any]) -> None:
    for name, noops in UNSUPPORTED_FIELDS.items():
        if name in body and not _is_noop(body[name], noops):
            raise InvalidRequest(f"{name} is not supported by this server", param=name)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    min_tokens: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob, rank and the top ones

    @classmethod
    def from_body(cls: type[_R], body: dict[str, Any]) -> _R:
        """Validate a JSON body: unsupported fields first (a 400 naming the field), then the types."""
        check_unsupported(body)
        req = _validate(cls, body)
        ignored = body.keys() - cls.model_fields.keys()
        if ignored:
            logger.debug("ignoring unknown request fields: %s", ", ".join(sorted(ignored)[:20]))
        if not 1 <= req.n <= MAX_N:
            raise InvalidRequest(f"n must be in [1, {MAX_N}], got {req.n}", param="n")
        if req.prompt_logprobs is not None and req.stream:
            raise InvalidRequest(
                "prompt_logprobs are not available with stream (as in vLLM)", param="prompt_logprobs"
            )
        if body.get("echo") not in (None, False):
            if not isinstance(req, CompletionRequest):
                raise InvalidRequest("echo is supported on /v1/completions only", param="echo")
            if req.stream:
                raise InvalidRequest("echo is not supported with stream", param="echo")
        return req

    def logprobs_count(self) -> int | None:
        """SamplingParams.logprobs: how many top logprobs per output token (None: no logprobs)."""
        raise NotImplementedError

    def prompt_logprobs_count(self) -> int | None:
        return self.prompt_logprobs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats: with include_usage, every chunk carries the usage so far."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    add_special_tokens: bool = True
    # an int: the top logprobs per token; false: none (int first, so a float's error names it)
    logprobs: int | bool | None = None
    echo: bool = False  # the prompt comes first in the text (and in the logprobs, scored)

    def prompt_logprobs_count(self) -> int | None:
        if self.prompt_logprobs is not None or not self.echo:
            return self.prompt_logprobs
        return self.logprobs_count()  # echo scores the prompt as the output

    def logprobs_count(self) -> int | None:
        if self.logprobs is True:
            raise InvalidRequest(
                "logprobs of a completion is an int: how many top logprobs per token", param="logprobs"
            )
        return None if self.logprobs is None or self.logprobs is False else self.logprobs

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequest("the prompt is empty", param="prompt")
        prompts = [list(p)] if all(isinstance(t, int) for t in p) else list(p)
        if len(prompts) > MAX_PROMPTS_PER_REQUEST:
            raise InvalidRequest(
                f"a request holds at most {MAX_PROMPTS_PER_REQUEST} prompts, got {len(prompts)}",
                param="prompt",
            )
        return prompts


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[Any] | None = None

    def plain(self) -> dict[str, str]:
        if self.tool_calls:
            raise InvalidRequest("tool_calls in messages are not supported by this server", param="messages")
        content = self.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text":
                    raise InvalidRequest(
                        f"only text content parts are supported, got {str(part.get('type'))[:40]!r}",
                        param="messages",
                    )
                parts.append(str(part.get("text", "")))
            content = "".join(parts)
        return {"role": self.role, "content": content or ""}


class _ChatTemplateFields(BaseModel):
    """What the chat template renders: the messages, the generation prompt, extra template variables."""

    model_config = ConfigDict(extra="ignore")

    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def plain_messages(self) -> list[dict[str, str]]:
        return [m.plain() for m in self.messages or ()]


class ChatCompletionRequest(_SamplingFields, _ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    add_special_tokens: bool = False  # the chat template already holds them (vLLM's default)
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def logprobs_count(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise InvalidRequest("top_logprobs needs logprobs set to true", param="top_logprobs")
            return None
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(
                f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}", param="top_logprobs"
            )
        return 0 if self.top_logprobs is None else self.top_logprobs

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def resolve_max_tokens(
    requested: int | None, prompt_len: int, max_model_len: int, default: int | None
) -> int:
    """The request's max_tokens: a prompt plus max_tokens beyond the context is a 400 (as vLLM
    answers); without max_tokens, `default` (None: all the room left) capped to the room left."""
    room = max_model_len - prompt_len
    assert room >= 1, "the engine rejects prompts that leave no room"
    if requested is None:
        return room if default is None else max(1, min(default, room))
    if isinstance(requested, int) and requested >= 1 and prompt_len + requested > max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the messages, {requested} in the completion). "
            "Please reduce the length of the messages or completion.",
            param="max_tokens",
        )
    return requested


def choices_of(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The params of a request's n choices. With a seed, choice i samples with seed + i (vLLM's rule
    for n > 1), so each choice can be reproduced alone."""
    if params.seed is None or n == 1:
        return [params] * n
    return [dataclasses.replace(params, seed=params.seed + i) for i in range(n)]


def sampling_params_from(req: _SamplingFields, max_tokens: int) -> SamplingParams:
    def given(value: Any, default: Any) -> Any:
        return default if value is None else value

    return SamplingParams(
        temperature=given(req.temperature, 1.0),
        top_p=given(req.top_p, 1.0),
        top_k=given(req.top_k, 0),
        min_p=given(req.min_p, 0.0),
        seed=req.seed,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        presence_penalty=given(req.presence_penalty, 0.0),
        frequency_penalty=given(req.frequency_penalty, 0.0),
        repetition_penalty=given(req.repetition_penalty, 1.0),
        logit_bias=dict(req.logit_bias or {}),
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []),
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        skip_special_tokens=req.skip_special_tokens,
        structured_outputs=structured_outputs_params(req.response_format, req.structured_outputs),
        logprobs=req.logprobs_count(),
        prompt_logprobs=req.prompt_logprobs_count(),
    )


class TokenizeRequest(_ChatTemplateFields):
    """vLLM's /tokenize: a `prompt`, or chat `messages` rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (vLLM's)

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> TokenizeRequest:
        req = _validate(cls, body)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequest("give exactly one of prompt and messages", param="prompt")
        return req


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> DetokenizeRequest:
        return _validate(cls, body)


_M = TypeVar("_M", bound=BaseModel)


def _validate(cls: type[_M], body: dict[str, Any]) -> _M:
    """A pydantic model from a JSON body; a type error is a 400 naming the field."""
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(map(str, err["loc"]))
        raise InvalidRequest(
            f"invalid request: {where}: {err['msg']}", param=str(err["loc"][0]) if err["loc"] else None
        ) from None
