"""Sampler: greedy, temperature, top-k, top-p, per-request seeds; bad parameters are rejected."""

from __future__ import annotations

import pytest
import torch
from kvstore.engine.errors import InvalidRequest
from kvstore.engine.sampler import Sampler, apply_top_k_top_p
from kvstore.engine.sampling_params import SamplingParams


def logits_for(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


def draw(params: SamplingParams, logits: torch.Tensor, n: int, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    sampler = Sampler()
    tokens = [sampler(logits, [f"r{i}"], [params])[0] for i in range(n)]
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).float() / n


def test_greedy_is_argmax_per_row() -> None:
    logits = torch.randn(5, 100)
    params = [SamplingParams(temperature=0.0)] * 5
    assert Sampler()(logits, list("abcde"), params) == logits.argmax(-1).tolist()


def test_temperature_sampling_follows_the_distribution() -> None:
    p = [0.5, 0.3, 0.15, 0.05]
    freq = draw(SamplingParams(temperature=1.0), logits_for(p), 4000)
    assert torch.allclose(freq, torch.tensor(p), atol=0.03)
    # Low temperature sharpens towards the argmax.
    sharp = draw(SamplingParams(temperature=0.3), logits_for(p), 1000)
    assert sharp[0] > 0.8


def test_top_k_and_top_p_restrict_the_support() -> None:
    p = [0.4, 0.3, 0.2, 0.1]
    assert draw(SamplingParams(top_k=2), logits_for(p), 1000)[2:].sum() == 0
    # Nucleus 0.6: 0.4 < 0.6, 0.4 + 0.3 >= 0.6 -> tokens 0 and 1 survive.
    freq = draw(SamplingParams(top_p=0.6), logits_for(p), 2000)
    assert freq[2:].sum() == 0 and torch.allclose(freq[:2], torch.tensor([4 / 7, 3 / 7]), atol=0.04)
    # A tiny top_p still keeps the most likely token.
    assert draw(SamplingParams(top_p=0.01), logits_for(p), 50)[0] == 1


def test_top_k_top_p_mask_is_per_row() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0], [4.0, 3.0, 2.0, 1.0]])
    out = apply_top_k_top_p(logits, torch.tensor([1, 0]), torch.tensor([1.0, 1.0]))
    assert torch.isinf(out[0, 1:]).all() and out[0, 0] == 4.0
    assert torch.equal(out[1], logits[1])


def test_seeded_requests_do_not_depend_on_the_batch() -> None:
    logits = torch.randn(1, 1000)
    params = SamplingParams(temperature=1.0, seed=1234)
    alone = Sampler()
    seq_alone = [alone(logits, ["x"], [params])[0] for _ in range(20)]
    batched = Sampler()
    other = SamplingParams(temperature=1.0)
    seq_batched = [
        batched(torch.cat([torch.randn(1, 1000), logits]), ["y", "x"], [other, params])[1] for _ in range(20)
    ]
    assert seq_alone == seq_batched
    assert len(set(seq_alone)) > 1, "a seeded request still samples, it does not repeat one token"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.5},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -3},
        {"max_tokens": 0},
        {"max_tokens": 2.5},
        {"min_tokens": 5, "max_tokens": 2},
        {"stop": [""]},
        {"stop_token_ids": [-1]},
        {"seed": "abc"},
        {"temperature": float("nan")},
    ],
)
def test_invalid_sampling_params_raise_invalid_request(kwargs: dict) -> None:
    with pytest.raises(InvalidRequest, match="invalid sampling parameter"):
        SamplingParams(**kwargs)


def test_stop_accepts_a_single_string() -> None:
    assert SamplingParams(stop="\n").stop == ["\n"]


def test_logit_bias_steers_greedy_and_sampling() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0, 0.0]])
    assert Sampler()(logits, ["a"], [SamplingParams(temperature=0, logit_bias={2: 10})]) == [2]
    freq = draw(SamplingParams(logit_bias={0: -100}), logits, 300)
    assert freq[0] == 0


