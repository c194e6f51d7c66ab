"""`LLMEngine.step` under faults injected into the real step (tiny checkpoint, real tokenizer): a
fault pinned on one request fails that request only, a forward fault fails the requests of that step
and spares the waiting ones, a scheduler fault fails everything and the engine serves on; nothing
leaks a block. Also the stop-string options."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvstore.engine import LLM, SamplingParams
from kvstore.engine.errors import RequestFailed
from kvstore.engine.llm_engine import LLMEngine
from kvstore.engine.outputs import RequestOutput

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = ["The quick brown", "Once upon a time", "The lazy dog"]


@pytest.fixture(scope="module")
def llm(tiny_bpe_engine_dir: Path) -> LLM:
    return LLM(str(tiny_bpe_engine_dir), max_model_len=128, kv_cache_memory="4MiB")


@pytest.fixture(scope="module")
def reference(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def run(
    engine: LLMEngine, params: list[SamplingParams], prompts: list[str] = PROMPTS
) -> dict[str, RequestOutput]:
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(prompt, p, f"r{i}")
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def assert_clean(engine: LLMEngine) -> None:
    assert not engine.requests and not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_sampler_fault_fails_only_its_request(llm: LLM, reference) -> None:
    poisoned = SamplingParams(temperature=1.0, seed=3, max_tokens=8)
    poisoned.seed = 2**64  # past validation, as a bug would let it: manual_seed overflows in the step
    done = run(llm.engine, [GREEDY, poisoned, GREEDY])
    assert done["r1"].error is not None and "sampling failed" in done["r1"].error
    assert done["r1"].outputs[0].finish_reason == "abort"
    assert [done["r0"].outputs[0].token_ids, done["r2"].outputs[0].token_ids] == [reference[0], reference[2]]
    assert done["r0"].error is None and done["r2"].error is None
    assert_clean(llm.engine)
    with pytest.raises(RequestFailed, match="sampling failed"):  # the offline API raises it
        llm.generate(PROMPTS[:2], [GREEDY, poisoned])
    assert_clean(llm.engine)


def test_a_forward_fault_fails_the_step_and_spares_the_waiting(llm: LLM, reference, monkeypatch) -> None:
    engine = llm.engine
    monkeypatch.setattr(engine.scheduler.config, "max_num_seqs", 1)  # one request per step
    real = engine.runner.model.forward
    calls = {"n": 0}

    def fails_on_the_third_call(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected forward fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner.model, "forward", fails_on_the_third_call)
    done = run(engine, [GREEDY] * 3)
    assert "injected forward fault" in done["r0"].error and done["r0"].outputs[0].finish_reason == "abort"
    assert len(done["r0"].outputs[0].token_ids) == 2, "it failed at its third step"
    assert [done[r].outputs[0].token_ids for r in ("r1", "r2")] == reference[1:]
    assert_clean(engine)


def test_a_detokenization_fault_fails_its_sequence_alone(llm: LLM, reference, monkeypatch) -> None:
    engine = llm.engine
    real = engine._detokenize

    def broken_for_r2(seq):
        if seq.request_id == "r2" and seq.num_output_tokens == 3:
            raise UnicodeError("injected decode fault")
        return real(seq)

    monkeypatch.setattr(engine, "_detokenize", broken_for_r2)
    done = run(engine, [GREEDY] * 3)
    assert "injected decode fault" in done["r2"].error
    assert [done[r].outputs[0].token_ids for r in ("r0", "r1")] == reference[:2]
    assert_clean(engine)


def test_a_scheduler_fault_fails_every_request_and_the_engine_serves_on(
    llm: LLM, reference, monkeypatch
) -> None:
    engine = llm.engine
    real = engine.scheduler.schedule
    calls = {"n": 0}

    def fails_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected scheduler fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.scheduler, "schedule", fails_once)
    done = run(engine, [GREEDY] * 3)
    assert all("injected scheduler fault" in done[r].error for r in ("r0", "r1", "r2"))
    assert_clean(engine)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference


def test_stop_strings_cut_or_keep_like_vllm(llm: LLM) -> None:
    text = llm.generate("The quick brown", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    full = text.outputs[0].text
    stop = full[3:6]
    assert stop and "\ufffd" not in stop
    index = full.index(stop)
    for include, expected in ((False, full[:index]), (True, full[: index + len(stop)])):
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop],
                                include_stop_str_in_output=include)  # fmt: skip
        c = llm.generate("The quick brown", params)[0].outputs[0]
        assert (c.text, c.finish_reason, c.stop_reason) == (expected, "stop", stop)
