"""Which engine holds which prefix, and which prefixes the shared store holds: fed only by KV events.

An engine's blocks are indexed by content: `(parent block hash, the block's tokens) -> block hash`, so
any engine that publishes vLLM's BlockStored (token_ids, parent_block_hash; vLLM itself, whatever its
hash function and seed, or kvstore-engine) is matched against a prompt's tokens without the router
knowing how it hashes. A store publishes chunk keys without tokens: the router computes a prompt's
chunk keys itself (kvstore.keys.chunk_keys) and counts the leading ones some tier of some store holds.
Thread-safe: the event thread applies batches while the request handlers look up.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _EngineBlocks:
    block_size: int = 0
    children: dict[tuple[Any, tuple[int, ...]], Any] = field(default_factory=dict)
    nodes: dict[Any, tuple[Any, tuple[int, ...]]] = field(default_factory=dict)


class PrefixIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engines: dict[str, _EngineBlocks] = {}
        self._store: dict[str, dict[str, set[bytes]]] = {}  # source -> medium -> chunk keys

    # ---- events -------------------------------------------------------------------------------
    def apply_engine(self, engine: str, events: Sequence[Any]) -> None:
        with self._lock:
            state = self._engines.setdefault(engine, _EngineBlocks())
            for e in events:
                kind = type(e).__name__
                if kind == "AllBlocksCleared":
                    self._engines[engine] = state = _EngineBlocks()
                elif kind == "BlockStored":
                    bs = e.block_size
                    if bs <= 0 or len(e.token_ids) < bs * len(e.block_hashes):
                        continue  # no tokens (not an engine's event): nothing to match prompts against
                    state.block_size = bs
                    parent = e.parent_block_hash
                    for i, h in enumerate(e.block_hashes):
                        tokens = tuple(e.token_ids[i * bs : (i + 1) * bs])
                        state.children[(parent, tokens)] = h
                        state.nodes[h] = (parent, tokens)
                        parent = h
                elif kind == "BlockRemoved":
                    for h in e.block_hashes:
                        node = state.nodes.pop(h, None)
                        if node is not None and state.children.get(node) == h:
                            del state.children[node]

    def apply_store(self, source: str, events: Sequence[Any]) -> None:
        with self._lock:
            media = self._store.setdefault(source, {})
            for e in events:
                kind = type(e).__name__
                if kind == "AllBlocksCleared":
                    media.clear()
                elif kind == "BlockStored":
                    media.setdefault(e.medium or "", set()).update(e.block_hashes)
                elif kind == "BlockRemoved":
                    media.setdefault(e.medium or "", set()).difference_update(e.block_hashes)

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

    def store_chunks(self, keys: Sequence[bytes]) -> int:
        """How many leading chunk `keys` some tier of some store holds."""
        with self._lock:
            sets = [s for media in self._store.values() for s in media.values()]
            n = 0
            while n < len(keys) and any(keys[n] in s for s in sets):
                n += 1
            return n

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "engines": {name: len(s.nodes) for name, s in self._engines.items()},
                "stores": {src: {m: len(k) for m, k in media.items()} for src, media in self._store.items()},
            }
