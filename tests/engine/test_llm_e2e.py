"""End to end on the real SmolLM2-135M (fp32): greedy output token-for-token identical to transformers
(eager attention) for a concurrent batch, with chunked prefill forced small, and under preemption;
prefix caching; bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kvstore.engine import LLM, SamplingParams
from kvstore.engine.errors import EngineError, InvalidRequest, KVBackendUnavailable, ModelLoadError
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

MAX_TOKENS = 32
PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
    "The three primary colors are",
    "Here is a list of the planets of the solar system, in order from the sun, with one fact about each:",
]
SHARED_PREFIX = (
    "You are a helpful assistant. Answer briefly and precisely, using plain English and no lists. "
    "The user is a student preparing for an exam in geography and history. "
)
PREFIX_PROMPTS = [
    SHARED_PREFIX + "Question: what is the capital of Italy?",
    SHARED_PREFIX + "Question: who was Napoleon?",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def metric_value(llm: LLM, family: str) -> float:
    text = llm.engine.metrics.render().decode()
    for fam in text_string_to_metric_families(text):
        if fam.name == family:
            return sum(s.value for s in fam.samples if s.name in (family, family + "_total"))
    raise KeyError(family)


@pytest.fixture(scope="module")
def hf_greedy(smollm2_dir: Path):
    """prompt token ids (tuple) -> transformers' greedy continuation, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    cache: dict[tuple[int, ...], list[int]] = {}

    def run(prompt_ids: list[int]) -> list[int]:
        key = tuple(prompt_ids)
        if key not in cache:
            ids = torch.tensor([prompt_ids])
            with torch.inference_mode():
                out = model.generate(
                    ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS
                )
            cache[key] = out[0, ids.shape[1] :].tolist()
        return cache[key]

    return run


@pytest.fixture(scope="module")
def llm(smollm2_dir: Path) -> LLM:
    return LLM(str(smollm2_dir), dtype="float32", max_model_len=512, kv_cache_memory="64MiB")


@pytest.mark.parametrize(
    "engine_args",
    [
        pytest.param({}, id="concurrent-batch"),
        # 16-token steps: prompts prefill in chunks next to other sequences' decodes; 8 blocks of 16
        # cannot hold the four sequences, so the newest is preempted and recomputed.
        pytest.param(
            {"max_num_batched_tokens": 16, "num_kv_blocks": 8, "max_model_len": 128},
            id="chunked-16-preemption",
        ),
    ],
)
@pytest.mark.timeout(600)
def test_greedy_matches_transformers(smollm2_dir: Path, hf_greedy, llm: LLM, engine_args: dict) -> None:
    engine = llm if not engine_args else LLM(str(smollm2_dir), dtype="float32", **engine_args)
    outputs = engine.generate(PROMPTS, GREEDY)
    for out in outputs:
        assert out.outputs[0].token_ids == hf_greedy(out.prompt_token_ids), out.prompt
    assert sum(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outputs) >= 2, (
        "too many early EOS to compare"
    )
    if "num_kv_blocks" in engine_args:
        assert max(len(o.prompt_token_ids) for o in outputs) > 16, "a prompt must need several chunks"
        assert engine.engine.scheduler.num_preemptions > 0, "the small KV cache must force preemption"
        assert metric_value(engine, "vllm:num_preemptions") == engine.engine.scheduler.num_preemptions
    bm = engine.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "every block is returned after the batch"


def test_prefix_cache_hits_full_blocks_and_output_is_unchanged(llm: LLM, hf_greedy) -> None:
    llm.engine.block_manager.reset_prefix_cache()
    hits_before = metric_value(llm, "vllm:prefix_cache_hits")
    first = llm.generate(PREFIX_PROMPTS[0], GREEDY)[0]
    assert first.num_cached_tokens == 0
    second = llm.generate(PREFIX_PROMPTS[1], GREEDY)[0]
    shared = 0
    while first.prompt_token_ids[shared] == second.prompt_token_ids[shared]:
        shared += 1
    bs = llm.engine.args.block_size
    assert shared >= 2 * bs, "the test prompts must share at least two blocks"
    assert second.num_cached_tokens == shared // bs * bs, "hits on full shared blocks only"
    assert metric_value(llm, "vllm:prefix_cache_hits") - hits_before == second.num_cached_tokens
    assert second.outputs[0].token_ids == hf_greedy(second.prompt_token_ids)
    # The identical prompt again: every full block hits except the one holding the last token.
    again = llm.generate(PREFIX_PROMPTS[1], GREEDY)[0]
    n = len(again.prompt_token_ids)
    assert again.num_cached_tokens == (n - 1) // bs * bs
    assert again.outputs[0].token_ids == second.outputs[0].token_ids


