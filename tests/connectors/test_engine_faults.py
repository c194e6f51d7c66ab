"""A corrupt blob, and a store server killed between the lookup and the load, both end in a
recompute with output identical to the engine without the store."""

from __future__ import annotations

import pytest

from kvstore.keys import chunk_keys
from tests.connectors.conftest import ServerProcess
from tests.connectors.engine_util import doc, generate, llm, store_metrics

pytestmark = pytest.mark.slow


def test_corrupt_blob_then_killed_server_fall_back_to_recompute(off, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVSTORE_RETRIES", "0")  # KVTransferConfig's environment layer
    prompt = doc(530, 40)
    want = generate(off, [prompt])
    server = ServerProcess("--tiers", "disk", "--disk-path", str(tmp_path / "disk")).start()
    engine = llm(kv_backend="kvstore", kv_store_url=server.url)
    try:
        assert generate(engine, [prompt]) == want
        store_metrics(engine)  # waits for the saves
        layout = engine.engine.scheduler.connector.config.layout
        key = chunk_keys(prompt, layout)[1]
        (path,) = [p for p in (tmp_path / "disk").rglob(f"*{key}*") if p.is_file()]
        data = bytearray(path.read_bytes())
        data[-100] ^= 0x01  # one bit of chunk 1's payload
        path.write_bytes(bytes(data))

        engine.engine.block_manager.reset_prefix_cache()  # only the store can help now
        before = store_metrics(engine)
        assert generate(engine, [prompt]) == want
        after = store_metrics(engine)
        # chunk 1 (16 blocks) and the 16-token partial of chunk 2 stored after the first answer
        assert (
            after["kvstore_connector_load_error_blocks_total"]
            - before["kvstore_connector_load_error_blocks_total"]
            == 16 + 1
        )
        assert (
            after["vllm:external_prefix_cache_hits_total"] - before["vllm:external_prefix_cache_hits_total"]
            == 528
        )

        # the lookup succeeds, then the server dies before the load (a forward step or, with the
        # load in the background, a step that only starts it)
        engine.engine.block_manager.reset_prefix_cache()
        runner = engine.engine.runner
        originals = {name: getattr(runner, name) for name in ("execute_model", "execute_kv_transfers")}

        def kill_first(fn):
            def call(*args):
                server.kill()
                return fn(*args)

            return call

        for name, fn in originals.items():
            setattr(runner, name, kill_first(fn))
        before = store_metrics(engine)
        assert generate(engine, [prompt]) == want
        for name, fn in originals.items():
            setattr(runner, name, fn)
        after = store_metrics(engine)
        lost = "kvstore_connector_chunk_misses_total{reason=unreachable}"
        assert after[lost] > before[lost]
        assert (
            after["kvstore_connector_load_error_blocks_total"]
            > before["kvstore_connector_load_error_blocks_total"]
        )
    finally:
        engine.shutdown()
        server.stop()
