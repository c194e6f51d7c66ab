"""An MLA model (deepseek_v2-shaped: kv_lora_rank 512 + qk_rope_head_dim 64, the 576-wide latent vLLM
CPU's MLA backends run) through KVStoreConnectorV1. The latent is the same on every TP rank: stored once,
whatever the TP size, and every rank loads all of it.

vLLM CPU runs MLA on AMX CPUs with its AMX MLA backend (bf16, prefix caching on): at each TP size a fresh
process reuses what another stored, and answers exactly as with vLLM's own prefix-cache hit of the same
prompt (the reference for "continuing from a cached prefix": both differ from a cold run by the same
amount, the extend kernel's bf16 rounding on a random model). vLLM's reference CPU_MLA backend (which it
picks without AMX, or when asked) turns vLLM's own prefix caching off, its prefill not attending over a
prefix it did not compute (measured: a loaded prefix moved fp32 prompt logprobs by ~2): there the
connector reports no hits and saves, and what it saved is a hit for an AMX MLA engine.

Tiny random-weight checkpoint (every layer dense). Two TP=2 processes, one CPU_MLA process, then two TP=1
ones (never more than two at once). Across TP sizes the test shows the bytes: one blob per chunk of the
same size, the first layer's latent bit for bit, the next within rounding (measured: the same).
"""

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
TOL = 1e-3  # a store hit against vLLM's own prefix-cache hit: the same KV, the same kernel (measured 0.0)
HIT = 640  # 2 full chunks and the 128-token partial one (AMX MLA: 128-token blocks)
SAVES_ONLY = "cannot use a prefix it did not compute"


class Engines:
    """At most two vLLM processes at a time: a pair of one TP size, or one CPU_MLA process."""

    def __init__(self, model, store, logs) -> None:
        self.model, self.store, self.logs = model, store, logs
        self.args = {"model": str(model), "kv_transfer_config": transfer_config(store.url, "kv_both")}
        self.key, self.engines = None, []
        self.blobs: dict[int, list[bytes]] = {}  # TP size -> the blobs of the bytes prompt

    def get(self, key: str) -> list[Engine]:
        if key != self.key:
            self.stop()
            if key == "cpu_mla":
                self.engines = [
                    Engine(self.logs / "cpu-mla.log", cores="0-1", attention_backend="CPU_MLA", **self.args)
                ]
            else:
                tp = int(key[2:])
                cores = "0|1" if tp == 2 else "0-1"
                self.engines = [Engine(self.logs / f"{key}-{i}.log", cores=cores, tensor_parallel_size=tp, **self.args)
                                for i in range(2)]  # fmt: skip
            self.key = key
            start_engines(self.engines)
        return self.engines

    def stop(self) -> None:
        for e in self.engines:
            e.stop()
        self.engines, self.key = [], None


@pytest.fixture(scope="module")
def engines(store, tmp_path_factory):
    model = checkpoint_dir("mla", tmp_path_factory.mktemp("mla-model"))
    e = Engines(model, store, tmp_path_factory.mktemp("mla-logs"))
    yield e
    e.stop()


def stored_blobs(store, model, tokens: list[int], salt: str) -> list[bytes]:
    import json  # noqa: PLC0415

    from kvstore.connectors.chunks import key_extra  # noqa: PLC0415
    from kvstore.sdk import Store  # noqa: PLC0415

    from kvstore.keys import KVLayout, chunk_keys  # noqa: PLC0415

    class Salted:
        cache_salt, lora_request = salt, None

    config = json.loads((model / "config.json").read_text())
    layout = KVLayout.for_model(config, model=str(model), kv_dtype="bfloat16", chunk_size=256, mla=True)
    with Store.connect(store.url) as client:
        blobs = [client.get_blob(k) for k in chunk_keys(tokens, layout, extra=key_extra(Salted()))]
    assert all(b is not None for b in blobs), salt
    return [bytes(b) for b in blobs]


