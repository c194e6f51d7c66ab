"""Tensor parallel vLLM with KVStoreConnectorV1: chunks are TP-free (the keys and bytes a TP=1 engine
stores), so a prompt a TP=2 vLLM stored is a hit for a fresh TP=1 vLLM and for a fresh TP=4 one, and the
reverse, and for kvstore-engine; each answers like its own run without the store.

A tiny random-weight Llama (8 heads, 4 KV heads of 64: two KV heads per rank at TP=2, one at TP=4;
logits spread out, written in the test) in three vLLM processes that live for the module: TP=4 (four
ranks on this box's two cores, two a core: oversubscribed, fine for a correctness test), TP=2 (a core
per rank) and TP=1. "Like its own run without the store": the same process answers the prompt under a
cache salt (part of the chunk keys: nothing to hit) first. Numbers: prompt logprobs of the tokens vLLM
computed after the hit and the logprob of each generated token, within `TOL` of that run, and the same
greedy tokens.
"""

from __future__ import annotations

import random
import shutil

import pytest

from tests.connectors.vllm.tiny_models import VOCAB, checkpoint_dir
from tests.connectors.vllm.vllm_util import (
    Engine,
    max_logprob_diff,
    requires_vllm,
    start_engines,
    transfer_config,
)

pytestmark = [pytest.mark.slow, requires_vllm]
PROMPT = 700  # 2 full chunks of 256 + a 128-token partial: vLLM loads 640 (5 blocks of 128)
HIT = 640
TOL = 1e-3  # fp32: TP=1 and TP=2 compute the same KV to float rounding (bf16 rounding would flip
# near-tied greedy tokens of a random model: not a test of the store). The measured figures are printed.
DTYPE = "float32"


def prompt(seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, VOCAB) for _ in range(PROMPT)]