def test_text_stop_strings_and_seeded_sampling(llm: LLM) -> None:
    out = llm.generate(
        "The capital of France is", SamplingParams(temperature=0.0, max_tokens=32, stop=["."])
    )[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == "." and "." not in c.text and "Paris" in c.text
    sampled = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=7, max_tokens=12)
    a = llm.generate(PROMPTS[:2], sampled)
    b = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], sampled)
    assert a[0].outputs[0].token_ids == b[1].outputs[0].token_ids, (
        "seeded output does not depend on the batch"
    )
    assert a[1].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_logprobs_equal_transformers_log_softmax(llm: LLM, smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8, logprobs=2))[0]
    c = out.outputs[0]
    model = AutoModelForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32, attn_implementation="eager"
    )
    ids = torch.tensor([out.prompt_token_ids + c.token_ids])
    with torch.inference_mode():
        theirs = model(ids).logits[0, len(out.prompt_token_ids) - 1 : -1].log_softmax(-1)
    assert [e.token_id for e in c.logprobs] == c.token_ids
    for e, row in zip(c.logprobs, theirs, strict=True):
        assert e.logprob == pytest.approx(row[e.token_id].item(), abs=1e-4)
        assert [t for t, _ in e.top] == row.topk(2).indices.tolist()


def test_prompt_logprobs_equal_transformers_across_chunks_and_skip_the_prefix_cache(
    smollm2_dir: Path,
) -> None:
    from transformers import AutoModelForCausalLM

    small_steps = LLM(str(smollm2_dir), dtype="float32", max_model_len=256, kv_cache_memory="16MiB",
                      max_num_batched_tokens=16)  # fmt: skip
    prompt = PROMPTS[3]
    small_steps.generate(prompt, GREEDY)  # its blocks are in the prefix cache now
    out = small_steps.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3))[0]
    small_steps.shutdown()
    ids = out.prompt_token_ids
    assert len(ids) > 16 and out.num_cached_tokens == 0 and out.prompt_logprobs[0] is None
    model = AutoModelForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.inference_mode():
        theirs = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    for e, token, row in zip(out.prompt_logprobs[1:], ids[1:], theirs, strict=True):
        assert e.token_id == token and e.logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert [t for t, _ in e.top] == row.topk(3).indices.tolist()
        assert abs(e.rank - (int((row > row[token]).sum()) + 1)) <= 1  # ties within float noise


def test_streamed_text_only_grows_and_ends_as_the_full_decode(llm: LLM) -> None:
    """Output text is detokenized one token at a time: every step's text is a prefix of the final one,
    which is the decode of all output ids (sampled at temperature 1.5: odd bytes and characters)."""
    engine = llm.engine
    params = SamplingParams(temperature=1.5, seed=3, max_tokens=48, skip_special_tokens=False)
    prompts = ["Write three emoji and a word in Japanese: 🎉", "Ünïcödé test: ∑ ≠ 日本"]
    seqs = [engine.add_request(p, params) for p in prompts]
    seen: dict[str, list[str]] = {s.request_id: [] for s in seqs}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out.outputs[0].text)
    for seq in seqs:
        texts, ids = seen[seq.request_id], seq.output_token_ids
        assert len(ids) == 48 and texts[-1] == engine.tokenizer.decode(ids, skip_special_tokens=False)
        assert all(texts[-1].startswith(t) for t in texts)
        assert any(ord(ch) > 127 for ch in texts[-1]), "the sample holds non-ASCII text"


def test_chat_answers_the_question(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY)[0]
    assert "Paris" in out.outputs[0].text


def test_bad_input_raises_typed_errors_and_engine_keeps_working(llm: LLM, tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="at most 511"):
        llm.generate([1] * 600, GREEDY)
    with pytest.raises(InvalidRequest, match="at most"):
        llm.generate(["fine", "word " * 700], GREEDY)  # one bad prompt: nothing is queued
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(InvalidRequest, match="empty"):
        llm.generate("", GREEDY)
    with pytest.raises(InvalidRequest, match=r"token ids must be in"):
        llm.generate([[5, 6], [5, 10**7]], GREEDY)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests
    for bad in ({"temperature": -1.0}, {"top_p": 1.5}, {"top_p": 0.0}, {"max_tokens": 0}):
        with pytest.raises(InvalidRequest):
            llm.generate("hello", SamplingParams(**bad))
    with pytest.raises(ModelLoadError):
        LLM(str(tmp_path / "no-such-model"))
    with pytest.raises(EngineError):
        LLM(str(tmp_path))  # a directory without config.json
    with pytest.raises(KVBackendUnavailable, match="store_url"):  # before the weights load
        LLM(str(llm.engine.model_dir), kv_backend="kvstore", kv_store_url="redis://not-a-kvstore-server")
    with pytest.raises(InvalidRequest, match="cannot hold one sequence"):
        LLM(str(llm.engine.model_dir), num_kv_blocks=2, max_model_len=512)
    out = llm.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert len(out.outputs[0].token_ids) == 4