def reuse_like_vllms_own_hit(loader: Engine, tokens: list[int], label: str) -> None:
    cold = loader.cold(tokens)
    own = loader.cold(tokens)  # the same salt again: vLLM's own prefix-cache hit
    hit = loader.generate(tokens)  # no salt: from the store
    diff = max_logprob_diff(hit, own)
    print(f"\n{label}: {hit['cached']} of {PROMPT} tokens loaded; max |logprob difference| to vLLM's own prefix hit "
          f"{diff:.4f}, both to the cold run {max_logprob_diff(own, cold):.4f}")  # fmt: skip
    assert cold["cached"] == 0 and own["cached"] == hit["cached"] == HIT
    assert hit["tokens"] == own["tokens"] == cold["tokens"]
    assert diff <= TOL


def reuse_at(engines: Engines, tp: int) -> None:
    a, b = engines.get(f"tp{tp}")
    assert SAVES_ONLY not in a.tail(100_000)
    tokens = prompt(20 + tp)
    assert a.generate(tokens)["cached"] == 0
    reuse_like_vllms_own_hit(b, tokens, f"MLA TP={tp}")
    a.generate(prompt(29), salt="bytes")  # the same prompt at each TP size, for the bytes test
    engines.blobs[tp] = stored_blobs(engines.store, engines.model, prompt(29)[:512], "bytes")


def test_mla_at_tp2_a_fresh_vllm_reuses_what_another_stored(engines) -> None:
    reuse_at(engines, 2)


def test_mla_on_vllms_cpu_mla_backend_saves_and_reports_no_hits(engines) -> None:
    (c,) = engines.get("cpu_mla")
    log = c.tail(100_000)
    assert "prefix caching to be disabled" in log and log.count(SAVES_ONLY) == 1
    tokens = prompt(40)
    assert c.generate(tokens)["cached"] == 0
    assert c.generate(tokens)["cached"] == 0  # its own prefix cache is off, and the store reports nothing
    engines.blobs["cpu_mla"] = stored_blobs(engines.store, engines.model, tokens[:512], "")


def test_mla_at_tp1_a_fresh_vllm_reuses_what_another_stored_and_what_cpu_mla_saved(engines) -> None:
    reuse_at(engines, 1)
    _, b = engines.get("tp1")
    tokens = prompt(40)  # CPU_MLA stored its 2 full chunks (its partial chunk, in 16-token blocks, runs into
    cold = b.cold(tokens)  # its generated tokens)
    hit = b.generate(tokens)
    print(f"\nMLA TP=1 on CPU_MLA's saves: {hit['cached']} tokens loaded, max |logprob difference| to the cold run "
          f"{max_logprob_diff(hit, cold):.4f}")  # fmt: skip
    assert hit["cached"] == 512 and hit["tokens"] == cold["tokens"]


def test_mla_tp1_stores_the_same_bytes_as_tp2(engines) -> None:
    """One blob per chunk at either TP size (rank 0 stores the latent every rank holds), of the same
    size, the first layer's latent bit for bit, the next within vLLM's TP=2-vs-TP=1 rounding."""
    import torch  # noqa: PLC0415

    from kvstore.blob import decode_blob  # noqa: PLC0415

    b2, b1 = engines.blobs[2], engines.blobs[1]
    assert [len(b) for b in b2] == [len(b) for b in b1] and len(b1) == 2
    for x, y in zip(b2, b1, strict=True):
        t2, t1 = decode_blob(x), decode_blob(y)
        assert t2.shape == t1.shape == (1, 2, 256, 1, 576)
        assert torch.equal(t2[:, 0], t1[:, 0])
        err = ((t2[:, 1].float() - t1[:, 1].float()).abs().max() / t1[:, 1].float().abs().max()).item()
        print(f"\nlayer 1 latent, vLLM TP=2 vs TP=1: relative max difference {err:.2e}")
        assert err < 1e-2  # AMX MLA: measured 0.000
