"""BlockManager as a hypothesis state machine: allocate (with prefix hits), extend, free, invariants after
every step.

Tokens come from a two-letter alphabet and blocks are 1-3 tokens, so prefixes repeat and hits are common.
Besides the manager's own bookkeeping, the machine models the KV cache's contents: a block holds the tokens
of the sequence that computed it, so a prefix hit must hand out blocks whose contents are the hitting
sequence's own prefix.
"""

from factories import make_seq
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from nanoinfer.engine.block_manager import BlockManager, hash_block

TOKENS = st.lists(st.sampled_from([0, 1]), min_size=1, max_size=12)


def chain_hash(prefix: tuple[int, ...], block_size: int) -> int | None:
    """The hash of the last full block of `prefix`, chained over all its blocks."""
    h = None
    for j in range(len(prefix) // block_size):
        h = hash_block(h, prefix[j * block_size : (j + 1) * block_size])
    return h


class BlockManagerMachine(RuleBasedStateMachine):
    # Sequences are picked by index into self.live (a no-op while it is empty) rather than from a Bundle,
    # so every rule is always enabled and hypothesis never gives up on a draw.

    @initialize(
        num_blocks=st.integers(1, 16),
        block_size=st.integers(1, 3),
        enable_prefix_caching=st.sampled_from([True, True, True, False]),
    )
    def setup(self, num_blocks, block_size, enable_prefix_caching):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.live = []  # the sequences holding block tables
        self.num_hit_blocks = {}  # seq_id -> leading blocks it got from the prefix cache (it did not write them)
        self.contents = {}  # block_id -> the token prefix (all tokens up to the block's end) computed into it

    # ---- helpers ---------------------------------------------------------------------------------------------
    def snapshot(self, seq):
        bm = self.bm
        return (
            list(bm.free_block_ids),
            [(b.ref_count, b.block_hash, b.token_ids) for b in bm.blocks],
            dict(bm.hash_to_block_id),
            bm.num_cache_hits,
            list(seq.block_table),
            seq.num_hashed_blocks,
            seq.num_computed_tokens,
        )

    def allocate_and_compute(self, seq, num_new, computed=()) -> bool:
        """allocate_slots, then (on success) the forward pass and cache_full_blocks, as a scheduler step does."""
        before = self.snapshot(seq)
        num_held = len(seq.block_table)
        if not self.bm.allocate_slots(seq, num_new, list(computed)):
            event("allocation failed")
            assert self.snapshot(seq) == before, "a failed allocation changed the block manager"
            return False
        for block_id in seq.block_table[num_held + len(computed) :]:
            self.contents.pop(block_id, None)  # a fresh block: whatever it held is overwritten
        seq.num_computed_tokens += len(computed) * self.bm.block_size + num_new
        bs = self.bm.block_size
        for j in range(self.num_hit_blocks[seq.seq_id], seq.num_computed_tokens // bs):
            self.contents[seq.block_table[j]] = tuple(seq.token_ids[: (j + 1) * bs])
        self.bm.cache_full_blocks(seq)
        return True

    # ---- rules ---------------------------------------------------------------------------------------------
    @rule(token_ids=TOKENS, chunk=st.integers(1, 12))
    def allocate(self, token_ids, chunk):
        seq = make_seq(token_ids)
        computed = self.bm.get_computed_blocks(seq.token_ids)
        assert len(computed) * self.bm.block_size < seq.num_tokens, "a hit covered the last token"
        if computed:
            event("prefix hit")
        num_cached = len(computed) * self.bm.block_size
        self.num_hit_blocks[seq.seq_id] = len(computed)
        if self.allocate_and_compute(seq, min(chunk, seq.num_tokens - num_cached), computed):
            self.live.append(seq)

    @rule(
        index=st.integers(0, 15),
        new_token_ids=st.lists(st.sampled_from([0, 1]), max_size=6),
        chunk=st.integers(1, 12),
    )
    def extend(self, index, new_token_ids, chunk):
        """More tokens (the rest of a prompt, or sampled ones), then compute a chunk of what is pending."""
        if not self.live:
            return
        seq = self.live[index % len(self.live)]
        seq.token_ids += new_token_ids
        num_pending = seq.num_tokens - seq.num_computed_tokens
        if num_pending:
            self.allocate_and_compute(seq, min(chunk, num_pending))

    @rule(index=st.integers(0, 15))
    def free(self, index):
        if not self.live:
            return
        seq = self.live[index % len(self.live)]
        self.bm.free(seq)
        self.live.remove(seq)
        assert seq.block_table == []

    # ---- invariants ------------------------------------------------------------------------------------------
    @invariant()
    def each_block_is_free_xor_owned(self):
        owned = {b for seq in self.live for b in seq.block_table}
        free = set(self.bm.free_block_ids)
        assert len(free) == len(self.bm.free_block_ids)
        assert not owned & free
        assert owned | free == set(range(self.bm.num_blocks))
        for seq in self.live:
            assert len(seq.block_table) == len(set(seq.block_table)), seq

    @invariant()
    def ref_count_is_the_number_of_live_tables_holding_the_block(self):
        for block in self.bm.blocks:
            assert block.ref_count == sum(block.block_id in seq.block_table for seq in self.live), block

    @invariant()
    def hash_table_matches_block_contents(self):
        bs = self.bm.block_size
        for block_hash, block_id in self.bm.hash_to_block_id.items():
            block = self.bm.blocks[block_id]
            assert block.block_hash == block_hash
            prefix = self.contents[block_id]
            assert block.token_ids == prefix[-bs:]
            assert (
                chain_hash(prefix, bs) == block_hash
            )  # the tokens, with their parent chain, rehash to the key
        for block in self.bm.blocks:
            if block.block_hash is not None:
                assert block.token_ids is not None and len(block.token_ids) == bs
                assert chain_hash(self.contents[block.block_id], bs) == block.block_hash

    @invariant()
    def every_computed_block_holds_its_sequences_prefix(self):
        # What prefix caching must never break: a hit block's KV is the hitting sequence's own prefix.
        bs = self.bm.block_size
        for seq in self.live:
            assert seq.num_computed_tokens <= seq.num_tokens
            assert len(seq.block_table) * bs >= seq.num_computed_tokens
            for j in range(seq.num_computed_tokens // bs):
                assert self.contents[seq.block_table[j]] == tuple(seq.token_ids[: (j + 1) * bs]), (seq, j)
            for j in range(seq.num_hashed_blocks):
                assert self.bm.blocks[seq.block_table[j]].block_hash == chain_hash(
                    tuple(seq.token_ids[: (j + 1) * bs]), bs
                )

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in self.live:
            self.bm.free(seq)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(block.ref_count == 0 for block in self.bm.blocks)


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
