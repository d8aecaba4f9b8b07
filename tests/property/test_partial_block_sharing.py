"""Prefix caching inside a block, as a hypothesis state machine: sequences are admitted with whole-block hits and
a shared partly filled block (taken, or copied through pending_copies), computed a chunk at a time, extended and
freed in any order.

The machine models the KV cache row by row: a row holds the tokens up to and including the position that computed
it (a key or value depends on all of them). What sharing must never break: every computed position of every live
sequence reads a row computed for exactly its own prefix. Blocks are 2-5 tokens over a two-letter alphabet, and
a share needs only one matching token here, so shares, copies and evictions of shared blocks are frequent.
"""

from factories import make_seq
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from nanoinfer.engine import block_manager as block_manager_module
from nanoinfer.engine.block_manager import BlockManager

TOKENS = st.lists(st.sampled_from([0, 1]), min_size=1, max_size=14)


class PartialSharingMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(2, 16), block_size=st.integers(2, 5))
    def setup(self, num_blocks, block_size):
        self.saved = block_manager_module.MIN_SHARED_TOKENS, block_manager_module.PARTIAL_CANDIDATES
        block_manager_module.MIN_SHARED_TOKENS, block_manager_module.PARTIAL_CANDIDATES = 1, 2
        self.bm = BlockManager(num_blocks, block_size)
        self.live = []
        self.rows = {b: [None] * block_size for b in range(num_blocks)}  # block -> the prefix each row was computed for

    def compute(self, seq, start: int, stop: int) -> None:
        """The forward pass: the step's copies first (as the runner makes them), then rows start..stop-1."""
        for source, destination, num_rows in self.bm.pending_copies:
            self.rows[destination][:num_rows] = self.rows[source][:num_rows]
        self.bm.pending_copies = []
        bs = self.bm.block_size
        for p in range(start, stop):
            self.rows[seq.block_table[p // bs]][p % bs] = tuple(seq.token_ids[: p + 1])
        seq.num_computed_tokens = stop
        self.bm.cache_full_blocks(seq)

    @rule(token_ids=TOKENS, chunk=st.integers(1, 14))
    def admit(self, token_ids, chunk):
        bm = self.bm
        seq = make_seq(token_ids)
        limit = seq.num_tokens - 1
        computed = bm.get_computed_blocks(seq.token_ids)
        share = bm.find_partial_share(seq.token_ids, computed, limit)
        num_cached = len(computed) * bm.block_size + (share.num_tokens if share else 0)
        assert num_cached <= limit, "a hit covered the last token"
        num_new = min(chunk, seq.num_tokens - num_cached)
        if not bm.allocate_slots(seq, num_new, computed, share):
            assert not bm.pending_copies, "a failed allocation left a copy behind"
            event("allocation failed")
            return
        if share is not None:
            event("copied" if bm.pending_copies else "taken")
        self.live.append(seq)
        self.compute(seq, num_cached, num_cached + num_new)

    @rule(index=st.integers(0, 15), new_token_ids=st.lists(st.sampled_from([0, 1]), max_size=6),
          chunk=st.integers(1, 12))  # fmt: skip
    def extend(self, index, new_token_ids, chunk):
        if not self.live:
            return
        seq = self.live[index % len(self.live)]
        seq.token_ids += new_token_ids
        num_new = min(chunk, seq.num_tokens - seq.num_computed_tokens)
        if num_new and self.bm.allocate_slots(seq, num_new):
            self.compute(seq, seq.num_computed_tokens, seq.num_computed_tokens + num_new)

    @rule(index=st.integers(0, 15))
    def free(self, index):
        if self.live:
            seq = self.live.pop(index % len(self.live))
            self.bm.free(seq)

    @invariant()
    def every_computed_position_reads_its_own_prefix(self):
        bs = self.bm.block_size
        for seq in self.live:
            for p in range(seq.num_computed_tokens):
                assert self.rows[seq.block_table[p // bs]][p % bs] == tuple(seq.token_ids[: p + 1]), (seq, p)

    @invariant()
    def a_findable_block_holds_what_its_entry_says(self):
        bm = self.bm
        for key, block_ids in bm.partial_blocks.items():
            assert 1 <= len(block_ids) <= block_manager_module.PARTIAL_CANDIDATES
            for block_id in block_ids:
                block = bm.blocks[block_id]
                assert key in block.partial_keys and key[1] == block.partial_tokens[: len(key[1])]
                prefix = self.rows[block_id][len(block.partial_tokens) - 1]
                assert prefix is not None and prefix[-len(block.partial_tokens):] == block.partial_tokens
                assert all(self.rows[block_id][r] == prefix[: len(prefix) - len(block.partial_tokens) + r + 1]
                           for r in range(len(block.partial_tokens)))  # fmt: skip

    @invariant()
    def blocks_are_free_or_held(self):
        held = [b for seq in self.live for b in seq.block_table]
        shared = {b for b in held if held.count(b) > 1}
        assert all(self.bm.blocks[b].block_hash is not None for b in shared), "only whole blocks are held twice"
        assert set(held) | set(self.bm.free_block_ids) == set(range(self.bm.num_blocks))
        assert not set(held) & set(self.bm.free_block_ids)

    def teardown(self):
        if hasattr(self, "saved"):
            block_manager_module.MIN_SHARED_TOKENS, block_manager_module.PARTIAL_CANDIDATES = self.saved


TestPartialSharingMachine = PartialSharingMachine.TestCase
TestPartialSharingMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
