"""Every way a load can fail ends in a recompute from the first bad block, with the reason counted."""

from __future__ import annotations

import socket
import time

import torch

from kvstore.blob import encode_blob
from kvstore.protocol.arena_table import STALE_S
from tests.connectors.sim import HEAD_DIM, KV_HEADS, LAYERS, Req, make_config, prompt, truth_kv


def recompute_from_errors(engine, req: Req) -> int:
    """What the engine does with `get_block_ids_with_load_errors`: back to the first bad block."""
    bad = [i for i, b in enumerate(req.block_table) if b in engine.load_errors]
    assert bad, "expected a failed load"
    first = min(bad) * engine.bs
    assert bad == list(range(min(bad), min(bad) + len(bad))), "everything after the first bad block"
    req.num_computed_tokens = first
    engine.load_errors.clear()
    engine.step([(req, len(req.all_token_ids) - first)])
    return first


def kv_equal(engine, req: Req) -> bool:
    n = len(req.all_token_ids)
    return torch.equal(engine.read(req, 0, n), truth_kv(req.all_token_ids, 0, n, engine.dtype))


def test_corrupt_blob_on_disk_is_recomputed_from_its_chunk(engines, tmp_path) -> None:
    config = make_config(local_tiers=["disk"], local_disk_path=tmp_path / "disk", local_disk_capacity="1GiB")
    a, b = engines(config, seed=1), engines(config, seed=2)
    tokens = prompt(800, seed=1)
    a.prefill(Req("r1", tokens))
    a.worker.flush()
    key = a.scheduler.scheduler._keys["r1"].keys[1]
    (path,) = [p for p in (tmp_path / "disk").rglob(f"*{key}*") if p.is_file()]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))

    req = Req("r2", tokens)
    assert b.admit(req) == 768  # the lookup sees three chunks; it does not read them
    errors = b.step([(req, 800 - 768)])
    assert errors == set(req.block_table[16:48]), "chunk 1 and everything after it"
    assert torch.equal(b.read(req, 0, 256), truth_kv(tokens, 0, 256, b.dtype)), "chunk 0 loaded"
    assert recompute_from_errors(b, req) == 256
    assert kv_equal(b, req)
    snap = b.worker.metrics.snapshot()
    # the store verified the blob, deleted it and answered "missing, corrupt": the connector says so
    assert snap["kvstore_connector_chunk_misses_total{reason=corrupt}"] == 2
    assert snap["kvstore_connector_chunk_misses_total{reason=evicted}"] == 0
    assert snap["kvstore_connector_load_error_blocks_total"] == 32
    (disk,) = b.scheduler.handle.store.stats()["tiers"]
    assert disk["corrupt"] == 1, "the store's own metrics say why it vanished"


def test_valid_blob_of_the_wrong_shape_is_corrupt(engines) -> None:
    config = make_config(local_cpu_capacity="64MiB")
    a, b = engines(config, seed=1), engines(config, seed=2)
    tokens = prompt(600, seed=2)
    a.prefill(Req("r1", tokens))
    a.worker.flush()
    key0 = a.scheduler.scheduler._keys["r1"].keys[0]
    wrong = encode_blob(torch.zeros(2, LAYERS, 128, KV_HEADS, HEAD_DIM))  # a real blob, but half a chunk
    a.scheduler.handle.store.put(key0, wrong)
    req = Req("r2", tokens)
    assert b.admit(req) == 512
    assert b.step([(req, 600 - 512)]) == set(req.block_table[:32])
    assert recompute_from_errors(b, req) == 0
    assert kv_equal(b, req)
    assert b.worker.metrics.snapshot()["kvstore_connector_chunk_misses_total{reason=corrupt}"] == 2


