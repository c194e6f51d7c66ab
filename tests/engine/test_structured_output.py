"""Structured output without a model forward: constraint parameters, the TokenizerInfo built from
SmolLM2's tokenizer.json (checked against xgrammar's own detection and from_huggingface), the compile
cache, bad constraints as typed errors, the batched bitmask and its CPU masking, matcher replay."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from kvstore.engine.errors import EngineError, InvalidRequest, RequestFailed
from kvstore.engine.sampling_params import SamplingParams
from kvstore.engine.structured_output import StructuredOutputsParams as SO
from kvstore.engine.structured_output.params import MAX_CONSTRAINT_BYTES, MAX_JSON_NESTING, choice_as_grammar
from pydantic import BaseModel

xgr = pytest.importorskip("xgrammar")

from kvstore.engine.structured_output.compiler import GrammarCache  # noqa: E402
from kvstore.engine.structured_output.manager import StructuredOutputManager, apply_bitmask_  # noqa: E402
from kvstore.engine.structured_output.tokenizer_info import build_tokenizer_info, detect_vocab_type  # noqa: E402

from tests.engine.structured_schemas import compiling, grammar_compiles_alive, slow_schema, small_schema  # noqa: E402
from tests.waiting import wait_until  # noqa: E402

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_dir: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def manager(hf_tokenizer) -> StructuredOutputManager:
    return StructuredOutputManager(hf_tokenizer, 49152, {2}, max_num_seqs=4)


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def allowed(matcher, vocab: int = 49152) -> np.ndarray:
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:vocab].astype(bool)


# ---- parameters ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one"),
        ({"json": SCHEMA, "regex": "a"}, "exactly one"),
        ({"json_object": False}, "exactly one"),
        ({"json": "{not json"}, "not a valid JSON"),
        ({"json": [1, 2]}, "JSON schema"),
        ({"regex": ""}, "non-empty"),
        ({"regex": "a\x00"}, "NUL"),
        ({"choice": []}, "non-empty list"),
        ({"choice": ["a", ""]}, "non-empty string"),
        ({"choice": "abc"}, "non-empty list"),
        ({"grammar": "  "}, "EBNF"),
        ({"json_object": "yes"}, "bool"),
        ({"json_object": True, "disable_any_whitespace": 1}, "bool"),
    ],
)
def test_bad_parameters_are_invalid_requests(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        SO(**kwargs)


def test_schema_nesting_is_bounded_like_vllm() -> None:
    def nested(depth: int) -> dict:
        schema: dict = {"type": "integer"}
        for _ in range(depth - 1):
            schema = {"type": "array", "items": schema}
        return schema

    SO(json=nested(MAX_JSON_NESTING))
    with pytest.raises(InvalidRequest, match="nests"):
        SO(json=nested(MAX_JSON_NESTING + 1))
    with pytest.raises(InvalidRequest, match="nests"):  # deeper than Python's recursion limit: no crash
        SO(json="[" * 5000 + "]" * 5000)


def test_a_ref_outside_the_schema_is_rejected_not_ignored(manager) -> None:
    # xgrammar compiles an unresolvable URL $ref as "any value": the constraint would be dropped silently
    for ref in ("http://example.com/s.json", "other.json#/a"):
        with pytest.raises(InvalidRequest, match="outside the schema"):
            SO(json={"type": "object", "properties": {"a": {"$ref": ref}}})
    local = {
        "$defs": {"n": {"type": "integer"}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/n"}},
    }
    manager.compile(SO(json=local))
    # a property named $ref and $ref in enum data are not references
    SO(json={"type": "object", "properties": {"$ref": {"type": "string"}}})
    SO(json={"enum": [{"$ref": "http://example.com"}]})


def test_cache_key_ignores_spacing_but_keeps_property_order() -> None:
    a = SO(json=json.dumps(SCHEMA, indent=4))
    assert a.key == SO(json=SCHEMA).key and a.json == SCHEMA
    swapped = {"type": "object", "properties": {"b": {}, "a": {}}}
    assert SO(json=swapped).key != SO(json={"type": "object", "properties": {"a": {}, "b": {}}}).key
    assert SO(json=SCHEMA).key != SO(json=SCHEMA, disable_any_whitespace=True).key
    assert SO(regex="x").key == ("regex", "x", False)


def test_sampling_params_take_only_the_dataclass() -> None:
    assert SamplingParams(structured_outputs=SO(regex="a+")).structured_outputs.regex == "a+"
    with pytest.raises(InvalidRequest, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a+"})


# ---- the tokenizer as xgrammar sees it -----------------------------------------------------------
def test_smollm2_is_byte_level_like_xgrammars_own_detection(hf_tokenizer) -> None:
    spec = json.loads(hf_tokenizer.to_str())
    vocab_type, prefix = detect_vocab_type(spec)
    assert (vocab_type, prefix) == (xgr.VocabType.BYTE_LEVEL, False)
    theirs = xgr.TokenizerInfo._detect_metadata_from_hf(hf_tokenizer.to_str())
    assert theirs == {"vocab_type": vocab_type, "add_prefix_space": prefix}


def test_byte_fallback_metaspace_tokenizer_is_detected(hf_tokenizer) -> None:
    """A Llama-2 style tokenizer.json (ByteFallback decoder, Metaspace pre-tokenizer)."""
    spec = {
        "normalizer": None,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first"},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ]},
    }  # fmt: skip
    assert detect_vocab_type(spec) == (xgr.VocabType.BYTE_FALLBACK, True)
    theirs = xgr.TokenizerInfo._detect_metadata_from_hf(json.dumps(spec))
    assert theirs == {"vocab_type": xgr.VocabType.BYTE_FALLBACK, "add_prefix_space": True}
    assert detect_vocab_type({"decoder": {"type": "WordPiece"}}) == (xgr.VocabType.RAW, False)


def test_tokenizer_info_matches_from_huggingface_except_special_tokens(
    smollm2_dir: Path, hf_tokenizer
) -> None:
    from transformers import AutoTokenizer

    ours, _ = build_tokenizer_info(hf_tokenizer, 49152, [2])
    theirs = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(smollm2_dir), vocab_size=49152)
    assert ours.vocab_type == theirs.vocab_type and ours.add_prefix_space == theirs.add_prefix_space
    assert ours.stop_token_ids == theirs.stop_token_ids == [2]
    special = {i for i, t in hf_tokenizer.get_added_tokens_decoder().items() if t.special} - {2}
    assert set(ours.special_token_ids) == special and theirs.special_token_ids == []
    mine, hf = ours.decoded_vocab, theirs.decoded_vocab
    assert all(mine[i] == hf[i] for i in range(49152) if i not in special)
    assert hf[ids(hf_tokenizer, " hello")[0]] == b" hello"  # byte-level decoding: "Ġhello" -> " hello"


def test_special_tokens_never_appear_inside_constrained_text(hf_tokenizer, manager) -> None:
    """With from_huggingface's info a regex like [<|>a-z_]+ lets the model emit <|im_start|> (id 1) as
    if it were text; ours masks every special token and allows only the stop token at the end."""
    so = SO(regex=r"[<|>a-z_]+")
    theirs_info = xgr.TokenizerInfo(
        [t for t, _ in sorted(hf_tokenizer.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])],
        xgr.VocabType.BYTE_LEVEL, vocab_size=49152, stop_token_ids=[2],
    )  # fmt: skip
    theirs = xgr.GrammarMatcher(xgr.GrammarCompiler(theirs_info).compile_regex(so.regex))
    assert allowed(theirs)[1], "the from_huggingface-style info allows <|im_start|> as text"
    ours = manager.new_request(so).matcher
    mask = allowed(ours)
    assert not mask[:17].any(), "no special token (ids 0-16) is ever text"
    assert ours.accept_string("abc") and allowed(ours)[2], "the stop token ends it"


# ---- compiling -----------------------------------------------------------------------------------
def test_compile_cache_counts_hits_and_is_keyed_by_the_tokenizer(hf_tokenizer) -> None:
    info, fingerprint = build_tokenizer_info(hf_tokenizer, 49152, [2])
    cache = GrammarCache(info, fingerprint)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}}
    first = cache.get(SO(json=schema))
    assert (cache.stats.hits, cache.stats.misses) == (0, 1)
    assert cache.get(SO(json=json.dumps(schema, indent=2))) is first
    assert (cache.stats.hits, cache.stats.misses) == (1, 1) and cache.stats.bytes > 0
    _, other = build_tokenizer_info(hf_tokenizer, 49152, [0, 2])  # other stop tokens: another grammar
    assert other != fingerprint


def test_cache_evicts_least_recently_used_within_its_byte_limit(hf_tokenizer) -> None:
    info, fingerprint = build_tokenizer_info(hf_tokenizer, 49152, [2])
    cache = GrammarCache(info, fingerprint, limit_bytes=1)  # keeps only the newest entry
    cache.get(SO(regex="a+"))
    cache.get(SO(regex="b+"))
    assert cache.stats.entries == 1
    cache.get(SO(regex="b+"))
    cache.get(SO(regex="a+"))
    assert (cache.stats.hits, cache.stats.misses) == (1, 3)


@pytest.mark.parametrize(
    "so, message",
    [
        (SO(regex="("), "regex constraint cannot be compiled: Regex parsing error"),
        (SO(grammar="root ::= foo"), 'Rule "foo" is not defined'),
        (SO(grammar='root := "a"'), "EBNF lexer error"),
        (SO(json={"type": "foo"}), 'Unsupported type "foo"'),
        (SO(json={"type": "integer", "minimum": 5, "maximum": 1}), "minimum greater than maximum"),
        (SO(json={"$ref": "#/$defs/missing"}), "json constraint cannot be compiled"),
        (SO(json={"type": "string", "pattern": "(unclosed"}), "parenthesis is not closed"),
    ],
)
def test_uncompilable_constraints_are_invalid_requests_with_xgrammars_reason(manager, so, message) -> None:
    for _ in range(2):  # the second time from the error cache, with the same message
        with pytest.raises(InvalidRequest, match=message.replace("(", r"\(")) as e:
            manager.compile(so)
        assert "/project/cpp" not in str(e.value), "the C++ source location is stripped"


class Node(BaseModel):
    value: int
    children: list[Node] = []


class Tree(BaseModel):
    root: Node
    left: Tree | None = None


CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
SELF = {"type": "object", "properties": {"child": {"$ref": "#"}}}


@pytest.mark.parametrize(
    "so",
    [
        SO(json={"$ref": "#"}),
        SO(json=CYCLE),
        SO(json={**SELF, "required": ["child"]}),  # every object must hold another: never ends
        SO(json={"type": "array", "items": {"$ref": "#"}, "minItems": 1}),
        SO(json={"$ref": "#"}, disable_any_whitespace=True),
        SO(grammar="root ::= root"),
        SO(grammar='root ::= "x" a\na ::= "y" a'),
        SO(grammar='root ::= a{2,5}\na ::= "x" a'),
    ],
    ids=[
        "self-ref",
        "ref-cycle",
        "required-self",
        "array-min1-self",
        "compact",
        "root-root",
        "endless",
        "repeat",
    ],
)
def test_a_constraint_nothing_finite_satisfies_is_invalid(manager, so) -> None:
    """It would compile, and the matcher would then allow no token (or never an end): a 400, not a
    500 in the middle of the answer."""
    with pytest.raises(InvalidRequest, match="no finite text satisfies it: rule 'root' never completes"):
        manager.compile(so)


LOOP = {"$defs": {"loop": {"$ref": "#/$defs/loop"}}}


@pytest.mark.parametrize(
    "so, rule",
    [
        (SO(grammar='root ::= "x" | "y" a\na ::= a'), "a"),  # after "y" no token is allowed
        (SO(grammar='root ::= "q" a{0,3}\na ::= "x" a'), "a"),  # after "qx" no end
        (SO(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/loop"}}, **LOOP}), "root_prop_0"),
        (SO(json={"anyOf": [{"type": "integer"}, {"$ref": "#/$defs/loop"}], **LOOP}), "root_case_1"),
    ],
    ids=["dead-end", "endless-optional", "optional-property", "any-of-case"],
)
def test_a_constraint_with_a_branch_that_cannot_end_is_invalid(manager, so, rule: str) -> None:
    """The root can complete, but a rule it reaches cannot: an answer that enters it would fail
    (or run to max_tokens), so the constraint is refused, naming the rule."""
    with pytest.raises(InvalidRequest, match=f"no finite text satisfies it: rule '{rule}' never completes"):
        manager.compile(so)


@pytest.mark.parametrize(
    "so",
    [
        SO(json=SELF),  # {} ends it
        SO(json={"type": "array", "items": {"$ref": "#"}}),  # [] ends it
        SO(json={"anyOf": [{"type": "integer"}, {"type": "array", "items": {"$ref": "#"}, "minItems": 1}]}),
        SO(grammar='root ::= "x" | "(" root ")"'),
        SO(grammar='root ::= ("x" root)*'),
        SO(grammar='root ::= "q" a{0,3}\na ::= "x" | "x" a'),
        SO(json=Tree.model_json_schema()),  # pydantic's recursive models
    ],
)
def test_recursive_constraints_with_a_base_case_compile(manager, so) -> None:
    manager.compile(so)
    matcher = manager.new_request(so).matcher
    assert allowed(matcher).any()


def test_a_compile_that_takes_too_long_is_an_invalid_request(hf_tokenizer) -> None:
    info, fingerprint = build_tokenizer_info(hf_tokenizer, 49152, [2])
    cache = GrammarCache(info, fingerprint, timeout_s=0.001)
    with pytest.raises(InvalidRequest, match="did not compile within"):
        cache.get(SO(regex="([a-z]{1,100}){100}"))  # ~0.5 s of automaton building


@pytest.mark.parametrize(
    "make",
    [
        lambda: SO(json={"enum": [f"value number {i}" for i in range(200_000)]}),  # issue 30's: 3.9 MB
        lambda: SO(choice=[f"choice {i}" for i in range(20_000)]),
        lambda: SO(regex="a" * (MAX_CONSTRAINT_BYTES + 1)),
        lambda: SO(grammar="root ::= " + " | ".join(f'"v{i}"' for i in range(30_000))),
    ],
    ids=["enum", "choice", "regex", "grammar"],
)
def test_a_constraint_over_the_size_limit_is_invalid_before_any_compile(make) -> None:
    start = time.perf_counter()
    with pytest.raises(InvalidRequest, match=f"bytes; at most {MAX_CONSTRAINT_BYTES:,} are compiled"):
        make()
    assert time.perf_counter() - start < 2.0
    assert len(SO(json={"enum": [f"value number {i}" for i in range(5_000)]}).key[1]) < MAX_CONSTRAINT_BYTES


def test_a_compile_past_its_deadline_is_stopped(hf_tokenizer) -> None:
    """The deadline stops the work: the compile's process is gone when the request gets its 400 (a
    thread kept compiling for minutes), and the refused constraint is remembered, not recompiled."""
    info, fingerprint = build_tokenizer_info(hf_tokenizer, 49152, [2])
    cache = GrammarCache(info, fingerprint, timeout_s=1.0)
    bomb = SO(json=slow_schema(0))
    start = time.perf_counter()
    with pytest.raises(InvalidRequest, match="did not compile within 1 s"):
        cache.get(bomb)
    assert time.perf_counter() - start < 10.0
    wait_until(lambda: grammar_compiles_alive() == [], timeout=2.0)
    with pytest.raises(InvalidRequest, match="did not compile within 1 s"):
        cache.get(bomb)
    assert grammar_compiles_alive() == []


def test_a_small_schema_beside_two_bombs_compiles_in_its_usual_time(hf_tokenizer) -> None:
    """No queue of compiles: two bombs compiling (each past the deadline) hold nothing a small,
    fresh schema waits for. Before, two compile slots were theirs and the small one timed out."""
    info, fingerprint = build_tokenizer_info(hf_tokenizer, 49152, [2])
    cache = GrammarCache(info, fingerprint, timeout_s=6.0)
    cache.get(SO(json=small_schema(0)))  # the first compile starts the compile processes' server
    start = time.perf_counter()
    cache.get(SO(json=small_schema(1)))
    usual = time.perf_counter() - start
    with ThreadPoolExecutor(2) as requests:  # two requests waiting for their bombs
        bombs = [requests.submit(cache.get, SO(json=slow_schema(salt))) for salt in (1, 2)]
        wait_until(lambda: compiling() == 2)  # both are compiling
        start = time.perf_counter()
        cache.get(SO(json=small_schema(2)))
        beside = time.perf_counter() - start
        assert not any(b.done() for b in bombs)
        print(f"small schema alone {usual * 1e3:.0f} ms, beside two bombs {beside * 1e3:.0f} ms")
        assert beside < 3 * usual + 1.0, (beside, usual)
        for b in bombs:
            with pytest.raises(InvalidRequest, match="did not compile within"):
                b.result(timeout=30)


def test_a_dead_compile_helper_fails_its_compiles_and_the_next_one_starts_again(hf_tokenizer) -> None:
    info, fingerprint = build_tokenizer_info(hf_tokenizer, 49152, [2])
    cache = GrammarCache(info, fingerprint, timeout_s=60.0)
    cache.get(SO(json=small_schema(10)))
    with ThreadPoolExecutor(1) as requests:
        bomb = requests.submit(cache.get, SO(json=slow_schema(10)))
        wait_until(lambda: compiling() == 1)  # it is compiling
        cache._service._proc.kill()  # noqa: SLF001 (the helper dies: OOM killer, a crash)
        with pytest.raises(EngineError, match="grammar compiler process exited; retry"):
            bomb.result(timeout=30)
    cache.get(SO(json=small_schema(11)))  # a new helper
    cache.close()
    assert grammar_compiles_alive() == []


def test_past_the_running_compiles_limit_a_new_one_is_a_503_not_a_wait(hf_tokenizer, monkeypatch) -> None:
    from kvstore.engine.structured_output import compile_worker

    monkeypatch.setattr(compile_worker, "MAX_RUNNING_COMPILES", 2)
    info, fingerprint = build_tokenizer_info(hf_tokenizer, 49152, [2])
    cache = GrammarCache(info, fingerprint, timeout_s=3.0)
    with ThreadPoolExecutor(2) as requests:
        bombs = [requests.submit(cache.get, SO(json=slow_schema(salt))) for salt in (20, 21)]
        wait_until(lambda: compiling() == 2)  # both are compiling
        start = time.perf_counter()
        with pytest.raises(RequestFailed, match="2 constraints are compiling already; retry later") as e:
            cache.get(SO(json=small_schema(20)))
        assert e.value.status == 503 and time.perf_counter() - start < 1.0
        for b in bombs:
            with pytest.raises(InvalidRequest, match="did not compile within 3 s"):
                b.result(timeout=30)
    cache.get(SO(json=small_schema(20)))  # the refusal was not remembered
    cache.close()


def test_the_compile_helper_does_not_run_the_users_script_again(smollm2_dir: Path, tmp_path: Path) -> None:
    """A script without a `__main__` guard (the README's examples) compiles a constraint: a
    multiprocessing child would import the script again; the helper is a plain subprocess."""
    script = tmp_path / "no_guard.py"
    script.write_text(
        "from tokenizers import Tokenizer\n"
        "from kvstore.engine.structured_output import StructuredOutputsParams\n"
        "from kvstore.engine.structured_output.compiler import GrammarCache\n"
        "from kvstore.engine.structured_output.tokenizer_info import build_tokenizer_info\n"
        "print('script ran', flush=True)\n"
        f"tok = Tokenizer.from_file({str(smollm2_dir / 'tokenizer.json')!r})\n"
        "cache = GrammarCache(*build_tokenizer_info(tok, 49152, [2]))\n"
        "cache.get(StructuredOutputsParams(choice=['yes', 'no']))\n"
        "print('compiled', flush=True)\n"
    )
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(root)})  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["script ran", "compiled"]


def test_choice_literals_are_escaped(manager) -> None:
    choices = ['say "hi"', "back\\slash", "two\nlines", "tab\there", "caf\u00e9", "ctl\x01"]
    assert choice_as_grammar(["a"]) == 'root ::= "a"'
    so = SO(choice=choices)
    for choice in choices:
        matcher = manager.new_request(so).matcher
        assert matcher.accept_string(choice) and matcher.is_completed(), choice
    matcher = manager.new_request(so).matcher
    assert not matcher.accept_string('say "ho"')


# ---- masking -------------------------------------------------------------------------------------
def test_cpu_masking_equals_xgrammars_kernel() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 49152
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
    logits = torch.randn(5, vocab, generator=gen)
    for rows in ([0, 1, 2, 3, 4], [1, 3], [4]):
        want = logits.clone()
        xgr.apply_token_bitmask_inplace(want, bitmask, indices=rows)
        got = logits.clone()
        apply_bitmask_(got, bitmask.numpy(), rows)
        assert torch.equal(got, want)
        untouched = [i for i in range(5) if i not in rows]
        assert torch.equal(got[untouched], logits[untouched])


def test_unconstrained_batches_never_touch_xgrammar(hf_tokenizer) -> None:
    fresh = StructuredOutputManager(hf_tokenizer, 49152, {2}, max_num_seqs=4)
    logits = torch.randn(3, 49152)
    before = logits.clone()
    fresh.apply_grammar_bitmask(logits, [None, None, None])
    assert torch.equal(logits, before)
    assert fresh._cache is None, "no vocabulary read, no compiler built"


def test_one_batched_fill_masks_only_constrained_rows(hf_tokenizer, manager) -> None:
    digits = manager.new_request(SO(regex=r"[0-9]{3}"))
    yes_no = manager.new_request(SO(choice=["yes", "no"]))
    logits = torch.zeros(4, 49152)
    manager.apply_grammar_bitmask(logits, [digits, None, yes_no, None])
    assert torch.equal(logits[1], torch.zeros(49152)) and torch.equal(logits[3], torch.zeros(49152))
    ok_digits = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert ok_digits and all(hf_tokenizer.decode([t]).isdigit() for t in ok_digits)
    ok_choice = {hf_tokenizer.decode([t]) for t in torch.isfinite(logits[2]).nonzero().flatten().tolist()}
    assert "yes" in ok_choice and ok_choice <= {"y", "ye", "yes", "n", "no"}


def test_a_rebuilt_matcher_equals_the_incremental_one(hf_tokenizer, manager) -> None:
    """What the decode side of a PD pair (or any engine taking a request over) does: replay."""
    so = SO(json={"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})
    tokens = ids(hf_tokenizer, '{"name": "Ada')
    incremental = manager.new_request(so)
    for t in tokens:
        assert incremental.accept_token(t)
    rebuilt = manager.new_request(so, generated=tokens)
    assert rebuilt.num_processed_tokens == incremental.num_processed_tokens == len(tokens)
    assert np.array_equal(allowed(rebuilt.matcher), allowed(incremental.matcher))
    with pytest.raises(InvalidRequest, match="does not follow"):
        manager.new_request(so, generated=ids(hf_tokenizer, "[1]"))


def test_after_the_stop_token_the_row_is_free(hf_tokenizer, manager) -> None:
    req = manager.new_request(SO(choice=["no"]))
    for t in ids(hf_tokenizer, "no"):
        assert req.accept_token(t)
    assert not req.accept_token(ids(hf_tokenizer, "x")[0]), "nothing but the stop token after the choice"
    assert req.accept_token(2) and req.is_terminated
    assert req.accept_token(ids(hf_tokenizer, "x")[0]), "ignore_eos: later tokens are not constrained"
    logits = torch.zeros(1, 49152)
    manager.apply_grammar_bitmask(logits, [req])
    assert torch.isfinite(logits).all()


def test_json_whitespace_between_tokens_is_bounded(manager) -> None:
    """xgrammar's any_whitespace is unbounded by default; small models loop on newlines."""
    from kvstore.engine.structured_output.compiler import JSON_MAX_WHITESPACE

    so = SO(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    ok = manager.new_request(so).matcher
    assert ok.accept_string("{" + "\n" * JSON_MAX_WHITESPACE + '"a": 1}')
    too_much = manager.new_request(so).matcher
    assert not too_much.accept_string("{" + "\n" * (JSON_MAX_WHITESPACE + 1))
    compact = manager.new_request(SO(json=so.json, disable_any_whitespace=True)).matcher
    assert compact.accept_string('{"a":1}') and compact.is_completed()
    assert not manager.new_request(SO(json=so.json, disable_any_whitespace=True)).matcher.accept_string("{ ")


# ---- the OpenAI request fields -------------------------------------------------------------------
def chat_params(**fields) -> SamplingParams:
    from kvstore.engine.protocol import ChatCompletionRequest, sampling_params_from

    req = ChatCompletionRequest.from_body({"messages": [{"role": "user", "content": "hi"}], **fields})
    return sampling_params_from(req, 8)


def test_openai_response_format_and_vllm_structured_outputs_map_to_params() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
    assert chat_params(response_format=fmt).structured_outputs == SO(json=SCHEMA)
    assert chat_params(response_format={"type": "json_object"}).structured_outputs == SO(json_object=True)
    assert chat_params(response_format={"type": "text"}).structured_outputs is None
    assert chat_params().structured_outputs is None
    cases = [{"json": SCHEMA}, {"json": json.dumps(SCHEMA)}, {"regex": "a+"}, {"choice": ["x", "y"]},
             {"grammar": 'root ::= "a"'}, {"json_object": True, "disable_any_whitespace": True}]  # fmt: skip
    for so in cases:
        want = SO(**so)
        assert chat_params(structured_outputs=so).structured_outputs == want


def test_bad_openai_structured_fields_are_rejected() -> None:
    cases = [
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "not both"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "json_schema.schema"),
        ({"guided_json": SCHEMA}, "guided_json is not supported"),
        ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " "}}, "whitespace_pattern"),
        ({"response_format": {"type": "structural_tag"}}, "response_format"),
        ({"structured_outputs": {"choice": "ab"}}, "choice"),
    ]
    for fields, message in cases:
        with pytest.raises(InvalidRequest, match=message):
            chat_params(**fields)