@pytest.fixture(scope="module")
def model(tmp_path_factory, model_dir):
    out = checkpoint_dir("llama8", tmp_path_factory.mktemp("tp-model"))
    for name in ("tokenizer.json", "tokenizer_config.json"):  # kvstore-engine wants one; ids < 512 decode
        shutil.copy(model_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def engines(model, store, tmp_path_factory):
    logs = tmp_path_factory.mktemp("tp-logs")
    ktc = transfer_config(store.url, "kv_both")
    args = {"model": str(model), "kv_transfer_config": ktc, "dtype": DTYPE}
    tp4 = Engine(logs / "tp4.log", cores="0|1|0|1", tensor_parallel_size=4, **args)
    tp2 = Engine(logs / "tp2.log", cores="0|1", tensor_parallel_size=2, **args)
    tp1 = Engine(logs / "tp1.log", cores="0-1", **args)
    start_engines([tp4, tp2, tp1])
    yield {"tp4": tp4, "tp2": tp2, "tp1": tp1}
    for e in (tp4, tp2, tp1):
        e.stop()


def wait_stored(store, model, tokens: list[int], timeout: float = 60) -> None:
    """Until the chunks of `tokens` (its partial chunk too) are in the store."""
    import json  # noqa: PLC0415
    import time  # noqa: PLC0415

    from kvstore.sdk import Store  # noqa: PLC0415

    from kvstore.keys import KVLayout, chunk_keys, partial_key  # noqa: PLC0415

    config = json.loads((model / "config.json").read_text())
    layout = KVLayout.for_model(config, model=str(model), kv_dtype=DTYPE, chunk_size=256)
    keys = chunk_keys(tokens, layout) + [k for k in [partial_key(tokens, layout)] if k]
    deadline = time.monotonic() + timeout
    with Store.connect(store.url) as client:
        while not all(client.batch_exists(keys)):
            assert time.monotonic() < deadline, "vLLM did not store the prompt"
            time.sleep(0.1)


def reuse(storer: Engine, loader: Engine, tokens: list[int], store, model) -> tuple[dict, dict, float]:
    """`storer` computes and stores `tokens`; `loader` (which never saw them) answers them from the
    store and without it: (with the store, without, the largest logprob difference)."""
    cold_storer = storer.cold(tokens)
    stored = storer.generate(tokens)
    assert stored["cached"] == 0 and stored["tokens"] == cold_storer["tokens"]
    wait_stored(store, model, tokens[:HIT])  # the partial chunk goes out with the storer's next step
    cold = loader.cold(tokens)
    assert cold["cached"] == 0
    hit = loader.generate(tokens)
    return hit, cold, max_logprob_diff(hit, cold)


def check_reuse(engines, store, model, storer: str, loader: str, seed: int) -> None:
    """`storer` (engines' name: "tp2") stores prompt(seed); a fresh `loader` loads every full block of it
    and answers token for token, its prompt logprobs within TOL of its own cold run."""
    hit, cold, diff = reuse(engines[storer], engines[loader], prompt(seed), store, model)
    print(f"\n{storer} -> {loader}: {hit['cached']} tokens loaded, max |logprob difference| {diff:.4f}")
    assert hit["cached"] == HIT
    assert hit["tokens"] == cold["tokens"]
    assert diff <= TOL


def test_tp2_stores_and_a_fresh_tp1_reuses_it_token_for_token(engines, store, model) -> None:
    check_reuse(engines, store, model, "tp2", "tp1", 1)


def test_tp1_stores_and_a_fresh_tp2_reuses_it_token_for_token(engines, store, model) -> None:
    check_reuse(engines, store, model, "tp1", "tp2", 2)


def test_tp2_stores_and_a_fresh_tp4_reuses_it_token_for_token(engines, store, model) -> None:
    """TP=2 saves gather two ranks' heads into the TP-free chunk; each TP=4 rank loads its one KV head."""
    check_reuse(engines, store, model, "tp2", "tp4", 5)


def test_tp4_stores_and_a_fresh_tp2_reuses_it_token_for_token(engines, store, model) -> None:
    check_reuse(engines, store, model, "tp4", "tp2", 6)


def test_kvstore_engine_reuses_what_vllm_tp2_stored_and_the_reverse(engines, model, store) -> None:
    from kvstore.engine import LLM, SamplingParams  # noqa: PLC0415

    from tests.connectors.engine_util import store_metrics  # noqa: PLC0415

    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    args = {"dtype": DTYPE, "max_model_len": 2048, "kv_cache_memory": "64MiB", "num_threads": 1}
    engine = LLM(str(model), kv_backend="kvstore", kv_store_url=store.url, **args)
    cold_engine = LLM(str(model), **args)
    try:
        tokens = prompt(3)
        engines["tp2"].generate(
            tokens
        )  # stored by vLLM at TP=2; its partial chunk goes out with the next step
        wait_stored(store, model, tokens[:HIT])
        hits = "vllm:external_prefix_cache_hits_total"
        before = store_metrics(engine)[hits]
        (out,) = engine.generate([tokens], greedy)
        assert store_metrics(engine)[hits] - before == HIT
        (own,) = cold_engine.generate([tokens], greedy)
        assert list(out.outputs[0].token_ids) == list(own.outputs[0].token_ids)
        # and back: what kvstore-engine stores is a hit for vLLM at TP=2 (its full chunks: its partial
        # chunk is 688 tokens long, no multiple of vLLM's 128-token blocks)
        tokens = prompt(4)
        (out,) = engine.generate([tokens], greedy)
        engine.engine.runner.connector.flush()
        hit = engines["tp2"].generate(tokens)
        assert hit["cached"] == 512
        cold = engines["tp2"].cold(tokens)
        assert hit["tokens"] == cold["tokens"]
        print(f"\nkvstore-engine -> vLLM TP=2: max |logprob difference| {max_logprob_diff(hit, cold):.4f}")
    finally:
        engine.shutdown()
        cold_engine.shutdown()
