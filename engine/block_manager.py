"""Paged KV blocks: allocation, reference counts and the prefix cache (vLLM V1's KVCacheManager).

A block is free when no sequence references it. Free blocks wait in an LRU queue and keep their
hash until they are handed out again, so a later request with the same prefix can revive them.
A full block's hash is `kvstore.keys.hash_block(parent_hash, its tokens)` chained from a root that
fingerprints the model and KV layout, so engine blocks and store chunks hash alike.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from kvstore.engine.sequence import Sequence

from kvstore.keys import hash_block

logger = logging.getLogger(__name__)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set once the block is full and registered in the prefix cache


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        root_hash: bytes = b"\0" * 16,
    ) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.root_hash = root_hash
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Front = evicted first. Blocks without a hash are put in front: they hold nothing reusable.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self._num_registered: dict[str, int] = {}  # request id -> leading blocks already examined
        self.prefix_cache_queries = 0  # tokens looked up (first scheduling of a request only)
        self.prefix_cache_hits = 0  # tokens found
        self.num_frees = 0  # calls of free() that returned blocks: the free count only grows through them
        # KV events (`--kv-events-config`): None = off; else what changed in the prefix cache since the
        # last `take_events`, as ("stored", hashes, parent hash or None, token ids) / ("removed", hashes)
        self.events: list[tuple] | None = None

    # ---- state --------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a sequence (vllm:kv_cache_usage_perc)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    # ---- prefix cache -------------------------------------------------------------------------
    def _extend_hashes(self, seq: Sequence, num_tokens: int) -> None:
        bs = self.block_size
        while len(seq.block_hashes) < num_tokens // bs:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if i else self.root_hash
            seq.block_hashes.append(hash_block(parent, seq.all_token_ids[i * bs : (i + 1) * bs]))

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """The longest run of leading full blocks of `seq` already in the cache. No side effects.

        The last token is never a hit: its logits are needed, so at least it is recomputed.
        """
        assert not seq.block_table, "computed blocks are looked up before the first allocation"
        if not self.enable_prefix_caching:
            return []
        max_hit_blocks = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, max_hit_blocks * self.block_size)
        hits = []
        for h in seq.block_hashes[:max_hit_blocks]:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def record_prefix_lookup(self, seq: Sequence, num_hit_tokens: int) -> None:
        # Recomputation after a preemption is not a query: counting it would inflate the hit rate.
        if self.enable_prefix_caching and seq.num_preemptions == 0:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that `seq.num_computed_tokens` has filled since the last call."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        start = self._num_registered.get(seq.request_id, 0)
        if num_full <= start:
            return
        self._extend_hashes(seq, num_full * self.block_size)
        stored: list[int] = []
        for i in range(start, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is not None:
                continue  # a prefix hit, already registered
            h = seq.block_hashes[i]
            if h not in self.cached:  # a twin computed concurrently keeps the entry; this one stays anonymous
                self.cached[h] = block.block_id
                block.block_hash = h
                stored.append(i)
        self._num_registered[seq.request_id] = num_full
        if self.events is not None and stored:
            self._stored_events(seq, stored)

    def _stored_events(self, seq: Sequence, indices: list[int]) -> None:
        """One "stored" event per run of consecutive newly registered blocks of `seq`."""
        bs, run = self.block_size, [indices[0]]
        for i in [*indices[1:], None]:
            if i is not None and i == run[-1] + 1:
                run.append(i)
                continue
            first, end = run[0], run[-1] + 1
            parent = seq.block_hashes[first - 1] if first else None
            tokens = list(seq.all_token_ids[first * bs : end * bs])
            self.events.append(("stored", seq.block_hashes[first:end], parent, tokens))
            if i is not None:
                run = [i]

    def take_events(self) -> list[tuple]:
        """The prefix-cache changes since the last call (empty when events are off)."""
        if not self.events:
            return []
        out, self.events = self.events, []
        return out

    # ---- allocation ---------------------------------------------------------------------------
    def _num_required(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int], reserve: int
    ) -> int | None:
        """New blocks `allocate_slots` would hand out, or None when they (with the revived cached
        blocks and the reserve) do not fit in the free ones."""
        total = seq.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        num_required = cdiv(total, self.block_size) - len(seq.block_table) - len(computed_blocks)
        num_revived = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        return None if num_required > self.num_free_blocks - num_revived - reserve else num_required

    def can_allocate(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] = (), reserve: int = 0
    ) -> bool:
        """Whether `allocate_slots` with these arguments would succeed (it changes nothing)."""
        return self._num_required(seq, num_new_tokens, computed_blocks, reserve) is not None

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] = (), reserve: int = 0
    ) -> bool:
        """Give `seq` blocks for `computed_blocks` plus `num_new_tokens` more tokens, or return False
        and change nothing. The caller advances `num_computed_tokens` over `computed_blocks`.
        `reserve`: free blocks that must remain afterwards."""
        num_required = self._num_required(seq, num_new_tokens, computed_blocks, reserve)
        if num_required is None:
            return False
        for block_id in computed_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        if computed_blocks:
            self._num_registered[seq.request_id] = len(seq.block_table)
        removed: list[bytes] = []
        for _ in range(max(num_required, 0)):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            assert block.ref_count == 0
            if block.block_hash is not None:  # evict its old content from the prefix cache
                if self.cached.get(block.block_hash) == block_id:
                    del self.cached[block.block_hash]
                    removed.append(block.block_hash)
                block.block_hash = None
            block.ref_count = 1
            seq.block_table.append(block_id)
        if self.events is not None and removed:
            self.events.append(("removed", removed))
        return True

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references. Tail blocks are queued first so they are evicted first."""
        if seq.block_table:
            self.num_frees += 1
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} ref count went negative"
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                if block.block_hash is None:
                    self.free_queue.move_to_end(block_id, last=False)
        seq.block_table = []
        self._num_registered.pop(seq.request_id, None)

    def reset_prefix_cache(self) -> None:
        for block_id in self.free_queue:
            self.blocks[block_id].block_hash = None
        kept = {h: b for h, b in self.cached.items() if self.blocks[b].ref_count > 0}
        if self.events is not None and len(kept) < len(self.cached):
            self.events.append(("removed", [h for h in self.cached if h not in kept]))
        self.cached = kept

    def check_invariants(self, live: list[Sequence]) -> None:
        """Assert the bookkeeping is consistent with the sequences holding blocks (tests, debugging)."""
        refs = [0] * self.num_blocks
        for seq in live:
            assert len(set(seq.block_table)) == len(seq.block_table), "a block twice in one table"
            for b in seq.block_table:
                refs[b] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], f"block {block.block_id} ref count drifted"
            assert (block.ref_count == 0) == (block.block_id in self.free_queue)
        for h, b in self.cached.items():
            assert self.blocks[b].block_hash == h
