"""BlockManager scenarios with exact block ids and free-queue order (vLLM test_prefix_caching.py's shape).

Block size 4 keeps the token lists readable (the manager takes any size; only the product config wants 256).
A test plays the scheduler's part by hand: allocate_slots, then advance num_computed_tokens (the forward
pass), then cache_full_blocks.
"""

import pytest
from factories import make_seq

from nanoinfer.engine import block_manager as block_manager_module
from nanoinfer.engine.block_manager import BlockManager, hash_block

BLOCK_SIZE = 4


def compute(bm: BlockManager, seq, num_new: int, computed=()) -> None:
    """What the scheduler does for one step: allocate, run the model (count tokens), cache full blocks."""
    assert bm.allocate_slots(seq, num_new, list(computed))
    seq.num_computed_tokens += len(computed) * bm.block_size + num_new
    bm.cache_full_blocks(seq)


def admit(bm: BlockManager, seq) -> list[int]:
    """Admit a new sequence with its prefix hits and compute its whole prompt; returns the hit block ids."""
    computed = bm.get_computed_blocks(seq.token_ids)
    compute(bm, seq, seq.num_tokens - len(computed) * bm.block_size, computed)
    return computed


def state(bm: BlockManager, *seqs):
    """Everything a failed allocation must leave alone."""
    return (
        list(bm.free_block_ids),
        [(b.ref_count, b.block_hash, b.token_ids) for b in bm.blocks],
        dict(bm.hash_to_block_id),
        bm.num_cache_hits,
        [(list(s.block_table), s.num_hashed_blocks, s.num_computed_tokens) for s in seqs],
    )


def test_allocation_hands_out_the_free_queue_head_first():
    bm = BlockManager(num_blocks=10, block_size=BLOCK_SIZE)
    a = make_seq(list(range(10)))  # 10 tokens: 2 full blocks + 2 tokens
    assert bm.allocate_slots(a, 10)
    # The free queue starts as 0..9 and is popped from the head.
    assert a.block_table == [0, 1, 2]
    assert list(bm.free_block_ids) == [3, 4, 5, 6, 7, 8, 9]
    assert [bm.blocks[i].ref_count for i in range(4)] == [1, 1, 1, 0]

    # Growing within the last block needs nothing; crossing into a new block takes the next head.
    a.num_computed_tokens = 10
    a.token_ids += [10, 11]
    assert bm.allocate_slots(a, 2)
    assert a.block_table == [0, 1, 2]
    a.num_computed_tokens = 12
    a.token_ids.append(12)
    assert bm.allocate_slots(a, 1)
    assert a.block_table == [0, 1, 2, 3]
    assert bm.num_free_blocks == 6


def test_full_computed_blocks_are_hashed_with_a_chain():
    bm = BlockManager(num_blocks=10, block_size=BLOCK_SIZE)
    a = make_seq(list(range(10)))
    admit(bm, a)
    # Only the two full blocks get hashes; block 1's hash chains block 0's.
    h0 = hash_block(None, (0, 1, 2, 3))
    h1 = hash_block(h0, (4, 5, 6, 7))
    assert bm.hash_to_block_id == {h0: 0, h1: 1}
    assert bm.blocks[0].token_ids == (0, 1, 2, 3) and bm.blocks[1].token_ids == (4, 5, 6, 7)
    assert bm.blocks[2].block_hash is None
    assert a.num_hashed_blocks == 2