def test_chunk_evicted_between_lookup_and_load(engines) -> None:
    config = make_config(local_cpu_capacity="64MiB")
    a, b = engines(config, seed=1), engines(config, seed=2)
    tokens = prompt(600, seed=3)
    a.prefill(Req("r1", tokens))
    a.worker.flush()
    req = Req("r2", tokens)
    assert b.admit(req) == 512
    assert a.scheduler.handle.store.delete(a.scheduler.scheduler._keys["r1"].keys[1])
    assert b.step([(req, 600 - 512)]) == set(req.block_table[16:32])
    assert recompute_from_errors(b, req) == 256
    assert kv_equal(b, req)
    assert b.worker.metrics.snapshot()["kvstore_connector_chunk_misses_total{reason=evicted}"] == 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_store_is_a_miss_and_is_skipped_for_a_while(engines) -> None:
    config = make_config(store_url=f"http://127.0.0.1:{free_port()}", unreachable_backoff_s=60, retries=0)
    eng = engines(config)
    req = Req("r1", prompt(600, seed=4))
    assert eng.prefill(req) == 0  # no exception reaches the engine
    assert kv_equal(eng, req)
    eng.worker.flush()
    snap = eng.worker.metrics.snapshot()
    assert snap["kvstore_connector_chunk_misses_total{reason=unreachable}"] == 2
    assert snap["kvstore_connector_dropped_saves_total{reason=store_error}"] == 2
    assert snap["kvstore_connector_lookup_seconds_count"] == 1
    assert eng.finish(req) is True
    assert eng.worker.get_finished({"r1"}) == ({"r1"}, None), "a failed save still finishes"
    req2 = Req("r2", prompt(600, seed=5))
    assert eng.prefill(req2) == 0
    snap = eng.worker.metrics.snapshot()
    assert snap["kvstore_connector_lookup_seconds_count"] == 1, "backing off: the store was not asked"
    assert snap["kvstore_connector_chunk_misses_total{reason=unreachable}"] == 4


def test_server_killed_between_lookup_and_load(engines, kv_server) -> None:
    config = make_config(store_url=kv_server.url, retries=0)
    a, b = engines(config, seed=1), engines(config, seed=2)
    tokens = prompt(600, seed=6)
    a.prefill(Req("r1", tokens))
    a.worker.flush()
    req = Req("r2", tokens)
    assert b.admit(req) == 512
    kv_server.kill()
    time.sleep(STALE_S + 0.1)  # until then the engine still reads the dead server's arena index (right)
    assert b.step([(req, 600 - 512)]) == set(req.block_table[:32])
    assert recompute_from_errors(b, req) == 0
    assert kv_equal(b, req)
    assert b.worker.metrics.snapshot()["kvstore_connector_chunk_misses_total{reason=unreachable}"] == 2


def test_chunk_overwritten_during_an_in_place_load_is_recomputed(engines, kv_server, monkeypatch) -> None:
    """A same-host server's chunks are scattered from its arena in place (no request, no copy); one the
    server lets go of meanwhile (its region may be reused) may be torn: its blocks are recomputed."""
    from kvstore.connectors.kv_worker import KVStoreWorker  # noqa: PLC0415

    config = make_config(store_url=kv_server.url)
    a, b = engines(config, seed=1), engines(config, seed=2)
    tokens = prompt(600, seed=7)
    a.prefill(Req("r1", tokens))
    a.worker.flush()
    victim = a.scheduler.scheduler._keys["r1"].keys[1]
    scatter = KVStoreWorker._load_chunk

    def racing(self, key, *args):  # the server drops chunk 1 right after it was scattered
        out = scatter(self, key, *args)
        if key == victim:
            assert a.scheduler.handle.store.delete(victim)
        return out

    monkeypatch.setattr(KVStoreWorker, "_load_chunk", racing)
    req = Req("r2", tokens)
    assert b.admit(req) == 512
    assert b.step([(req, 600 - 512)]) == set(req.block_table[16:32])
    assert b.worker.handle.store.backend.counts["in_place"] == 1
    assert torch.equal(b.read(req, 0, 256), truth_kv(tokens, 0, 256, b.dtype)), "chunk 0 loaded"
    assert recompute_from_errors(b, req) == 256
    assert kv_equal(b, req)
    assert b.worker.metrics.snapshot()["kvstore_connector_chunk_misses_total{reason=evicted}"] == 1
