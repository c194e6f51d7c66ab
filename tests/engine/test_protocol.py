"""OpenAI request parsing: vLLM's ranges for every sampling field, unsupported fields as a 400 that
names the field, max_tokens against max_model_len (no model needed)."""

from __future__ import annotations

import pytest
from kvstore.engine.errors import InvalidRequest
from kvstore.engine.protocol import (
    MAX_PROMPTS_PER_REQUEST,
    UNSUPPORTED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    resolve_max_tokens,
    sampling_params_from,
)
from kvstore.engine.sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS, SamplingParams


def params_of(body: dict, max_tokens: int = 8) -> SamplingParams:
    return sampling_params_from(CompletionRequest.from_body({"prompt": "hi", **body}), max_tokens)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("top_k", 2**63),
        ("top_k", -2),
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("temperature", float("inf")),
        ("temperature", float("nan")),
        ("top_p", 0),
        ("top_p", 1.01),
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("repetition_penalty", float("nan")),
        ("logit_bias", {"abc": 1}),
        ("logit_bias", {"5": "x"}),
        ("stop_token_ids", [-1]),
        ("stop", [""]),
        ("stop", [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]),  # each is searched on every token
    ],
)
def test_out_of_range_sampling_fields_are_invalid_and_named(field: str, value: object) -> None:
    with pytest.raises(InvalidRequest) as e:
        params_of({field: value})
    assert e.value.status == 400 and e.value.param == field and field in str(e.value)


def test_edges_of_the_ranges_are_accepted() -> None:
    p = params_of({"seed": 2**63 - 1, "top_k": -1, "temperature": 0, "top_p": 1, "min_p": 1,
                   "presence_penalty": -2, "frequency_penalty": 2, "repetition_penalty": 1e-3})  # fmt: skip
    assert p.seed == 2**63 - 1 and p.greedy and p.has_penalties
    assert params_of({"seed": -(2**63)}).seed == -(2**63)
    assert len(params_of({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS)]}).stop) == MAX_STOP_STRINGS


def test_logit_bias_keys_are_token_ids_and_biases_are_clamped_like_vllm() -> None:
    p = params_of({"logit_bias": {"17": 5, "3": -1000}})
    assert p.logit_bias == {17: 5.0, 3: -100.0}


def test_top_k_and_token_ids_are_checked_against_the_vocabulary() -> None:
    for body, param in (({"top_k": 1000}, "top_k"), ({"logit_bias": {"320": 1}}, "logit_bias"),
                        ({"stop_token_ids": [320]}, "stop_token_ids")):  # fmt: skip
        with pytest.raises(InvalidRequest) as e:
            params_of(body).check_vocab(320)
        assert e.value.param == param
    params_of({"top_k": 320, "logit_bias": {"319": 1}}).check_vocab(320)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("best_of", 2),
        ("suffix", "x"),
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("tool_choice", "auto"),
        ("use_beam_search", True),
        ("guided_json", {"type": "object"}),
    ],
)
def test_fields_that_cannot_be_honoured_are_a_400_naming_the_field(field: str, value: object) -> None:
    for cls, body in ((CompletionRequest, {"prompt": "hi"}), (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]})):  # fmt: skip
        with pytest.raises(InvalidRequest) as e:
            cls.from_body({**body, field: value})
        assert e.value.param == field and field in str(e.value)


def test_no_op_values_of_unsupported_fields_and_unknown_fields_pass() -> None:
    body = {"prompt": "hi", "best_of": 1, "echo": False, "logprobs": None, "tools": [],
            "response_format": {"type": "text"}, "user": "alice", "some_future_field": 1}  # fmt: skip
    CompletionRequest.from_body(body)
    assert set(UNSUPPORTED_FIELDS) >= {"best_of", "suffix", "tools", "guided_json"}


