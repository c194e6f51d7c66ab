"""fp8 KV caches (`--kv-cache-dtype fp8_e4m3`, AVX-512 here) through KVStoreConnectorV1: vLLM hands the
cache over as uint8; the connector stores its bytes as the fp8 format the layout names, raw, under keys
that carry that format and a digest of the layers' k/v scales. A prompt one fp8 vLLM (TP=1) stored is a
hit for a fresh fp8 vLLM at TP=2, which answers like its own run without the store; a connector with
the other fp8 format, with other scales, or with a bf16 cache asks the store for other keys: a miss,
never a load. Tiny random-weight Llama (see test_vllm_tp.py)."""

from __future__ import annotations

import dataclasses

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
TOL = 0.05  # fp8 KV: the hit recomputes its tail on the same quantised KV; measured figures are printed


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return checkpoint_dir("llama", tmp_path_factory.mktemp("fp8-model"))


@pytest.fixture(scope="module")
def engines(model, store, tmp_path_factory):
    logs = tmp_path_factory.mktemp("fp8-logs")
    ktc = transfer_config(store.url, "kv_both")
    args = {"model": str(model), "kv_transfer_config": ktc, "dtype": "float32", "kv_cache_dtype": "fp8_e4m3"}
    one = Engine(logs / "tp1.log", cores="0-1", **args)
    two = Engine(logs / "tp2.log", cores="0|1", tensor_parallel_size=2, **args)
    start_engines([one, two])
    yield one, two
    for e in (one, two):
        e.stop()


def test_fp8_stored_by_one_vllm_is_reused_by_a_fresh_one_at_tp2(engines) -> None:
    one, two = engines
    tokens = prompt(11)
    stored = one.generate(tokens)
    assert stored["cached"] == 0
    cold = two.cold(tokens)
    hit = two.generate(tokens)
    diff = max_logprob_diff(hit, cold)
    print(f"\nfp8 e4m3 TP=1 -> TP=2: {hit['cached']} tokens loaded, max |logprob difference| {diff:.4f}")
    assert hit["cached"] == HIT
    assert hit["tokens"] == cold["tokens"]
    assert diff <= TOL


def _scheduler(model, store, **engine):
    """A scheduler-side KVStoreConnectorV1 for `model` as vLLM would build it (no engine started)."""
    from kvstore.connectors.vllm import KVStoreConnectorV1  # noqa: PLC0415
    from vllm.config import KVTransferConfig  # noqa: PLC0415
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: PLC0415
    from vllm.engine.arg_utils import EngineArgs  # noqa: PLC0415

    ktc = KVTransferConfig(**transfer_config(store.url, "kv_both"))
    args = EngineArgs(model=str(model), dtype="float32", enforce_eager=True, max_model_len=4096,
                      skip_tokenizer_init=True, kv_transfer_config=ktc, **engine)  # fmt: skip
    return KVStoreConnectorV1(args.create_engine_config(), KVConnectorRole.SCHEDULER, None)


class _Req:
    def __init__(self, rid: str, tokens: list[int]) -> None:
        self.request_id, self.all_token_ids, self.num_preemptions = rid, tokens, 0


def test_another_format_other_scales_or_another_model_is_a_miss_never_a_load(engines, model, store) -> None:
    from kvstore.connectors.kv_scheduler import KVStoreScheduler  # noqa: PLC0415
    from kvstore.connectors.vllm import scales_digest  # noqa: PLC0415

    one, _ = engines
    tokens = prompt(12)
    one.generate(tokens)  # stored by fp8 e4m3, scales 1.0 (a checkpoint without a quantization config)
    same = _scheduler(model, store, kv_cache_dtype="fp8_e4m3")
    try:
        assert same.config.layout.kv_dtype == "float8_e4m3fn"
        assert same.config.layout.kv_scales == scales_digest([(1.0, 1.0)] * 4)
        assert same.get_num_new_matched_tokens(_Req("a", tokens), 0) == (
            HIT,
            True,
        )  # the control (async load)
        # the same engine with other scales: other keys
        config = same.config.model_copy(
            update={
                "layout": dataclasses.replace(same.config.layout, kv_scales=scales_digest([(0.5, 0.5)] * 4))
            }
        )
        assert KVStoreScheduler(config, same.handle).get_num_new_matched_tokens(_Req("b", tokens), 0) == (
            0,
            False,
        )
    finally:
        same.shutdown()
    from tests.connectors.vllm.tiny_models import config_dir  # noqa: PLC0415

    another = config_dir("llama8", model.parent / "another")  # another model (config), fp8 e4m3 too
    for name, path, dtype in (
        ("e5m2", model, "fp8_e5m2"),
        ("bf16", model, "auto"),
        ("model", another, "fp8_e4m3"),
    ):
        other = _scheduler(path, store, kv_cache_dtype=dtype)
        try:
            assert other.get_num_new_matched_tokens(_Req(name, tokens), 0) == (0, False), name
        finally:
            other.shutdown()
