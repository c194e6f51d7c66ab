"""SmolLM2 with an fp8 KV cache and `--kv-backend kvstore`: the chunks reach the store as fp8 (one byte
per value, raw: no second quantisation), a new engine loads them and answers token for token like the
engine that computed them, and a bf16 engine never sees them (its keys differ)."""

from __future__ import annotations

import pytest
import torch
from kvstore.sdk import Store

from kvstore.blob import verify_blob
from kvstore.keys import KVLayout, chunk_keys
from tests.connectors.engine_util import doc, generate, llm, store_metrics

pytestmark = pytest.mark.slow
HITS = "vllm:external_prefix_cache_hits_total"


def test_fp8_chunks_are_stored_raw_and_reload_token_identical(kv_server) -> None:
    prompts = [doc(300, 41)]
    fp8 = dict(dtype="bfloat16", kv_cache_dtype="fp8", kv_backend="kvstore", kv_store_url=kv_server.url)
    a = llm(**fp8, kv_codec="int4")  # an fp8 cache ignores the codec: its blocks are stored as they are
    try:
        want = generate(a, prompts)
        assert store_metrics(a)["kvstore_connector_saved_chunks_total"] >= 1
        e = a.engine
        layout = KVLayout.for_model(
            e.model_config.raw, model=e.model_config.model_name, kv_dtype="float8_e4m3fn", chunk_size=256,
            kv_scales=e.kv_scales.digest(),
        )  # fmt: skip
    finally:
        a.shutdown()
    with Store.connect(kv_server.url) as store:
        blob = store.get_blob(chunk_keys(prompts[0][:256], layout)[0])
    assert blob is not None, "the chunk is stored under the fp8 layout's key"
    header = verify_blob(blob)
    assert header.dtype == torch.float8_e4m3fn and header.codec_id == 0  # raw
    assert header.payload_len == 2 * 30 * 256 * 3 * 64  # one byte per value
    b = llm(**fp8)
    try:
        before = store_metrics(b)[HITS]
        assert generate(b, prompts) == want
        assert store_metrics(b)[HITS] - before == 256
    finally:
        b.shutdown()
    c = llm(dtype="bfloat16", kv_backend="kvstore", kv_store_url=kv_server.url)  # a bf16 cache
    try:
        generate(c, prompts)
        assert store_metrics(c)[HITS] == 0
    finally:
        c.shutdown()
