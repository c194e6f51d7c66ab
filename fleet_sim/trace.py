"""Mooncake traces (`../shared/traces/*.jsonl`) and their blocks as kvstore chunk keys.

One JSON object a line: `timestamp` (ms from the trace start, sorted), `input_length`, `output_length`
(tokens) and `hash_ids`, one id per 512-token block of the prompt, `len(hash_ids) == ceil(input_length
/ 512)`. Equal ids at the same positions are the same prefix.

A trace block covers TRACE_BLOCK tokens; kvstore cuts prompts into CHUNK-token chunks (docs/design.md §1),
so block j is chunks 2j and 2j+1 (only those the prompt reaches; a scaled replay such as
benchmarks/bench_router.py's may give a request other block and chunk sizes). A chunk's key is chained
like kvstore's, `key_i = kvstore.keys.hash_block(key_{i-1}, chunk i's tokens)`, where the tokens stand in
as (block id, which part of the block): equal block prefixes give equal chunk keys, as equal token
prefixes do. A trailing partial chunk keeps the full chunk's key: the trace says nothing finer.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import InvalidArgument
from kvstore.keys import DIGEST_SIZE

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"  # the public Mooncake traces
TRACE_BLOCK = 512
CHUNK = 256
ROOT = b"fleet-sim/trace\0"  # any 16 bytes: a simulated fleet has one model and layout


class TraceError(InvalidArgument):
    """A trace line that is not a request; names the file and the 1-based line number."""


@dataclass(frozen=True)
class TraceRequest:
    index: int  # 0-based position in the trace
    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]
    block_tokens: int = TRACE_BLOCK  # tokens of one hash id
    chunk_size: int = CHUNK  # tokens of one store chunk (divides block_tokens)

    @property
    def chunks_per_block(self) -> int:
        return self.block_tokens // self.chunk_size

    @property
    def num_chunks(self) -> int:
        return math.ceil(self.input_tokens / self.chunk_size)

    def chunk_tokens(self, i: int) -> int:
        """Prompt tokens in chunk `i` (chunk_size except for a trailing partial chunk)."""
        return min(self.chunk_size, self.input_tokens - i * self.chunk_size)


def _check(obj: object, where: str, previous_ms: int | float) -> TraceRequest:
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in obj]
    if missing:
        raise TraceError(f"{where}: missing {', '.join(missing)}")
    ts, n_in, n_out, ids = obj["timestamp"], obj["input_length"], obj["output_length"], obj["hash_ids"]

    def integer(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not (integer(ts) or isinstance(ts, float)) or not math.isfinite(ts) or ts < 0:
        raise TraceError(f"{where}: timestamp must be a finite number of ms >= 0, got {ts!r}")
    if ts < previous_ms:
        raise TraceError(f"{where}: timestamp {ts} is before the previous line's {previous_ms}")
    if not integer(n_in) or n_in < 1:
        raise TraceError(f"{where}: input_length must be an int >= 1, got {n_in!r}")
    if not integer(n_out) or n_out < 1:
        raise TraceError(f"{where}: output_length must be an int >= 1, got {n_out!r}")
    if not isinstance(ids, list) or not all(integer(h) for h in ids):
        raise TraceError(f"{where}: hash_ids must be a list of ints")
    if len(ids) != math.ceil(n_in / TRACE_BLOCK):
        raise TraceError(
            f"{where}: {len(ids)} hash_ids for input_length {n_in} "
            f"(expected ceil({n_in}/{TRACE_BLOCK}) = {math.ceil(n_in / TRACE_BLOCK)})"
        )
    return TraceRequest(-1, ts / 1000.0, n_in, n_out, tuple(ids))


def iter_trace(path: Path | str) -> Iterator[TraceRequest]:
    """The requests of `path`, any slice of a trace: its timestamps need not start at 0, and each line's
    is compared with the previous line's as written (integer milliseconds as integers: ts / 1000 * 1000
    is not always ts)."""
    path = Path(path)
    previous: int | float = 0
    index = 0
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise TraceError(f"{where}: not JSON ({e})") from None
            r = _check(obj, where, previous)
            previous = obj["timestamp"]
            yield TraceRequest(index, r.arrival_s, r.input_tokens, r.output_tokens, r.hash_ids)
            index += 1


def read_trace(path: Path | str, limit: int | None = None) -> list[TraceRequest]:
    """The trace's requests in order (the first `limit`); TraceError on the first bad line."""
    out: list[TraceRequest] = []
    for r in iter_trace(path):
        if limit is not None and len(out) >= limit:
            break
        out.append(r)
    if not out:
        raise TraceError(f"{path}: no requests")
    return out


def chunk_key(parent: bytes, block_id: int, part: int) -> bytes:
    """kvstore.keys.hash_block(parent, [block_id >> 31, block_id & 0x7FFFFFFF, part]), without numpy."""
    tokens = struct.pack("<3i", block_id >> 31, block_id & 0x7FFFFFFF, part)
    return hashlib.blake2b(parent + tokens, digest_size=DIGEST_SIZE).digest()


class ChunkKeys:
    """Chunk keys of trace requests, memoised by block prefix (a trace repeats prefixes a lot).
    Requests with different `salt`s never share keys (a replay that keeps policies apart)."""

    def __init__(self) -> None:
        self._memo: dict[tuple[bytes, int, int], tuple[bytes, ...]] = {}

    def of(self, request: TraceRequest, salt: str = "") -> list[bytes]:
        keys: list[bytes] = []
        per_block = request.chunks_per_block
        parent = hashlib.blake2b(ROOT + salt.encode(), digest_size=DIGEST_SIZE).digest() if salt else ROOT
        for j, block_id in enumerate(request.hash_ids):
            parts = self._memo.get((parent, block_id, per_block))
            if parts is None:
                chain = [parent]
                for part in range(per_block):
                    chain.append(chunk_key(chain[-1], block_id, part))
                parts = tuple(chain[1:])
                self._memo[(parent, block_id, per_block)] = parts
            n = min(per_block, request.num_chunks - j * per_block)
            if n <= 0:
                break
            keys.extend(parts[:n])
            parent = parts[-1]
        return keys
