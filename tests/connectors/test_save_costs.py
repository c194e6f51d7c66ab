"""What one connector save costs through a real kvstore-server on this host (shared memory): round
trips, counted by the server's own request counters, and copies of the chunk's bytes, counted where
this process makes them. A full chunk that supersedes three stored partials of itself is saved in two
round trips (EXISTS of the chunk and its partials; the PUT, which names the partials for the server
to delete once the chunk is stored) and two copies here (out of the paged cache; the blob laid out
in the shared-memory segment, once), then the server's one into its tier. A save with nothing new to
put (the chunk is stored already) deletes the partials in one DELETE: two round trips too."""

from __future__ import annotations

import tracemalloc

import torch
from kvstore.sdk.shm import ClientSegment

from kvstore.keys import chunk_keys, partial_key
from tests.connectors.sim import Req, make_config, prompt, truth_kv
from tests.connectors.test_lookup_round_trips import requests_served

CS = 256


class CopyCount:
    """Spies on the places this process copies a chunk's bytes during a save: the copy out of the
    paged cache (`gather`), the writes into the shared-memory segment (how many bytes, of blobs laid
    out before or laid out right there), and — by tracemalloc's peak — any buffer of a blob's size
    made on the way (the old path's joined blob)."""

    def __init__(self, monkeypatch, saver) -> None:
        self.gathers = 0
        self.shm_bytes = 0
        self.shm_writes = 0
        self.laid_out_before = 0  # blobs that reached the segment already in a buffer of their own
        gather, write = saver.paged.gather, ClientSegment.write

        def spy_gather(*args, **kwargs):
            self.gathers += 1
            return gather(*args, **kwargs)

        def spy_write(seg, offset, blobs):
            for b in blobs:
                self.shm_writes += 1
                if isinstance(b, (bytes, bytearray, memoryview)):
                    self.laid_out_before += 1
                    self.shm_bytes += memoryview(b).nbytes
                else:
                    self.shm_bytes += b.nbytes
            return write(seg, offset, blobs)

        monkeypatch.setattr(saver.paged, "gather", spy_gather)
        monkeypatch.setattr(ClientSegment, "write", spy_write)

    def __enter__(self) -> CopyCount:
        tracemalloc.start()
        tracemalloc.reset_peak()
        self._base = tracemalloc.get_traced_memory()[0]
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak = tracemalloc.get_traced_memory()[1] - self._base
        tracemalloc.stop()

    def copies(self) -> int:
        """Copies this process made of the chunk: out of the cache, into a buffer of the blob's own
        (where it was laid out before the segment), into the segment."""
        return self.gathers + self.laid_out_before + self.shm_writes


def test_a_save_that_supersedes_three_partials_is_two_round_trips_and_two_copies(
    engines, kv_server, monkeypatch
) -> None:
    config = make_config("float32", store_url=kv_server.url)  # 768 KiB chunks
    eng = engines(config)
    store, layout = eng.scheduler.handle.store, config.layout
    tokens = prompt(600, seed=31)
    req = Req("r", tokens)
    assert eng.admit(req) == 0
    eng.step([(req, CS)])  # chunk 0: the connection and its shared memory are set up
    eng.worker.flush()
    assert store.backend.transport == "shm"
    lengths = (32, 64, 128)
    partials = [partial_key(tokens[: CS + n], layout) for n in lengths]
    store.batch_put(
        [(k, truth_kv(tokens, CS, CS + n, torch.float32)) for k, n in zip(partials, lengths, strict=True)]
    )
    assert all(store.batch_exists(partials))
    chunk1 = chunk_keys(tokens[: 2 * CS], layout)[1]

    saver = eng.worker._worker.saver
    before = requests_served(kv_server.url)
    with CopyCount(monkeypatch, saver) as count:
        eng.step([(req, CS)])  # fills chunk 1: saved, and its three partials superseded
        eng.worker.flush()
    round_trips = requests_served(kv_server.url) - before

    truth = truth_kv(tokens, CS, 2 * CS, torch.float32)
    blob_size = len(store.get_blob(chunk1))  # 768 KiB of KV, its header
    assert blob_size > truth.numel() * truth.element_size()
    assert count.gathers == 1 and count.shm_bytes == blob_size, "one chunk, written into shm once"
    assert round_trips == 2, f"EXISTS and PUT only, got {round_trips} (one DELETE per partial?)"
    # a blob-sized buffer alone would reach blob_size; msgpack's packer takes 256 KiB for a moment
    # per call, which is what a path that lays nothing out peaks at
    assert count.laid_out_before == 0 and count.peak < blob_size, (
        f"the blob was laid out in a buffer of its own before shm (peak {count.peak} of {blob_size})"
    )
    assert count.copies() == 2  # out of the cache, into shm (the server's: one more)
    assert not any(store.batch_exists(partials)), "the partials were deleted"
    assert torch.equal(store.get(chunk1), truth), "bit-exact"
    snap = eng.worker.metrics.snapshot()
    assert snap["kvstore_connector_partial_chunks_total{event=replaced}"] == 3
    assert snap["kvstore_connector_saved_chunks_total"] == 2


def test_a_save_of_a_stored_chunk_deletes_its_partials_in_one_round_trip(engines, kv_server) -> None:
    """Nothing to put (another engine stored the chunk): EXISTS, then one DELETE of every partial."""
    config = make_config("float16", store_url=kv_server.url)
    eng = engines(config)
    store, layout = eng.scheduler.handle.store, config.layout
    tokens = prompt(600, seed=32)
    req = Req("r", tokens)
    assert eng.admit(req) == 0
    eng.step([(req, CS)])
    eng.worker.flush()
    partials = [partial_key(tokens[: CS + n], layout) for n in (16, 48, 160)]
    chunk1 = chunk_keys(tokens[: 2 * CS], layout)[1]
    store.batch_put(
        [(chunk1, truth_kv(tokens, CS, 2 * CS, torch.float16))]
        + [
            (k, truth_kv(tokens, CS, CS + n, torch.float16))
            for k, n in zip(partials, (16, 48, 160), strict=True)
        ]
    )
    before = requests_served(kv_server.url)
    eng.step([(req, CS)])
    eng.worker.flush()
    assert requests_served(kv_server.url) - before == 2
    assert store.batch_exists([chunk1, *partials]) == [True, False, False, False]
    snap = eng.worker.metrics.snapshot()
    assert snap["kvstore_connector_skipped_saves_total"] == 1
    assert snap["kvstore_connector_partial_chunks_total{event=replaced}"] == 3
