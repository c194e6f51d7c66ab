"""Token hints on a put (kvstore.token_hints), spoken byte by byte on both wires: the server checks them
before it stores anything (400, and nothing stored), never keeps them in the blob, and its KV events
carry them (token ids, block_size, the parent chain); a put without them publishes as before."""

from __future__ import annotations

import msgpack
import pytest

from kvstore.events import external_block_hash
from kvstore.protocol import dataplane as dp
from kvstore.protocol import wire
from tests.router.events_util import events, replay
from tests.server.conftest import key, make_blob, wait_for
from tests.server.test_dataplane import Raw

TOKENS = 16  # make_blob's chunks


def ids(seed: int, n: int = TOKENS) -> list[int]:
    return [seed * 1000 + i for i in range(n)]


def http_put(srv, keys: list[str], blobs: list[bytes], **hints) -> tuple[int, dict]:
    """A batch put whose frame header carries `hints` (HTTP names) beside keys and lens."""
    head = wire.frame_header(keys, [len(b) for b in blobs], more=hints)
    resp = srv.request("POST", wire.BATCH_PUT_PATH, head + b"".join(blobs))
    return resp.status, resp.json()


def plane_put(srv, keys: list[str], blobs: list[bytes], **hints) -> tuple[int, dict]:
    """The same on the data plane, its meta's names ("t", "tp")."""
    c = Raw(srv.port)
    try:
        head, meta, _ = c.call(dp.PUT, {"k": keys, "l": [len(b) for b in blobs], **hints}, b"".join(blobs))
        return head.status, meta
    finally:
        c.sock.close()


WIRES = {"http": (http_put, "token_ids", "parents"), "plane": (plane_put, "t", "tp")}
BAD = {
    "a token id too large": lambda: [ids(1)[:-1] + [2**31]],
    "a negative token id": lambda: [[-1] + ids(1)[1:]],
    "a float": lambda: [[1.5] + ids(1)[1:]],
    "a boolean": lambda: [[True] + ids(1)[1:]],
    "fewer than the chunk holds": lambda: [ids(1)[:-1]],
    "more than the chunk holds": lambda: [ids(1, TOKENS + 1)],
    "an empty list": lambda: [[]],
    "not a list": lambda: "0123",
    "two entries for one key": lambda: [ids(1), ids(2)],
    "over the bound": lambda: [list(range(65537))],
}


@pytest.mark.parametrize("wire_", sorted(WIRES))
@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_hint_is_refused_and_nothing_stored(server, wire_: str, case: str) -> None:
    put, t, _ = WIRES[wire_]
    status, body = put(server, [key(1)], [make_blob(1)], **{t: BAD[case]()})
    assert (status, body["type"]) == (400, "InvalidArgument"), body
    assert server.usage() == (0, 0)


@pytest.mark.parametrize("wire_", sorted(WIRES))
def test_parents_without_token_ids_or_for_a_chunk_without_them_are_refused(server, wire_: str) -> None:
    put, t, tp = WIRES[wire_]
    assert put(server, [key(1)], [make_blob(1)], **{tp: [key(0)]})[0] == 400
    both = {t: [ids(1), None], tp: [None, key(1)]}
    assert put(server, [key(1), key(2)], [make_blob(1), make_blob(2)], **both)[0] == 400
    assert put(server, [key(1)], [make_blob(1)], **{t: [ids(1)], tp: ["not a key"]})[0] == 400
    assert server.usage() == (0, 0)


@pytest.mark.parametrize("wire_", sorted(WIRES))
def test_a_good_hint_stores_the_blob_unchanged(server, wire_: str) -> None:
    put, t, tp = WIRES[wire_]
    blobs = [make_blob(1, key=key(1)), make_blob(2, key=key(2))]
    status, _ = put(server, [key(1), key(2)], blobs, **{t: [ids(1), None], tp: [None, None]})
    assert status == 201
    assert server.request("GET", wire.chunk_path(key(1))).body == blobs[0]
    assert server.request("GET", wire.chunk_path(key(2))).body == blobs[1]


@pytest.fixture
def with_events(server_factory, tmp_path):
    replay_at = f"ipc://{tmp_path}/replay"
    cfg = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/pub", "replay_endpoint": replay_at}
    srv = server_factory(kv_events_config=cfg)
    srv.replay = replay_at
    return srv


def _stored(srv, batches: int) -> list:
    publisher = srv.thread.server.kv_events.publisher
    wait_for(lambda: publisher.published >= batches)
    return [e for e in events(replay(srv.replay)) if type(e).__name__ == "BlockStored"]


@pytest.mark.parametrize("wire_", sorted(WIRES))
def test_the_events_carry_the_hints(with_events, wire_: str) -> None:
    """Three chunks of one sequence in one put: one BlockStored, a chain, with their 48 tokens; a fourth
    put later under the third: its parent is the third; a put without hints: as before."""
    put, t, tp = WIRES[wire_]
    keys = [key(i) for i in range(1, 6)]
    blobs = [make_blob(i) for i in range(1, 6)]
    assert (
        put(with_events, keys[:3], blobs[:3], **{t: [ids(1), ids(2), ids(3)], tp: [None, keys[0], keys[1]]})[
            0
        ]
        == 201
    )
    assert put(with_events, keys[3:4], blobs[3:4], **{t: [ids(4)], tp: [keys[2]]})[0] == 201
    assert put(with_events, keys[4:], blobs[4:])[0] == 201
    first, second, plain = _stored(with_events, 4)
    h = [external_block_hash(bytes.fromhex(k)) for k in keys]
    assert first.block_hashes == h[:3] and first.parent_block_hash is None
    assert first.token_ids == ids(1) + ids(2) + ids(3) and first.block_size == TOKENS
    assert second.block_hashes == [h[3]] and second.parent_block_hash == h[2]
    assert second.token_ids == ids(4) and second.block_size == TOKENS
    assert plain.block_hashes == [h[4]] and plain.token_ids == [] and plain.block_size == 0
    assert plain.parent_block_hash is None


def test_a_batch_of_unrelated_chunks_is_one_event_each(with_events) -> None:
    """Chunks that do not chain (two sequences' first chunks, a chunk under one not in the put) are
    separate events, each with its own parent; the chunks without hints one more."""
    keys = [key(i) for i in range(1, 6)]
    hints = {"t": [ids(1), ids(2), None, ids(4), None], "tp": [None, key(9), None, key(1), None]}
    assert plane_put(with_events, keys, [make_blob(i) for i in range(1, 6)], **hints)[0] == 201
    got = _stored(with_events, 2)
    h = {k: external_block_hash(bytes.fromhex(k)) for k in [*keys, key(9)]}
    assert [(e.block_hashes, e.parent_block_hash, e.block_size) for e in got] == [
        ([h[key(1)]], None, TOKENS),
        ([h[key(2)]], h[key(9)], TOKENS),
        ([h[key(4)]], h[key(1)], TOKENS),
        ([h[key(3)], h[key(5)]], None, 0),
    ]


def test_the_frame_header_keeps_what_it_does_not_know() -> None:
    """HTTP's batch put carries the request's other fields in its frame header (kvstore.protocol.ops)."""
    head = wire.frame_header([key(1)], [3], more={"token_ids": [[1, 2]], "keys": ["overridden"]})
    parsed = wire.parse_frame_header(head + b"abc")
    assert parsed.keys == [key(1)] and parsed.fields["token_ids"] == [[1, 2]]
    assert msgpack.unpackb(head[wire.PREAMBLE_SIZE :])["keys"] == [key(1)]