def test_logprobs_map_to_sampling_params_in_each_api_s_shape() -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}]}

    def chat_lp(**kw) -> int | None:
        return sampling_params_from(ChatCompletionRequest.from_body({**chat, **kw}), 8).logprobs

    def cmpl_lp(**kw) -> int | None:
        return params_of(kw).logprobs

    assert chat_lp() is None and chat_lp(logprobs=False) is None and chat_lp(logprobs=True) == 0
    assert chat_lp(logprobs=True, top_logprobs=5) == 5 and chat_lp(logprobs=False, top_logprobs=0) is None
    assert cmpl_lp() is None and cmpl_lp(logprobs=False) is None
    assert cmpl_lp(logprobs=0) == 0 and cmpl_lp(logprobs=MAX_LOGPROBS) == MAX_LOGPROBS
    for kw, param in (
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ):
        with pytest.raises(InvalidRequest) as e:
            chat_lp(**kw)
        assert e.value.param == param
    for value in (True, -1, MAX_LOGPROBS + 1):
        with pytest.raises(InvalidRequest) as e:
            cmpl_lp(logprobs=value)
        assert e.value.param == "logprobs"
    # echo scores the prompt with as many top logprobs as the output; without logprobs it only echoes
    assert params_of({"echo": True, "logprobs": 2}).prompt_logprobs == 2
    assert params_of({"prompt_logprobs": 1}).prompt_logprobs == 1  # vLLM's own field, also on chat
    assert (
        sampling_params_from(
            ChatCompletionRequest.from_body({**chat, "prompt_logprobs": 0}), 8
        ).prompt_logprobs
        == 0
    )
    with pytest.raises(InvalidRequest, match="stream") as e:
        CompletionRequest.from_body({"prompt": "hi", "prompt_logprobs": 1, "stream": True})
    assert e.value.param == "prompt_logprobs"
    assert (
        params_of({"echo": True}).prompt_logprobs is None
        and params_of({"logprobs": 2}).prompt_logprobs is None
    )
    for cls, body in ((ChatCompletionRequest, {**chat, "echo": True}),
                      (CompletionRequest, {"prompt": "hi", "echo": True, "stream": True})):  # fmt: skip
        with pytest.raises(InvalidRequest, match="echo") as e:
            cls.from_body(body)
        assert e.value.param == "echo"


def test_n_and_prompt_count() -> None:
    for body in ({"n": 0}, {"n": -1}, {"n": 129}):
        with pytest.raises(InvalidRequest, match=r"n must be in \[1, 128\]") as e:
            CompletionRequest.from_body({"prompt": "hi", **body})
        assert e.value.param == "n"
    assert CompletionRequest.from_body({"prompt": "hi", "n": 128}).n == 128
    req = CompletionRequest.from_body({"prompt": ["x"] * (MAX_PROMPTS_PER_REQUEST + 1)})
    with pytest.raises(InvalidRequest, match="at most") as e:
        req.prompts()
    assert e.value.param == "prompt"
    assert len(CompletionRequest.from_body({"prompt": [[1, 2]] * MAX_PROMPTS_PER_REQUEST}).prompts()) == 2048


def test_max_tokens_beyond_the_context_is_a_400_like_vllm() -> None:
    with pytest.raises(InvalidRequest, match="maximum context length is 256 tokens") as e:
        resolve_max_tokens(100, 200, 256, 16)
    assert e.value.param == "max_tokens" and "300 tokens (200 in the messages, 100 in the completion)" in str(
        e.value
    )
    assert resolve_max_tokens(56, 200, 256, 16) == 56
    assert resolve_max_tokens(None, 250, 256, 16) == 6, "the default is capped to the room left"
    assert resolve_max_tokens(None, 200, 256, None) == 56, "chat's default is all the room left"


def test_chat_fields() -> None:
    req = ChatCompletionRequest.from_body({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], "max_completion_tokens": 3, "max_tokens": 9})  # fmt: skip
    assert req.plain_messages() == [{"role": "user", "content": "ab"}] and req.requested_max_tokens == 3
    with pytest.raises(InvalidRequest, match="image_url") as e:
        ChatCompletionRequest.from_body(
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
        ).plain_messages()
    assert e.value.param == "messages"
    with pytest.raises(InvalidRequest, match="tool_calls"):
        ChatCompletionRequest.from_body(
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "1"}]}]}
        ).plain_messages()
