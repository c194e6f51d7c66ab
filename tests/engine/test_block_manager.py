"""Block manager invariants: ref counts, the LRU free queue and the prefix cache."""

from __future__ import annotations

import random

import pytest
from kvstore.engine.block_manager import BlockManager
from kvstore.engine.sampling_params import SamplingParams
from kvstore.engine.sequence import Sequence

from kvstore.keys import KVLayout, hash_block, root_key

BS = 4


def make_seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=8))


def admit(bm: BlockManager, seq: Sequence) -> int:
    """Prefix lookup + allocation for the whole sequence, as the scheduler does it."""
    computed = bm.get_computed_blocks(seq)
    n = len(computed) * BS
    assert bm.allocate_slots(seq, seq.num_tokens - n, computed)
    bm.record_prefix_lookup(seq, n)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return n


def test_block_hashes_chain_from_the_layout_root() -> None:
    root = root_key(KVLayout("m", "h", 2, 1, 8, "float32", chunk_size=BS))
    bm = BlockManager(8, BS, root_hash=root)
    seq = make_seq("a", list(range(10)))
    admit(bm, seq)
    h0 = hash_block(root, [0, 1, 2, 3])
    assert seq.block_hashes[:2] == [h0, hash_block(h0, [4, 5, 6, 7])]
    assert bm.cached[h0] == seq.block_table[0]


def test_allocation_counts_and_free_returns_everything() -> None:
    bm = BlockManager(6, BS)
    seq = make_seq("a", list(range(9)))  # 9 tokens -> 3 blocks
    assert bm.allocate_slots(seq, 9)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 3
    assert bm.usage == pytest.approx(0.5)
    too_big = make_seq("b", list(range(100, 117)))  # 5 blocks > 3 free
    assert not bm.allocate_slots(too_big, 17)
    assert too_big.block_table == [] and bm.num_free_blocks == 3, "a failed allocation changes nothing"
    bm.check_invariants([seq])
    bm.free(seq)
    assert bm.num_free_blocks == 6 and seq.block_table == []
    bm.check_invariants([])


def test_prefix_hits_only_on_full_blocks_and_last_token_recomputed() -> None:
    bm = BlockManager(16, BS)
    first = make_seq("a", list(range(10)))  # blocks [0-3] [4-7] + partial [8,9]
    assert admit(bm, first) == 0
    second = make_seq("b", list(range(10)) + [50, 51])
    assert admit(bm, second) == 8, "two full blocks hit; the partial block never does"
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]
    # A prompt that is exactly the cached full blocks: its last block is recomputed for its logits.
    third = make_seq("c", list(range(8)))
    assert admit(bm, third) == 4
    assert bm.prefix_cache_queries == 10 + 12 + 8 and bm.prefix_cache_hits == 8 + 4
    bm.check_invariants([first, second, third])
    assert bm.blocks[first.block_table[0]].ref_count == 3


def test_freed_blocks_keep_their_hash_until_reused() -> None:
    bm = BlockManager(4, BS)
    a = make_seq("a", list(range(9)))
    admit(bm, a)
    bm.free(a)
    b = make_seq("b", list(range(9)))
    assert admit(bm, b) == 8, "freed blocks are revived from the free queue"
    bm.free(b)
    # Fill the whole cache with other content: the old hashes are evicted.
    c = make_seq("c", list(range(100, 116)))
    admit(bm, c)
    assert bm.num_free_blocks == 0
    bm.free(c)
    d = make_seq("d", list(range(9)))
    assert admit(bm, d) == 0
    bm.check_invariants([d])


def test_unhashed_blocks_are_reused_before_cached_ones() -> None:
    bm = BlockManager(4, BS)
    a = make_seq("a", list(range(6)))  # one full (hashed) block, one partial
    admit(bm, a)
    bm.free(a)
    b = make_seq("b", [99, 98])  # needs one block: takes the partial's block, not the cached one
    admit(bm, b)
    c = make_seq("c", list(range(6)))
    assert admit(bm, c) == 4


def test_revived_blocks_count_against_free_capacity() -> None:
    bm = BlockManager(3, BS)
    a = make_seq("a", list(range(9)))  # 3 blocks, 2 full + cached
    admit(bm, a)
    bm.free(a)
    b = make_seq("b", list(range(8)) + list(range(200, 206)))  # hits 2 blocks, needs 2 more -> 4 > 3
    computed = bm.get_computed_blocks(b)
    assert len(computed) == 2
    assert not bm.allocate_slots(b, b.num_tokens - 8, computed)
    assert bm.num_free_blocks == 3 and b.block_table == []
    bm.check_invariants([])


def test_random_workload_never_breaks_invariants() -> None:
    rng = random.Random(0)
    bm = BlockManager(24, BS)
    live: list[Sequence] = []
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    contents: dict[int, list[int]] = {}  # what each block holds, as the KV cache would
    for step in range(400):
        if live and (rng.random() < 0.4 or bm.num_free_blocks < 4):
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
        else:
            tokens = rng.choice(prefixes)[: rng.randrange(1, 13)] + [
                rng.randrange(50) for _ in range(rng.randrange(6))
            ]
            seq = make_seq(f"r{step}", tokens)
            computed = bm.get_computed_blocks(seq)
            assert len(computed) * BS <= seq.num_tokens - 1
            for i, b in enumerate(computed):
                assert contents[b] == seq.all_token_ids[i * BS : (i + 1) * BS], "a hit with other content"
            if bm.allocate_slots(seq, seq.num_tokens - len(computed) * BS, computed):
                bm.record_prefix_lookup(seq, len(computed) * BS)
                for i, b in enumerate(seq.block_table[len(computed) :], start=len(computed)):
                    contents[b] = seq.all_token_ids[i * BS : (i + 1) * BS]
                seq.num_computed_tokens = seq.num_tokens
                bm.cache_full_blocks(seq)
                live.append(seq)
            else:
                assert seq.block_table == []
        bm.check_invariants(live)
        assert all(b.ref_count >= 0 for b in bm.blocks)
    for seq in live:
        bm.free(seq)
    assert bm.num_free_blocks == 24 and bm.prefix_cache_hits > 0
    bm.check_invariants([])
