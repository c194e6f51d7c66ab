"""What a request can load from the store: full chunks, then one partial chunk, in one round trip.

A finished request's last, partial chunk is stored under Spec 1's partial key
`H(parent ‖ "partial" ‖ n ‖ its n tokens)`, for a block-aligned n (the engine reuses whole blocks
only). A later, longer prompt finds it without a stored index: for every chunk position it could
stop at, it computes the partial keys its OWN tokens would have at each block-aligned length and
asks for them together with its full-chunk keys, in one `batch_exists`. So the "index by parent"
is the key function itself: nothing to keep in sync with the blobs, and a different tail can never
match (its tokens give another key).

The answer is the longest run of leading full chunks, then, at the first chunk that is not stored
in full, the longest stored partial of it. A partial is never taken where the full chunk is there.
Without partial candidates (partials off, or nothing they could add) the query is a plain `lookup`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.connectors.chunks import ChunkKeys


@dataclass(frozen=True)
class Partial:
    chunk: int  # chunk index it belongs to
    num_tokens: int  # tokens it holds, block-aligned, < chunk_size
    key: str


@dataclass(frozen=True)
class PrefixHit:
    full_chunks: int  # leading full chunks present, counted from chunk 0
    partial: Partial | None  # at chunk `full_chunks`, when one is stored
    chunk_size: int

    @property
    def num_tokens(self) -> int:
        return self.full_chunks * self.chunk_size + (self.partial.num_tokens if self.partial else 0)


@dataclass(frozen=True)
class PrefixQuery:
    """The keys to ask about (full chunks `first_chunk..`, then partial candidates) and how to read
    the answer."""

    first_chunk: int
    full_keys: tuple[str, ...]
    partials: tuple[Partial, ...]
    chunk_size: int
    # pipeline parallel: the keys each chunk is stored under (one per stage); a chunk is there when
    # every one of them is (None: the chunk key itself)
    expand: Callable[[str], list[str]] | None = None

    @property
    def keys(self) -> list[str]:
        return [*self.full_keys, *(p.key for p in self.partials)]

    def resolve(self, present: Sequence[bool]) -> PrefixHit:
        assert len(present) == len(self.full_keys) + len(self.partials)
        full = present[: len(self.full_keys)]
        run = full.index(False) if False in full else len(full)
        hit = self.first_chunk + run
        best = None
        for p, there in zip(self.partials, present[len(self.full_keys) :], strict=True):
            if there and p.chunk == hit and (best is None or p.num_tokens > best.num_tokens):
                best = p
        return PrefixHit(hit, best, self.chunk_size)

    def ask(self, store: Any) -> tuple[PrefixHit, str | None]:
        """Ask an `sdk.Store`: (what it has, its reason the next full chunk is missing, if one is).

        One round trip, hit or miss: `lookup` of the full chunks (the server says why the first missing
        one is missing: evicted, expired, ...: the miss metrics say it) that also asks whether each
        partial candidate is stored (`lookup_and_exists`)."""
        expand = self.expand or (lambda key: [key])
        n = len(expand(self.full_keys[0] if self.full_keys else self.partials[0].key))
        full = [k for key in self.full_keys for k in expand(key)]
        if not self.partials:
            found, reason = store.lookup(full)
            return PrefixHit(self.first_chunk + found // n, None, self.chunk_size), reason
        found, reason, there = store.lookup_and_exists(
            full, [k for p in self.partials for k in expand(p.key)]
        )
        found //= n  # chunks with every stage's keys there
        there = [all(there[i : i + n]) for i in range(0, len(there), n)]
        run = [True] * found + [False] * (len(self.full_keys) - found)  # what resolve reads of the full keys
        return self.resolve([*run, *there]), reason


def plan_prefix_query(
    keys: ChunkKeys,
    tokens: Sequence[int],
    num_computed: int,
    cap: int,
    block_size: int,
    partials: bool,
    expand: Callable[[str], list[str]] | None = None,
) -> PrefixQuery:
    """What to ask so that tokens `num_computed..cap` can come from the store.

    `keys` must be up to date with `tokens`; `num_computed` (chunks below it need no lookup) and
    `cap` (no token at or past it is loaded: the last prompt token is always recomputed) are
    block-aligned.
    """
    cs = keys.chunk_size
    assert num_computed % block_size == 0 and cap % block_size == 0 and cs % block_size == 0
    first = num_computed // cs
    positions = -(-cap // cs)  # chunk positions holding tokens below the cap
    full = tuple(keys.keys[first : min(len(keys.keys), positions)])
    cands: list[Partial] = []
    if partials:
        for c in range(first, min(positions, len(keys.keys) + 1)):
            # a stored partial's tokens must all be ours, and it must add tokens past num_computed
            longest = min(cs - block_size, (len(tokens) - c * cs) // block_size * block_size)
            lengths = [n for n in range(block_size, longest + 1, block_size) if c * cs + n > num_computed]
            cands += [
                Partial(c, n, k) for n, k in zip(lengths, keys.partial_keys(tokens, c, lengths), strict=True)
            ]
    return PrefixQuery(first, full, tuple(cands), cs, expand)