def test_repetition_frequency_and_presence_penalties_match_vllm() -> None:
    from kvstore.engine.sampler import apply_penalties

    logits = torch.tensor([[2.0, -2.0, 2.0, 1.0, 0.5]])
    history = [([0], [1, 3, 3])]  # token 0 in the prompt, 1 once and 3 twice in the output
    rep = apply_penalties(logits.clone(), history, [SamplingParams(repetition_penalty=2.0)])
    assert rep.tolist() == [[1.0, -4.0, 2.0, 0.5, 0.5]]  # seen: positive / 2, negative * 2
    fp = apply_penalties(
        logits.clone(), history, [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)]
    )
    assert fp.tolist() == [[2.0, -2.75, 2.0, -0.25, 0.5]]  # the prompt does not count for these two
    # Greedy decoding follows the penalized logits (vLLM applies penalties before the argmax).
    params = SamplingParams(temperature=0, repetition_penalty=4.0)
    assert Sampler()(logits, ["a"], [params], [([0], [])]) == [2]


def test_min_p_drops_the_unlikely_tail() -> None:
    p = [0.5, 0.3, 0.15, 0.05]
    freq = draw(SamplingParams(min_p=0.35), logits_for(p), 1000)  # keeps p >= 0.175
    assert freq[2:].sum() == 0 and freq[1] > 0.25


def test_a_row_that_fails_alone_fails_alone_and_seeds_stay_reproducible() -> None:
    logits = torch.randn(3, 50)
    good = SamplingParams(temperature=1.0, seed=7)
    bad = SamplingParams(temperature=1.0, seed=1)
    bad.seed = 2**64  # past validation (as a bug would): torch's manual_seed overflows
    sampler = Sampler()
    tokens, errors = sampler.sample_isolated(
        logits, ["g", "b", "h"], [good, bad, SamplingParams(temperature=0)]
    )
    assert tokens[1] is None and list(errors) == [1] and tokens[2] == int(logits[2].argmax())
    clean = Sampler()
    expected = [clean(logits[:1], ["g"], [good])[0] for _ in range(3)]
    assert [tokens[0]] + [sampler(logits[:1], ["g"], [good])[0] for _ in range(2)] == expected


def test_min_tokens_bans_eos_and_stop_tokens_until_reached_like_vllm() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0]])  # token 2 is the eos, 3 a stop token id
    sampler = Sampler(eos_token_ids={2})
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3])
    assert sampler(logits, ["a"], [p], [([0], [1])]) == [1], "one output token so far: 2 and 3 are banned"
    assert sampler(logits, ["a"], [p], [([0], [1, 1])]) == [2]
    ignore = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert sampler(logits, ["a"], [ignore], [([0], [])]) == [2], "ignore_eos: eos is an ordinary token"


def test_logprobs_are_the_raw_distribution_of_the_rows_that_ask() -> None:
    """vLLM V1's raw logprobs: log_softmax of the model's logits, before logit_bias, penalties,
    temperature and top-k; the sampled token's, and the top n most likely first; other rows get none."""
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    raw = logits.log_softmax(-1)
    params = [
        SamplingParams(temperature=0.0, logprobs=3, logit_bias={7: 100.0}),  # the bias picks token 7
        SamplingParams(temperature=0.7, top_k=5, seed=1),  # no logprobs
        SamplingParams(temperature=1.3, seed=2, logprobs=0),
    ]
    sampler = Sampler()
    tokens, errors = sampler.sample_isolated(logits.clone(), ["a", "b", "c"], params)
    assert not errors and tokens[0] == 7 and set(sampler.logprobs) == {"a", "c"}
    a, c = sampler.logprobs["a"], sampler.logprobs["c"]
    assert a.token_id == 7 and a.logprob == pytest.approx(raw[0, 7].item(), abs=1e-6)
    top_lp, top_ids = raw[0].topk(3)
    assert [t for t, _ in a.top] == top_ids.tolist()
    assert [lp for _, lp in a.top] == pytest.approx(top_lp.tolist(), abs=1e-6)
    assert (
        c.token_id == tokens[2]
        and c.top == ()
        and c.logprob == pytest.approx(raw[2, tokens[2]].item(), abs=1e-6)
    )
    sampler.sample_isolated(logits, ["b"], [params[1]])
    assert sampler.logprobs == {}, "each step's logprobs replace the last"


def test_logprobs_bounds() -> None:
    for bad in (-1, 21, 2.0, True):
        with pytest.raises(InvalidRequest, match="logprobs"):
            SamplingParams(logprobs=bad)
    assert SamplingParams(logprobs=20).logprobs == 20
