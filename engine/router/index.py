"""Which engine holds which prefix, and which prefixes the shared store holds: fed only by KV events.

An engine's blocks are indexed by content: `(parent block hash, the block's tokens) -> block hash`, so
any engine that publishes vLLM's BlockStored (token_ids, parent_block_hash; vLLM itself, whatever its
hash function and seed, or kvstore-engine) is matched against a prompt's tokens without the router
knowing how it hashes. A store publishes chunk keys without tokens: the router computes a prompt's
chunk keys itself (kvstore.keys.chunk_keys) and counts the leading ones some tier of some store holds.
Every hash is compared in vLLM's 64-bit integer form (kvstore.events.external_block_hash: the low 64
bits, big-endian), whichever form a publisher sends (vLLM's and kvstore's default integers, or bytes)
and for the chunk keys the router computes, so both meet.

Bounded: at most `max_engine_blocks` blocks per engine and `max_store_keys` chunk keys per store; past
the cap the least recently stored go first (a block or key stored again moves to the back), counted in
`evicted` (a gauge and a counter per source in the router's /metrics: `kvstore_router_index_*`). An
index that forgets makes the router under-estimate a cache, never send a prompt where nothing is.
Thread-safe: the event thread applies batches while the request handlers look up.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.events import external_block_hash as _key

MAX_MEDIA = 16  # media per store source (a publisher naming more is not believed past them)


@dataclass
class _EngineBlocks:
    block_size: int = 0
    children: dict[tuple[Any, tuple[int, ...]], Any] = field(default_factory=dict)
    nodes: dict[Any, tuple[Any, tuple[int, ...]]] = field(default_factory=dict)  # oldest first
    evicted: int = 0


@dataclass
class _StoreKeys:
    keys: dict[Any, int] = field(default_factory=dict)  # chunk key -> bit mask of media; oldest first
    media: dict[str, int] = field(default_factory=dict)  # medium -> its bit
    evicted: int = 0

    count: dict[str, int] = field(default_factory=dict)  # medium -> keys it holds

    def drop(self, mask: int) -> None:
        for m, bit in self.media.items():
            if mask & bit:
                self.count[m] -= 1


class PrefixIndex:
    def __init__(self, max_engine_blocks: int = 262_144, max_store_keys: int = 1_048_576) -> None:
        self._lock = threading.Lock()
        self.max_engine_blocks = max_engine_blocks
        self.max_store_keys = max_store_keys
        self._engines: dict[str, _EngineBlocks] = {}
        self._store: dict[str, _StoreKeys] = {}

    # ---- events -------------------------------------------------------------------------------
    def apply_engine(self, engine: str, events: Sequence[Any]) -> None:
        with self._lock:
            state = self._engines.setdefault(engine, _EngineBlocks())
            for e in events:
                kind = type(e).__name__
                if kind == "AllBlocksCleared":
                    self._engines[engine] = state = _EngineBlocks(evicted=state.evicted)
                elif kind == "BlockStored":
                    bs = e.block_size
                    if bs <= 0 or len(e.token_ids) < bs * len(e.block_hashes):
                        continue  # no tokens (not an engine's event): nothing to match prompts against
                    state.block_size = bs
                    parent = None if e.parent_block_hash is None else _key(e.parent_block_hash)
                    for i, h in enumerate(map(_key, e.block_hashes)):
                        node = (parent, tuple(e.token_ids[i * bs : (i + 1) * bs]))
                        old = state.nodes.pop(h, None)
                        if old is not None and old != node and state.children.get(old) == h:
                            del state.children[old]  # the same hash for other content: the latest wins
                        state.children[node] = h
                        state.nodes[h] = node
                        parent = h
                    self._evict_blocks(state)
                elif kind == "BlockRemoved":
                    for h in map(_key, e.block_hashes):
                        node = state.nodes.pop(h, None)
                        if node is not None and state.children.get(node) == h:
                            del state.children[node]

    def _evict_blocks(self, state: _EngineBlocks) -> None:
        while len(state.nodes) > self.max_engine_blocks:
            h = next(iter(state.nodes))
            node = state.nodes.pop(h)
            if state.children.get(node) == h:
                del state.children[node]
            state.evicted += 1

    def apply_store(self, source: str, events: Sequence[Any]) -> None:
        with self._lock:
            state = self._store.setdefault(source, _StoreKeys())
            for e in events:
                kind = type(e).__name__
                if kind == "AllBlocksCleared":
                    self._store[source] = state = _StoreKeys(evicted=state.evicted)
                    continue
                if kind not in ("BlockStored", "BlockRemoved"):
                    continue
                medium = e.medium or ""
                bit = state.media.get(medium)
                if bit is None:
                    if len(state.media) >= MAX_MEDIA:
                        continue
                    bit = state.media[medium] = 1 << len(state.media)
                keys = state.keys
                if kind == "BlockStored":
                    for k in map(_key, e.block_hashes):
                        mask = keys.pop(k, 0)
                        if not mask & bit:
                            state.count[medium] = state.count.get(medium, 0) + 1
                        keys[k] = mask | bit
                    while len(keys) > self.max_store_keys:
                        state.drop(keys.pop(next(iter(keys))))
                        state.evicted += 1
                else:
                    for k in map(_key, e.block_hashes):
                        mask = keys.get(k)
                        if mask is not None and mask & bit:
                            state.count[medium] -= 1
                            if mask & ~bit:
                                keys[k] = mask & ~bit
                            else:
                                del keys[k]

    # ---- lookups ------------------------------------------------------------------------------
    def local_tokens(self, engine: str, tokens: Sequence[int]) -> int:
        """Leading tokens of `tokens` in `engine`'s prefix cache (whole blocks)."""
        with self._lock:
            state = self._engines.get(engine)
            if state is None or state.block_size <= 0:
                return 0
            bs, parent, n = state.block_size, None, 0
            while (n + 1) * bs <= len(tokens):
                h = state.children.get((parent, tuple(tokens[n * bs : (n + 1) * bs])))
                if h is None:
                    break
                parent, n = h, n + 1
            return n * bs

    def store_chunks(self, keys: Sequence[bytes | int]) -> int:
        """How many leading chunk `keys` (raw bytes, or vLLM's int form) some tier of some store holds."""
        keys = [_key(k) for k in keys]
        with self._lock:
            held = [s.keys for s in self._store.values()]
            n = 0
            while n < len(keys) and any(keys[n] in s for s in held):
                n += 1
            return n

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "engines": {name: len(s.nodes) for name, s in self._engines.items()},
                "stores": {src: dict(s.count) for src, s in self._store.items()},
            }

    def sizes(self) -> dict[str, tuple[int, int]]:
        """source -> (entries indexed, entries evicted by the cap so far): the /metrics gauges."""
        with self._lock:
            out = {name: (len(s.nodes), s.evicted) for name, s in self._engines.items()}
            out.update({src: (len(s.keys), s.evicted) for src, s in self._store.items()})
            return out
