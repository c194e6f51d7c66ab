"""Structured output on the real SmolLM2 (greedy): 20 JSON schemas whose every answer parses and
validates, regex and choice constraints that always hold, free requests untouched by constrained
neighbours, max_tokens cuts as `length`, and the matcher following preemption and store reuse."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from kvstore.engine import LLM, SamplingParams
from kvstore.engine.errors import InvalidRequest
from kvstore.engine.structured_output import StructuredOutputsParams as SO

from tests.engine.structured_schemas import SCHEMAS, chat

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
pytestmark = pytest.mark.slow


def greedy(so: SO | None = None, max_tokens: int = 160) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so)


@pytest.fixture(scope="module")
def llm(smollm2_dir: Path) -> LLM:
    # fp32, the engine's exact reference: the tests compare tokens across batches and preemption
    return LLM(str(smollm2_dir), dtype="float32", max_model_len=512, kv_cache_memory="96MiB")


def prompt(llm: LLM, description: str) -> list[int]:
    return llm.tokenizer.apply_chat_template(chat(description), tokenize=True)


@pytest.mark.timeout(900)
def test_twenty_json_schemas_every_answer_parses_and_validates(llm: LLM) -> None:
    prompts = [prompt(llm, description) for _, description, _ in SCHEMAS]
    params = [greedy(SO(json=schema)) for _, _, schema in SCHEMAS]
    outputs = llm.generate(prompts, params)
    checker = jsonschema.FormatChecker()
    for (name, _, schema), out in zip(SCHEMAS, outputs, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (
            f"{name}: {c.finish_reason} after {len(c.token_ids)} tokens: {c.text!r}"
        )
        value = json.loads(c.text)
        jsonschema.validate(value, schema, format_checker=checker)
    assert llm.engine.structured_output.cache.stats.entries >= len(SCHEMAS)


def test_json_object_and_compact_json(llm: LLM) -> None:
    person = SCHEMAS[0][2]
    p = prompt(llm, SCHEMAS[0][1])
    obj, compact = llm.generate(
        [p, p], [greedy(SO(json_object=True), 96), greedy(SO(json=person, disable_any_whitespace=True))]
    )
    text = obj.outputs[0].text
    if obj.outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: a prefix of an object
        assert obj.outputs[0].finish_reason == "length" and text.lstrip().startswith("{")
    c = compact.outputs[0]
    assert c.finish_reason == "stop" and not re.search(r"\s", c.text.replace(json.loads(c.text)["name"], ""))
    jsonschema.validate(json.loads(c.text), person)


REGEXES = [
    ("What is the phone number of the bakery?", r"\(\d{3}\) \d{3}-\d{4}"),
    ("When was the Eiffel Tower built? Give a date.", r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"),
    ("Give me an IPv4 address.", r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)"),
    ("What is a good name for a cat?", r"[A-Z][a-z]{2,8}"),
    ("Write a hex color.", r"#[0-9a-f]{6}"),
]
CHOICES = [
    ("Is the sky green?", ["yes", "no"]),
    ("Which planet is the largest?", ["Mercury", "Venus", "Earth", "Jupiter"]),
    ("How do you feel about Mondays?", ["positive", "negative", "neutral"]),
    ('Pick a symbol: "quote" or back\\slash?', ['"quote"', "back\\slash"]),
]


def test_regex_and_choice_constraints_always_hold(llm: LLM) -> None:
    prompts = [prompt(llm, q) for q, _ in REGEXES + CHOICES]
    params = [greedy(SO(regex=r), 48) for _, r in REGEXES] + [greedy(SO(choice=c), 16) for _, c in CHOICES]
    outputs = llm.generate(prompts, params)
    for (_, pattern), out in zip(REGEXES, outputs[: len(REGEXES)], strict=True):
        assert out.outputs[0].finish_reason == "stop"
        assert re.fullmatch(pattern, out.outputs[0].text), (pattern, out.outputs[0].text)
    for (_, choices), out in zip(CHOICES, outputs[len(REGEXES) :], strict=True):
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text in choices


def test_ebnf_grammar(llm: LLM) -> None:
    grammar = 'root ::= "The answer is " answer "."\nanswer ::= "A" | "B" | "C"'
    out = llm.generate([prompt(llm, "Choose A, B or C.")], greedy(SO(grammar=grammar), 24))[0]
    assert out.outputs[0].finish_reason == "stop"
    assert re.fullmatch(r"The answer is [ABC]\.", out.outputs[0].text)


def test_free_requests_get_the_same_tokens_next_to_constrained_ones(llm: LLM) -> None:
    free = [prompt(llm, "the city of Rome"), prompt(llm, "a good breakfast")]
    alone = llm.generate(free, greedy(max_tokens=24))
    constrained = [prompt(llm, SCHEMAS[i][1]) for i in (0, 2)]
    mixed = llm.generate(
        [free[0], constrained[0], free[1], constrained[1]],
        [
            greedy(max_tokens=24),
            greedy(SO(json=SCHEMAS[0][2])),
            greedy(max_tokens=24),
            greedy(SO(json=SCHEMAS[2][2])),
        ],
    )
    assert [o.outputs[0].token_ids for o in alone] == [
        mixed[0].outputs[0].token_ids,
        mixed[2].outputs[0].token_ids,
    ]
    # and the constrained ones answer as they do alone
    single = llm.generate([constrained[0]], greedy(SO(json=SCHEMAS[0][2])))[0]
    assert single.outputs[0].token_ids == mixed[1].outputs[0].token_ids


def test_max_tokens_cuts_a_constrained_answer_as_length(llm: LLM) -> None:
    out = llm.generate([prompt(llm, SCHEMAS[2][1])], greedy(SO(json=SCHEMAS[2][2]), max_tokens=5))[0]
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(c.text)  # incomplete JSON, as vLLM returns it
    assert c.text.startswith("{")


def test_uncompilable_constraint_fails_before_anything_is_queued(llm: LLM) -> None:
    p = prompt(llm, "anything")
    with pytest.raises(InvalidRequest, match="cannot be compiled"):
        llm.generate([p, p], [greedy(), greedy(SO(regex="(unclosed"))])
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests


PREAMBLE = (
    "You are a careful data-entry assistant for a small public library. Every answer you give is read by a "
    "program, never by a person, so you reply with the requested record and nothing else: no greeting, no "
    "explanation, no apology. Names are written in full, numbers are plain digits, and lists are short. "
) * 4


def test_matcher_follows_preemption_and_store_prefix_reuse(smollm2_dir: Path, llm: LLM) -> None:
    """Prompts of ~290 tokens (one 256-token store chunk and more) and a KV cache of 40 blocks of 16
    (640 tokens): two requests run at once and outgrow it, so one is preempted and comes back through
    the store (the engine's own prefix cache is off); every answer is token for token the one a roomy
    engine gives, and a second round takes each prompt's chunk from the store."""
    picks = [SCHEMAS[i] for i in (1, 2, 11, 18)]
    prompts = [
        llm.tokenizer.apply_chat_template([{"role": "system", "content": PREAMBLE}, *chat(d)], tokenize=True)
        for _, d, _ in picks
    ]
    assert all(len(p) > 256 for p in prompts)
    params = [greedy(SO(json=schema), 120) for _, _, schema in picks]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    small = LLM(
        str(smollm2_dir), dtype="float32", max_model_len=512, num_kv_blocks=40, enable_prefix_caching=False,
        kv_backend="kvstore", kv_store_url="local",
    )  # fmt: skip
    try:
        got = small.generate(prompts, params)
        assert small.engine.scheduler.num_preemptions > 0, "the small cache must preempt"
        assert [o.outputs[0].token_ids for o in got] == want
        again = small.generate(prompts[:2], params[:2])
        assert all(o.num_cached_tokens >= 256 for o in again), "the prompt's chunk comes from the store"
        assert [o.outputs[0].token_ids for o in again] == want[:2]
        for (_, _, schema), out in zip(picks, got, strict=True):
            assert out.outputs[0].finish_reason == "stop"
            jsonschema.validate(json.loads(out.outputs[0].text), schema)
    finally:
        small.shutdown()
