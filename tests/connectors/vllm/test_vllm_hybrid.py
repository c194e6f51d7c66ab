"""Hybrid models with vLLM's hybrid KV cache manager on (KVStoreConnectorV1 is `SupportsHMA`).

A sliding-window model (a tiny random-weight gemma3_text: five window layers of 256 tokens, one full
layer; vLLM gives each its own block table and frees a window layer's blocks out of its window): a prompt
one vLLM stored is a hit for a fresh vLLM, which answers like its own run without the store.

A Mamba-style hybrid (a tiny LFM2: short-conv layers with state, attention layers): vLLM starts with its
hybrid manager (without SupportsHMA it would refuse the model), answers, and the connector reports no
hits for it, saying why in one log line — kvstore does not store the conv / SSM state a hit would need.
"""

from __future__ import annotations

import pytest

from tests.connectors.vllm.test_vllm_tp import HIT, prompt
from tests.connectors.vllm.tiny_models import checkpoint_dir
from tests.connectors.vllm.vllm_util import (
    Engine,
    max_logprob_diff,
    requires_vllm,
    start_engines,
    transfer_config,
)

pytestmark = [pytest.mark.slow, requires_vllm]
TOL = 1e-3  # fp32 (see test_vllm_tp.py)
HMA_OFF = "Turning off hybrid kv cache manager"


@pytest.fixture(scope="module")
def engines(store, tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid-models")
    logs = tmp_path_factory.mktemp("hybrid-logs")
    ktc = transfer_config(store.url, "kv_both")
    gemma, lfm2 = checkpoint_dir("gemma3", root), checkpoint_dir("lfm2", root)
    out = {
        "window-a": Engine(logs / "window-a.log", cores="0", model=str(gemma), kv_transfer_config=ktc, dtype="float32"),
        "window-b": Engine(logs / "window-b.log", cores="1", model=str(gemma), kv_transfer_config=ktc, dtype="float32"),
    }  # fmt: skip
    start_engines(list(out.values()))
    out["mamba"] = Engine(
        logs / "mamba.log", cores="0-1", model=str(lfm2), kv_transfer_config=ktc, dtype="float32"
    )
    try:
        start_engines([out["mamba"]])
    except BaseException:
        for e in out.values():
            e.stop()
        raise
    yield out
    for e in out.values():
        e.stop()


def test_a_sliding_window_model_with_the_hybrid_manager_reuses_a_prompt(engines) -> None:
    a, b = engines["window-a"], engines["window-b"]
    assert HMA_OFF not in a.tail(100_000), "vLLM turned its hybrid KV cache manager off"
    tokens = prompt(31)
    assert a.generate(tokens)["cached"] == 0
    cold = b.cold(tokens)
    hit = b.generate(tokens)
    diff = max_logprob_diff(hit, cold)
    print(f"\nsliding window, HMA on: {hit['cached']} tokens loaded, max |logprob difference| {diff:.4f}")
    assert hit["cached"] == HIT
    assert hit["tokens"] == cold["tokens"]
    assert diff <= TOL


def test_a_mamba_style_hybrid_starts_and_answers_with_no_store_hits(engines) -> None:
    m = engines["mamba"]
    log = m.tail(100_000)
    assert HMA_OFF not in log
    assert log.count("Mamba / linear-attention layers whose state kvstore does not store") == 1
    tokens = prompt(32)
    first = m.generate(tokens)
    m.reset_prefix_cache()  # vLLM's own cache emptied: only the store could hit, and it must not
    again = m.generate(tokens)
    assert first["cached"] == again["cached"] == 0
    assert again["tokens"] == first["tokens"]
