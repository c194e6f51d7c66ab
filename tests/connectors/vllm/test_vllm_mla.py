"""An MLA model (deepseek_v2-shaped: kv_lora_rank 512 + qk_rope_head_dim 64, the 576-wide latent vLLM's
CPU_MLA backend runs) through KVStoreConnectorV1. vLLM CPU turns its own prefix caching and chunked
prefill off for CPU_MLA (block size 16): the connector still loads. The latent is the same on every TP
rank: stored once, whatever the TP size, and every rank loads all of it. Tiny random-weight checkpoint
(every layer dense), a vLLM at TP=2 and one at TP=1 for the module."""

from __future__ import annotations

import pytest

from tests.connectors.vllm.test_vllm_tp import PROMPT, prompt
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
MLA = {"attention_backend": "CPU_MLA"}  # the reference CPU MLA backend (AMX MLA keeps prefix caching on)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return checkpoint_dir("mla", tmp_path_factory.mktemp("mla-model"))


@pytest.fixture(scope="module")
def engines(model, store, tmp_path_factory):
    logs = tmp_path_factory.mktemp("mla-logs")
    ktc = transfer_config(store.url, "kv_both")
    args = {"model": str(model), "kv_transfer_config": ktc, "dtype": "float32", **MLA}
    two = Engine(logs / "tp2.log", cores="0|1", tensor_parallel_size=2, **args)
    one = Engine(logs / "tp1.log", cores="0-1", **args)
    start_engines([two, one])
    yield two, one
    for e in (two, one):
        e.stop()


def test_mla_tp2_stores_and_a_fresh_tp1_reuses_it(engines) -> None:
    two, one = engines
    assert "prefix caching to be disabled" in two.tail(100_000), "vLLM CPU kept its own prefix caching on"
    tokens = prompt(21)
    stored = two.generate(tokens)
    assert stored["cached"] == 0
    cold = one.cold(tokens)
    hit = one.generate(tokens)
    diff = max_logprob_diff(hit, cold)
    print(
        f"\nMLA TP=2 -> TP=1: {hit['cached']} of {PROMPT} tokens loaded, max |logprob difference| {diff:.4f}"
    )
    assert hit["cached"] >= 512  # every full chunk (and, block size 16, the partial one)
    assert hit["tokens"] == cold["tokens"]
    assert diff <= TOL


def test_mla_tp1_stores_the_same_bytes_as_tp2(engines, store, model) -> None:
    """The same prompt under two salts (two sets of keys), once at TP=2 and once at TP=1: one blob per
    chunk either way, of the same size, with the same latent (bit for bit in the first layer, which
    TP does not touch; within float rounding after it)."""
    import json  # noqa: PLC0415

    import torch  # noqa: PLC0415
    from kvstore.connectors.chunks import key_extra  # noqa: PLC0415
    from kvstore.sdk import Store  # noqa: PLC0415

    from kvstore.blob import decode_blob  # noqa: PLC0415
    from kvstore.keys import KVLayout, chunk_keys  # noqa: PLC0415

    two, one = engines
    tokens = prompt(22)
    two.generate(tokens, salt="tp2")
    one.generate(tokens, salt="tp1")
    config = json.loads((model / "config.json").read_text())
    layout = KVLayout.for_model(config, model=str(model), kv_dtype="float32", chunk_size=256, mla=True)

    class Salted:
        def __init__(self, salt: str) -> None:
            self.cache_salt, self.lora_request = salt, None

    got = {}
    with Store.connect(store.url) as client:
        for salt in ("tp2", "tp1"):
            keys = chunk_keys(tokens, layout, extra=key_extra(Salted(salt)))
            blobs = [client.get_blob(k) for k in keys]
            assert all(b is not None for b in blobs), salt
            got[salt] = (blobs, [decode_blob(b) for b in blobs])
    (b2, t2), (b1, t1) = got["tp2"], got["tp1"]
    assert [len(b) for b in b2] == [len(b) for b in b1]  # one blob per chunk, the TP=1 size: stored once
    assert t2[0].shape == (1, 2, 256, 1, 576)
    for a, b in zip(t2, t1, strict=True):
        assert torch.equal(a[:, 0], b[:, 0])
        err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
        assert err < 1e-4, err
