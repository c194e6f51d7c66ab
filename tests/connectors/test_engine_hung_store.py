"""A hung kvstore-server (SIGSTOP) costs the engine a bounded delay, never a stall: a running stream
keeps its pace while its save and the new requests' lookups hang, the new requests answer with the
same tokens by recompute, and after SIGCONT the store serves hits again."""

from __future__ import annotations

import os
import signal
import time

import pytest
from kvstore.engine import SamplingParams

from tests.connectors.engine_util import GREEDY, doc, generate, llm, store_metrics

pytestmark = pytest.mark.slow
HITS = "vllm:external_prefix_cache_hits_total"
STREAM = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def step_until(engine, done, gaps: list[float], stream_id: str, timeout: float = 300) -> None:
    """Step the engine until `done()`, appending the stream's inter-token gaps to `gaps`."""
    seq = engine.engine.requests.get(stream_id)
    last_n, last_t = (seq.num_output_tokens if seq else 0), time.monotonic()
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the engine stopped making progress"
        engine.engine.step()
        now = time.monotonic()
        n = seq.num_output_tokens if seq is not None else 0
        if n > last_n:
            if last_n > 0:  # the first token's wait is its TTFT, not a gap
                gaps.append(now - last_t)
            last_n, last_t = n, now


def test_sigstopped_store_never_stalls_a_running_stream(off, kv_server, monkeypatch) -> None:
    monkeypatch.setenv("KVSTORE_UNREACHABLE_BACKOFF_S", "1")
    stream_prompt = doc(240, 60)  # decoding crosses token 256: a chunk save starts during the hang
    known, fresh = doc(300, 61), doc(300, 62)  # in the store already / never stored
    want = generate(off, [known, fresh])
    (want_stream,) = [o.outputs[0].token_ids for o in off.generate([stream_prompt], STREAM)]
    # small steps, so that a gap measures the store and not a long prefill sharing the step
    engine = llm(kv_backend="kvstore", kv_store_url=kv_server.url, max_num_batched_tokens=64)
    pid = kv_server.proc.pid
    try:
        assert generate(engine, [known]) == want[:1]
        store_metrics(engine)  # its chunks are stored
        engine.engine.block_manager.reset_prefix_cache()  # only the store has them now

        stream = engine.engine.add_request(stream_prompt, STREAM, request_id="stream")
        gaps: list[float] = []
        step_until(engine, lambda: stream.num_output_tokens >= 5, gaps, "stream")
        os.kill(pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        step_until(engine, lambda: stream.num_computed_tokens > 256, gaps, "stream")  # a save hangs
        a = engine.engine.add_request(known, GREEDY, request_id="known")
        b = engine.engine.add_request(fresh, GREEDY, request_id="fresh")
        step_until(engine, lambda: a.is_finished and b.is_finished, gaps, "stream")
        hung_for = time.monotonic() - t_stop
        assert [a.output_token_ids, b.output_token_ids] == want, "recomputed, token for token"
        snap = engine.engine.scheduler.connector.metrics.snapshot()  # no flush: a save still hangs
        assert snap["kvstore_connector_chunk_misses_total{reason=unreachable}"] > 0
        step_until(engine, lambda: stream.is_finished, gaps, "stream")
        assert stream.output_token_ids == want_stream
        print(f"\nstore hung for {hung_for:.1f} s; stream's longest inter-token gap {max(gaps) * 1e3:.0f} ms")
        assert max(gaps) < 1.0, f"the stream stalled for {max(gaps):.1f} s"
    finally:
        os.kill(pid, signal.SIGCONT)
    try:
        time.sleep(1.5)  # the breaker's backoff
        engine.engine.block_manager.reset_prefix_cache()
        before = store_metrics(engine)[HITS]
        assert generate(engine, [known]) == want[:1]
        assert store_metrics(engine)[HITS] - before == 256, "the store is used again"
    finally:
        engine.shutdown()