def test_prefix_hit_shares_blocks_and_never_covers_the_last_token():
    bm = BlockManager(num_blocks=10, block_size=BLOCK_SIZE)
    a = make_seq(list(range(10)))
    admit(bm, a)  # blocks 0, 1 hashed; 2 partial

    # 8 equal tokens then a different one: both full blocks hit.
    assert bm.get_computed_blocks(list(range(8)) + [99]) == [0, 1]
    # Exactly the 8 cached tokens: the second block would cover the last token, whose logits we need.
    assert bm.get_computed_blocks(list(range(8))) == [0]
    # Exactly one block's worth: nothing may be reused at all.
    assert bm.get_computed_blocks([0, 1, 2, 3]) == []
    # A different first block breaks the chain even though block 1's tokens match.
    assert bm.get_computed_blocks([9, 1, 2, 3, 4, 5, 6, 7, 8]) == []

    b = make_seq(list(range(8)) + [99, 98])
    assert admit(bm, b) == [0, 1]
    # The hit blocks come first, then a fresh block from the queue head (3: 0..2 belong to a).
    assert b.block_table == [0, 1, 3]
    assert b.num_computed_tokens == 10
    assert [bm.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    assert bm.num_cache_hits == 2


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(num_blocks=10, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    a = make_seq(list(range(10)))
    admit(bm, a)
    assert bm.hash_to_block_id == {} and bm.blocks[0].block_hash is None
    assert bm.get_computed_blocks(list(range(10))) == []


def test_hash_collision_is_caught_by_the_token_check(monkeypatch):
    # Every block hashes alike: only the token check tells blocks apart.
    monkeypatch.setattr(block_manager_module, "hash_block", lambda parent_hash, token_ids: 42)
    bm = BlockManager(num_blocks=10, block_size=BLOCK_SIZE)
    a = make_seq([1, 2, 3, 4, 5])
    admit(bm, a)
    assert bm.hash_to_block_id == {42: 0}

    assert bm.get_computed_blocks([5, 6, 7, 8, 9]) == []  # same hash, other tokens: a miss
    assert bm.get_computed_blocks([1, 2, 3, 4, 9]) == [0]  # same hash, same tokens: a hit


def test_hash_collision_with_equal_tokens_after_a_different_prefix_is_a_miss(monkeypatch):
    # A chained hash that collides across parents: the hash ignores the parent. A block's KV depends on
    # every token before it, so [5,5,5,5] cached after [1,1,1,1] must not serve a prompt that starts
    # [2,2,2,2] even though the block's own tokens match.
    monkeypatch.setattr(
        block_manager_module, "hash_block", lambda parent_hash, token_ids: hash(tuple(token_ids))
    )
    bm = BlockManager(num_blocks=10, block_size=BLOCK_SIZE)
    admit(bm, make_seq([1, 1, 1, 1, 5, 5, 5, 5, 0]))  # blocks 0 [1111], 1 [5555 after 1111], 2 partial
    admit(bm, make_seq([2, 2, 2, 2, 7, 7, 7, 7, 0]))  # blocks 3 [2222], 4 [7777 after 2222], 5 partial

    # Block 3 is a true hit; block 1 holds [5,5,5,5] computed after [1,1,1,1], not after [2,2,2,2].
    assert bm.get_computed_blocks([2, 2, 2, 2, 5, 5, 5, 5, 0]) == [3]


def test_free_releases_the_tail_first_and_unhashed_blocks_go_to_the_head():
    bm = BlockManager(num_blocks=6, block_size=BLOCK_SIZE)
    a = make_seq(list(range(13)))  # blocks 0, 1, 2 full (hashed), 3 holds one token
    admit(bm, a)
    assert a.block_table == [0, 1, 2, 3] and list(bm.free_block_ids) == [4, 5]

    bm.free(a)
    # Freed last block first. Block 3 has no hash, nothing to lose: straight to the head. The hashed ones
    # go to the tail in the order 2, 1, 0, so the end of a prefix is evicted before its start (a block is
    # only reachable through the blocks before it).
    assert list(bm.free_block_ids) == [3, 4, 5, 2, 1, 0]
    assert a.block_table == [] and a.num_hashed_blocks == 0
    assert all(b.ref_count == 0 for b in bm.blocks)
    # The freed blocks keep their hashes: the whole prefix still hits.
    assert bm.get_computed_blocks(list(range(13))) == [0, 1, 2]

    # Four fresh blocks take 3, 4, 5 and then evict 2, the tail of a's prefix.
    b = make_seq(list(range(100, 116)))
    assert bm.allocate_slots(b, 16)
    assert b.block_table == [3, 4, 5, 2]
    assert list(bm.free_block_ids) == [1, 0]
    assert bm.get_computed_blocks(list(range(13))) == [0, 1]


def test_stale_hash_is_dropped_when_a_block_is_reused():
    bm = BlockManager(num_blocks=3, block_size=BLOCK_SIZE)
    a = make_seq([1, 2, 3, 4, 5])  # block 0 full (hashed), block 1 partial
    admit(bm, a)
    h0 = hash_block(None, (1, 2, 3, 4))
    bm.free(a)
    assert list(bm.free_block_ids) == [1, 2, 0]  # unhashed 1 to the head, hashed 0 to the tail
    assert bm.hash_to_block_id == {h0: 0}

    b = make_seq(list(range(100, 112)))  # needs all 3 blocks: block 0 is evicted and rewritten
    assert bm.allocate_slots(b, 12)
    assert b.block_table == [1, 2, 0]
    assert bm.hash_to_block_id == {}
    assert bm.blocks[0].block_hash is None and bm.blocks[0].token_ids is None
    assert bm.get_computed_blocks([1, 2, 3, 4, 5]) == []

    # Once b computes them, its own full blocks are registered instead.
    b.num_computed_tokens = 12
    bm.cache_full_blocks(b)
    assert sorted(bm.hash_to_block_id.values()) == [0, 1, 2]
    assert bm.get_computed_blocks(list(range(100, 112)) + [0]) == [1, 2, 0]


def test_ref_counts_follow_shared_prefixes_and_revived_blocks_leave_the_free_queue():
    bm = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    prefix = [1, 2, 3, 4, 5, 6, 7, 8]
    a = make_seq(prefix + [10])
    b = make_seq(prefix + [20, 21])
    c = make_seq(prefix[:4] + [30])
    admit(bm, a)  # [0, 1, 2]
    assert admit(bm, b) == [0, 1]
    assert admit(bm, c) == [0]
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1, 2], [0, 1, 3], [0, 4])
    assert [bm.blocks[i].ref_count for i in range(5)] == [3, 2, 1, 1, 1]

    bm.free(a)
    # Only a's private tail block is released; the shared prefix is still held by b and c.
    assert [bm.blocks[i].ref_count for i in range(5)] == [2, 1, 0, 1, 1]
    assert list(bm.free_block_ids) == [2, 5, 6, 7]
    bm.free(b)
    bm.free(c)
    # b released 3 (head, unhashed) then 1 (tail); c released 4 (head) then 0 (tail).
    assert list(bm.free_block_ids) == [4, 3, 2, 5, 6, 7, 1, 0]
    assert all(blk.ref_count == 0 for blk in bm.blocks)

    # A hit on blocks nobody holds revives them: out of the free queue, ref count 1.
    d = make_seq(prefix + [40])
    assert admit(bm, d) == [0, 1]
    assert d.block_table == [0, 1, 4]
    assert list(bm.free_block_ids) == [3, 2, 5, 6, 7]
    assert [bm.blocks[i].ref_count for i in (0, 1, 4)] == [1, 1, 1]


