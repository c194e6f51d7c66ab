"""The trace reader: the public traces as the traces README counts them, bad lines named by number,
and chunk keys that follow block prefixes the way kvstore's keys follow token prefixes."""

from __future__ import annotations

import json

import pytest
from kvstore.fleet_sim.trace import ROOT, ChunkKeys, TraceError, TraceRequest, chunk_key, read_trace

from kvstore.keys import hash_block


def test_the_public_traces_parse(traces) -> None:
    conversation, synthetic = traces
    for path, requests, blocks in ((conversation, 12031, 288500), (synthetic, 3993, 121877)):
        trace = read_trace(path)
        assert len(trace) == requests
        assert sum(len(r.hash_ids) for r in trace) == blocks
        assert [r.index for r in trace[:3]] == [0, 1, 2]
        assert all(a.arrival_s <= b.arrival_s for a, b in zip(trace, trace[1:], strict=False))


GOOD = {"timestamp": 10, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ('{"timestamp": 10, "input_length": 600', "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "hash_ids"}), "missing hash_ids"),
        (json.dumps({**GOOD, "hash_ids": [1]}), "1 hash_ids for input_length 600"),
        (json.dumps({**GOOD, "hash_ids": [1, "2"]}), "hash_ids must be a list of ints"),
        (json.dumps({**GOOD, "timestamp": 5}), "before the previous line"),
        (json.dumps({**GOOD, "timestamp": -1}), "timestamp must be"),
        (json.dumps({**GOOD, "output_length": True}), "output_length must be an int"),
        (json.dumps({**GOOD, "input_length": 0, "hash_ids": []}), "input_length must be an int >= 1"),
    ],
)
def test_a_bad_line_is_an_error_naming_its_number(tmp_path, line: str, says: str) -> None:
    path = tmp_path / "t.jsonl"
    ok = json.dumps(GOOD)
    path.write_text(f"{ok}\n\n{ok}\n{line}\n{ok}\n")  # the blank line 2 counts, and is skipped
    with pytest.raises(TraceError) as e:
        read_trace(path)
    assert f"{path}:4:" in str(e.value) and says in str(e.value)


def test_blank_lines_and_limit(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n" + json.dumps(GOOD) + "\n\n" + json.dumps({**GOOD, "timestamp": 2000}) + "\n")
    trace = read_trace(path)
    assert [(r.index, r.arrival_s) for r in trace] == [(0, 0.01), (1, 2.0)]
    assert len(read_trace(path, limit=1)) == 1
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        read_trace(empty)


def _req(ids, n, **kw) -> TraceRequest:
    return TraceRequest(0, 0.0, n, 1, tuple(ids), **kw)


def test_chunk_keys_follow_block_prefixes() -> None:
    keys = ChunkKeys()
    a = keys.of(_req([7, 8, 9], 1300))  # 512 + 512 + 276 tokens: chunks 256 x 5 + a partial one
    b = keys.of(_req([7, 8, 10], 1536))
    c = keys.of(_req([5, 8, 9], 1300))
    assert len(a) == 6 and len(b) == 6
    assert a[:4] == b[:4] and a[4] != b[4]
    assert not set(a) & set(c)  # block 8 after another first block is another prefix
    assert len(set(a)) == 6
    # the keys are kvstore's chain: hash_block(parent, the chunk's int32 "tokens")
    assert a[0] == chunk_key(ROOT, 7, 0) == hash_block(ROOT, [0, 7, 0])
    assert a[1] == hash_block(a[0], [0, 7, 1])
    assert keys.of(_req([2**40], 10))[0] == hash_block(ROOT, [2**40 >> 31, 2**40 & 0x7FFFFFFF, 0])
    # a scaled replay: 32-token blocks and chunks, one chunk per block; a salt keeps replays apart
    s = keys.of(_req([7, 8], 64, block_tokens=32, chunk_size=32))
    assert s == [hash_block(ROOT, [0, 7, 0]), hash_block(hash_block(ROOT, [0, 7, 0]), [0, 8, 0])]
    assert not set(keys.of(_req([7, 8], 64, block_tokens=32, chunk_size=32), salt="ttft")) & set(s)


def test_any_slice_of_a_public_trace_reads(tmp_path, traces) -> None:
    """Timestamps are compared as written: 2051999 / 1000 * 1000 is 2051999.0000000002, which the
    reader once took for the next line's (equal) timestamp going back in time (issue 46 item 6)."""
    conversation, _ = traces
    lines = conversation.read_text().splitlines()
    for start in (0, 3000, 6570, 9000):
        path = tmp_path / f"slice{start}.jsonl"
        path.write_text("\n".join(lines[start : start + 1500]) + "\n")
        trace = read_trace(path)
        assert len(trace) == min(1500, len(lines) - start)
        assert trace[0].arrival_s == json.loads(lines[start])["timestamp"] / 1000
    path = tmp_path / "equal.jsonl"
    path.write_text(
        "\n".join(json.dumps({**GOOD, "timestamp": t}) for t in (260999, 260999, 2051999, 2051999))
    )
    assert [r.arrival_s for r in read_trace(path)] == [260.999, 260.999, 2051.999, 2051.999]