# ---- a tiny random model: sampled (not greedy) output still holds, and the bench runs ----------------
def test_sampled_output_of_a_random_model_holds_every_constraint(tiny_bpe_engine_dir: Path) -> None:
    """A random-weight model samples garbage; under a constraint every sample is still in the language."""
    from kvstore.engine import LLM

    llm = LLM(str(tiny_bpe_engine_dir), max_model_len=128, kv_cache_memory="4MiB")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
              "ok": {"type": "boolean"}}, "required": ["n", "ok"]}  # fmt: skip
    cases = [SO(regex=r"[0-9]{3}-[a-z]{2}"), SO(choice=["alpha", "beta", "gamma"]),
             SO(json=schema, disable_any_whitespace=True)]  # fmt: skip
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=48, structured_outputs=so)
        for so in cases
        for s in range(4)
    ]
    free = SamplingParams(temperature=1.0, seed=0, max_tokens=8)
    outs = llm.generate(["The quick brown fox"] * (len(params) + 1), [*params, free])
    for p, out in zip(params, outs, strict=False):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c
        so = p.structured_outputs
        if so.regex:
            assert re.fullmatch(so.regex, c.text), c.text
        elif so.choice:
            assert c.text in so.choice
        else:
            value = json.loads(c.text)
            assert set(value) == {"n", "ok"} and 0 <= value["n"] <= 99 and isinstance(value["ok"], bool)
    assert len({o.outputs[0].text for o in outs[:4]}) > 1, "seeds sample different answers"
    assert llm.engine.structured_output.masked_rows > 0


def test_bench_structured_output_runs_and_reports_the_overhead(tiny_bpe_engine_dir: Path, capsys) -> None:
    from kvstore.engine.bench.latency import LatencyOptions
    from kvstore.engine.bench.structured import run_latency
    from kvstore.engine.engine_args import EngineArgs

    args = EngineArgs(model=str(tiny_bpe_engine_dir), max_model_len=128, kv_cache_memory="4MiB")
    result = run_latency(
        args, LatencyOptions(input_len=8, output_len=6, batch_size=2, num_iters=2, num_iters_warmup=1)
    )
    assert 0 < result["itl_ratio"]["median"] and 0 < result["grammar_share"]["median"] < 10
    assert result["compile"]["bench schema"]["cold_s"] > result["compile"]["bench schema"]["cached_s"]
    assert "overhead per token" in capsys.readouterr().out