def test_failed_allocation_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = make_seq(list(range(9)))
    admit(bm, a)  # [0, 1, 2]: one block left
    before = state(bm, a)
    a.token_ids += list(range(9, 20))
    assert not bm.allocate_slots(a, 11)  # 20 tokens need 5 blocks, a holds 3, 1 is free
    assert state(bm, a) == before

    b = make_seq(list(range(100, 109)))
    before = state(bm, a, b)
    assert not bm.allocate_slots(b, 9)  # 3 blocks, 1 free
    assert state(bm, a, b) == before


def test_failed_allocation_with_hits_on_free_blocks_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = make_seq(list(range(9)))
    admit(bm, a)
    bm.free(a)  # free queue [2, 3, 1, 0]; 0 and 1 cached
    filler = make_seq(list(range(100, 108)))
    assert bm.allocate_slots(filler, 8)
    assert filler.block_table == [2, 3]

    # b hits 0 and 1 (both free) and needs 1 more block: 3 free-queue blocks in all, but only 2 exist.
    b = make_seq(list(range(8)) + [50, 51])
    computed = bm.get_computed_blocks(b.token_ids)
    assert computed == [0, 1]
    before = state(bm, filler, b)
    assert not bm.allocate_slots(b, 2, computed)
    assert state(bm, filler, b) == before
    assert list(bm.free_block_ids) == [1, 0]


@pytest.mark.parametrize("num_tokens, expected", [(1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_num_blocks_for_rounds_up(num_tokens, expected):
    assert BlockManager(num_blocks=1, block_size=BLOCK_SIZE).num_blocks_for(num_tokens) == expected


def test_state_slots_come_with_the_first_blocks_all_or_nothing_and_go_back_on_free():
    """A hybrid model's sequence takes one state slot with its first allocation; without a free slot nothing is
    allocated (blocks included), and free() returns the slot for the next sequence."""
    bm = BlockManager(num_blocks=8, block_size=4, num_state_slots=2)
    first, second, third = (make_seq(list(range(i, i + 6))) for i in (0, 10, 20))
    assert bm.allocate_slots(first, 6) and bm.allocate_slots(second, 6)
    assert (first.state_slot, second.state_slot) == (0, 1)
    free_blocks = bm.num_free_blocks
    assert not bm.allocate_slots(third, 6)
    assert third.state_slot == -1 and third.block_table == [] and bm.num_free_blocks == free_blocks
    assert bm.allocate_slots(first, 1)  # a running sequence keeps its slot: decode needs no new one
    assert first.state_slot == 0
    bm.free(first)
    assert first.state_slot == -1
    assert bm.allocate_slots(third, 6) and third.state_slot == 0
