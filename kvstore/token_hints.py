"""Token hints: the token ids of a chunk a put may carry, for the server's KV events only.

A kvstore-server sees chunk keys, never tokens, so its BlockStored events could carry no `token_ids`
and no `block_size`, and an indexer that keys its tree by a block's tokens (Dynamo's, llm-d's) indexed
none of them. The writer knows them (a connector puts the chunks of a request it has tokenised), so a
put may say, per key, the chunk's token ids and the key of the chunk before it in its sequence (None for
a sequence's first chunk): `token_ids` and `parents` of kvstore.protocol.ops.PutRequest, on both wires.
The server checks them before it stores anything (InvalidArgument, 400: one entry per key, parents
only with token ids, as many token ids as the chunk's blob holds), then keeps them in a bounded table
(`HintTable`) that its events read (kvstore.store_events): a BlockStored of a chunk with a hint carries
its tokens, `block_size` its token count and, as parent, the key before it.

Hints are for routing only: never part of a key, of a blob or of anything a get returns, and a server
that loses them (a restart, the table's bound) publishes the chunk's events as before, without tokens.
A writer that lies about them misleads indexers only (as a writer that publishes events could).
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

from kvstore.blob import verify_blob
from kvstore.errors import InvalidArgument


class Hint(NamedTuple):
    tokens: array  # the chunk's token ids ("I": 4 bytes each)
    parent: bytes | None  # the key of the chunk before it (raw bytes), None for a sequence's first


def checked_hints(
    keys: Sequence[str],
    blobs: Sequence[Any],
    token_ids: Sequence[Sequence[int] | None] | None,
    parents: Sequence[str | None] | None,
) -> dict[str, Hint]:
    """The hints of a put, each entry checked against its key and blob (read as
    kvstore.protocol.ops.token_lists and parent_keys check them first); InvalidArgument when they do not
    fit, CorruptBlob when a blob's header does not parse (the put would refuse it too)."""
    if token_ids is None:
        if parents is not None:
            raise InvalidArgument("parents are hints for token_ids: a put without token_ids takes none")
        return {}
    if len(token_ids) != len(keys):
        raise InvalidArgument(f"token_ids has {len(token_ids)} entries for {len(keys)} keys")
    if parents is not None and len(parents) != len(keys):
        raise InvalidArgument(f"parents has {len(parents)} entries for {len(keys)} keys")
    hints: dict[str, Hint] = {}
    for i, (key, blob, ids) in enumerate(zip(keys, blobs, token_ids, strict=True)):
        if ids is None:
            if parents is not None and parents[i] is not None:
                raise InvalidArgument(f"key {key} has a parent but no token_ids")
            continue
        held = verify_blob(blob, checksum=False).num_tokens  # the store verifies the whole blob later
        if len(ids) != held:
            raise InvalidArgument(f"key {key}: {len(ids)} token ids for a chunk of {held} tokens")
        parent = parents[i] if parents is not None else None
        hints[key] = Hint(array("I", ids), bytes.fromhex(parent) if parent is not None else None)
    return hints


def note_hints(
    store: Any,
    keys: Sequence[str],
    blobs: Sequence[Any],
    token_ids: Sequence[Sequence[int] | None] | None,
    parents: Sequence[str | None] | None,
) -> None:
    """Check a put's hints (`checked_hints`) and give them to the store's KV events, if it has any
    (kvstore.store_events.StoreEvents, the store's `metrics.events`): call it before the put."""
    if token_ids is None and parents is None:
        return
    hints = checked_hints(keys, blobs, token_ids, parents)
    give = getattr(store.metrics.events, "hint", None)
    if give is not None:
        give(hints)


class HintTable:
    """The latest hints, at most `max_tokens` token ids in all (the oldest go first): 4 bytes a token, so
    the default holds 32 MiB of them, 32768 chunks of 256 tokens."""

    def __init__(self, max_tokens: int = 1 << 23) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0  # token ids held
        self.dropped = 0  # hints dropped for room
        self._hints: OrderedDict[str, Hint] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, hints: dict[str, Hint]) -> None:
        with self._lock:
            for key, hint in hints.items():
                old = self._hints.pop(key, None)
                if old is not None:
                    self.tokens -= len(old.tokens)
                self._hints[key] = hint
                self.tokens += len(hint.tokens)
            while self.tokens > self.max_tokens and self._hints:
                _, old = self._hints.popitem(last=False)
                self.tokens -= len(old.tokens)
                self.dropped += 1

    def get(self, key: str) -> Hint | None:
        return self._hints.get(key)

    def __len__(self) -> int:
        return len(self._hints)
