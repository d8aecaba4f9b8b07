"""The paged KV cache's bookkeeping: free list, reference counts and the prefix-cache hash table.

Plain Python (no torch), so it is tested exhaustively on its own. A block's hash chains the hash of the
block before it with its own token ids (xxhash), so equal hashes mean equal prefixes; a hit is still
checked token by token. Freed blocks keep their hash and stay reusable until the free list hands them
out again, when the stale hash is dropped.

Part of a block is shared too (copy-on-write, as vLLM v0 forked sequences): a freed sequence leaves its blocks
findable by their parent and leading tokens, and a later prompt that matches a block's first rows but not all of
it takes the block (a partly filled one nobody holds) or a copy of those rows. So requests that share a context
of any length (the answers to one question, scored one after another) compute it once, not only its whole blocks.

A hybrid model (linear-attention layers) also needs one state slot a running sequence: allocate_slots gives one
with the sequence's first blocks (all or nothing, like the blocks) and free returns it.

NOTE: identical full blocks computed at the same time by two sequences are not de-duplicated, so that
block tables stay append-only (vLLM's block_pool.py makes the same choice).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import xxhash

# Part of a block is shared from this many leading tokens on: fewer cost about what the lookup saves. A freed block
# is found by its parent's hash and its leading tokens, MIN_SHARED_TOKENS at a time (a key for 16, 32, 48, ...
# tokens), so contexts that start alike still have keys of their own; at most PARTIAL_CANDIDATES blocks a key,
# newest first (requests sharing a context come one after another).
MIN_SHARED_TOKENS = 16
PARTIAL_CANDIDATES = 4


class PartialShare(NamedTuple):
    """A prefix hit inside a block: its first `num_tokens` rows hold what the new sequence needs there; `covers` says
    whether the new sequence's tokens also hold every token the block does (it may then take the block: what it
    writes there from num_tokens on is what the block held)."""

    block_id: int
    num_tokens: int
    covers: bool = False


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "parent_hash", "token_ids", "partial_keys", "partial_tokens")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self.parent_hash: int | None = None  # hash of the block before it, checked on a hit with token_ids
        self.token_ids: tuple[int, ...] | None = None  # the tokens behind block_hash, for the hit check
        # A block left by a freed sequence, findable by its leading rows: the tokens they hold, its index keys.
        self.partial_keys: list[tuple] = []
        self.partial_tokens: tuple[int, ...] | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, hash={self.block_hash})"


def root_hash(lora_int_id: int) -> int | None:
    """The parent hash of a sequence's first block: None for the base model, one of the adapter's own else (a
    prompt's blocks under an adapter hold other keys and values, so they must not match the base model's)."""
    if not lora_int_id:
        return None
    return xxhash.xxh64_intdigest(b"lora" + lora_int_id.to_bytes(8, "little", signed=False))


def hash_block(parent_hash: int | None, token_ids) -> int:
    h = xxhash.xxh64()
    h.update((parent_hash if parent_hash is not None else 0).to_bytes(8, "little", signed=False))
    h.update(b"\x01" if parent_hash is not None else b"\x00")
    for token_id in token_ids:
        h.update(int(token_id).to_bytes(4, "little", signed=False))
    return h.intdigest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, num_state_slots: int = 0):
        self.block_size = block_size
        self.num_state_slots = num_state_slots
        self.free_state_slots = list(range(num_state_slots - 1, -1, -1))  # pop() hands out the lowest first
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Eviction order: the head is handed out first. Blocks without a cached hash go to the head when
        # freed (nothing to lose), hashed ones to the tail (least recently used evicted first).
        self.free_block_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        self.partial_blocks: dict[tuple, list[int]] = {}  # (parent hash, leading tokens) -> block ids, newest last
        # Copies the coming step must make before its forward pass: (source block, destination block, rows).
        self.pending_copies: list[tuple[int, int, int]] = []
        self.num_cache_hits = 0  # prompt blocks served from the prefix cache, over the engine's life

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, token_ids: list[int], root: int | None = None) -> list[int]:
        """Block ids of the longest cached prefix of full blocks. Never covers the last token: its logits
        are still needed, so at least one token is always computed. root: the first block's parent hash (root_hash:
        the sequence's adapter)."""
        if not self.enable_prefix_caching:
            return []
        block_ids: list[int] = []
        parent = root
        for j in range((len(token_ids) - 1) // self.block_size):
            chunk = token_ids[j * self.block_size : (j + 1) * self.block_size]
            block_hash = hash_block(parent, chunk)
            block_id = self.hash_to_block_id.get(block_hash)
            if block_id is None:
                break
            block = self.blocks[block_id]
            # A hash collision must not serve another prefix's KV: check the tokens and the parent too.
            if block.token_ids != tuple(chunk) or block.parent_hash != parent or block_id in block_ids:
                break
            block_ids.append(block_id)
            parent = block_hash
        return block_ids

    def find_partial_share(self, token_ids: list[int], computed_block_ids: list[int], limit: int,
                           root: int | None = None) -> PartialShare | None:
        """After the whole-block hits `computed_block_ids`, the cached partly filled block whose leading rows match
        most of token_ids' next tokens (up to `limit` tokens in all), if MIN_SHARED_TOKENS or more match."""
        if not self.enable_prefix_caching:
            return None
        start = len(computed_block_ids) * self.block_size
        most = min(limit - start, self.block_size - 1)
        if most < MIN_SHARED_TOKENS:
            return None
        parent = self.blocks[computed_block_ids[-1]].block_hash if computed_block_ids else root
        wanted = tuple(token_ids[start : start + most])
        for n in range(most // MIN_SHARED_TOKENS * MIN_SHARED_TOKENS, 0, -MIN_SHARED_TOKENS):
            candidates = self.partial_blocks.get((parent, wanted[:n]))
            if candidates:  # the longest key found: every candidate shares its n tokens at least
                block_id, num_tokens = max(((b, _common_prefix(self.blocks[b].partial_tokens, wanted, n))
                                            for b in reversed(candidates)), key=lambda hit: hit[1])  # fmt: skip
                held = self.blocks[block_id].partial_tokens
                covers = tuple(token_ids[start : start + len(held)]) == held
                return PartialShare(block_id, num_tokens, covers)
        return None

    def allocate_slots(self, seq, num_new_tokens: int, computed_block_ids: list[int] = (),
                       share: PartialShare | None = None) -> bool:
        """Give `seq` the blocks to hold `num_new_tokens` more tokens (after any prefix-cache hits: whole blocks,
        then a partly filled one's leading rows). All or nothing: on False nothing changed."""
        num_shared = share.num_tokens if share is not None else 0
        num_tokens = seq.num_computed_tokens + len(computed_block_ids) * self.block_size + num_shared + num_new_tokens
        num_new_blocks = self.num_blocks_for(num_tokens) - len(seq.block_table) - len(computed_block_ids)
        needs_state_slot = self.num_state_slots > 0 and seq.state_slot < 0
        if needs_state_slot and not self.free_state_slots:
            return False
        if num_new_blocks <= 0 and not computed_block_ids and not needs_state_slot:
            return True  # most decode steps: the last block still has room
        # Hit blocks nobody holds sit in the free list: taking them uses up free capacity too.
        num_revived = sum(1 for b in computed_block_ids if self.blocks[b].ref_count == 0)
        if num_new_blocks + num_revived > self.num_free_blocks:
            return False
        if needs_state_slot:
            seq.state_slot = self.free_state_slots.pop()
        for block_id in computed_block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        if computed_block_ids:
            seq.num_hashed_blocks = len(seq.block_table)
            self.num_cache_hits += len(computed_block_ids)
        if share is not None:
            source = self.blocks[share.block_id]
            if source.ref_count == 0 and source.block_hash is None and share.covers:
                # Nobody holds it and the new owner's tokens hold all of its tokens: take it as it is. What the owner
                # writes there is what the rows held, so it stays a source for the others.
                del self.free_block_ids[source.block_id]
                source.ref_count = 1
                seq.block_table.append(source.block_id)
            else:
                # Copied: a block with a whole-block hash is never written into, and taking a block for part of its
                # rows would cut what it can give the prompts that share more of it.
                if source.ref_count == 0:
                    self.free_block_ids.move_to_end(source.block_id)  # the copy's block comes from elsewhere
                block_id = self._take_free_block()
                if block_id != source.block_id:  # else the source was the last free block: it is taken after all
                    self.pending_copies.append((source.block_id, block_id, share.num_tokens))
                seq.block_table.append(block_id)
            num_new_blocks -= 1
        for _ in range(max(num_new_blocks, 0)):
            seq.block_table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        """The free list's head, its stale cache entries dropped, held once."""
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.hash_to_block_id.get(block.block_hash) == block_id:
                del self.hash_to_block_id[block.block_hash]
            block.block_hash = block.parent_hash = block.token_ids = None
        if block.partial_tokens is not None:
            self._forget_partial(block)
        block.ref_count = 1
        return block_id

    def _forget_partial(self, block: Block) -> None:
        for key in block.partial_keys:
            self._unlist(key, block.block_id)
        block.partial_keys, block.partial_tokens = [], None

    def _unlist(self, key: tuple, block_id: int) -> None:
        candidates = self.partial_blocks[key]
        candidates.remove(block_id)
        if not candidates:
            del self.partial_blocks[key]

    def _remember_blocks(self, seq) -> None:
        """Leave a freed sequence's computed blocks findable by their leading tokens, for prompts that share only part
        of one (a whole block is also found by its hash, but only by a prompt holding all of its tokens)."""
        bs = self.block_size
        for j, block_id in enumerate(seq.block_table):
            filled = min(bs, seq.num_computed_tokens - j * bs)
            parent = self.blocks[seq.block_table[j - 1]].block_hash if j else seq.request.cache_root
            if filled < MIN_SHARED_TOKENS or (j and parent is None):
                return  # the blocks after it cannot be keyed by their parent either
            block = self.blocks[block_id]
            if block.ref_count:
                continue  # another sequence still holds it: the last to free it registers it
            if block.partial_tokens is not None:
                self._forget_partial(block)
            self._register_partial(block, parent, tuple(seq.token_ids[j * bs : j * bs + filled]))

    def _register_partial(self, block: Block, parent: int | None, tokens: tuple[int, ...]) -> None:
        """Make `block`, whose leading rows hold `tokens` after `parent`'s block, findable under a key every
        MIN_SHARED_TOKENS tokens, at most PARTIAL_CANDIDATES blocks a key."""
        # A block whose rows hold a prefix of another's serves nothing the other does not: keep the longer.
        first = self.partial_blocks.get((parent, tokens[:MIN_SHARED_TOKENS]), [])
        if any(self.blocks[other].partial_tokens[: len(tokens)] == tokens for other in first):
            return
        for other in [b for b in first if tokens[: len(self.blocks[b].partial_tokens)]
                      == self.blocks[b].partial_tokens]:  # fmt: skip
            self._forget_partial(self.blocks[other])
            self._hand_out_first_if_uncached(self.blocks[other])
        block.partial_tokens = tokens
        for n in range(MIN_SHARED_TOKENS, len(tokens) + 1, MIN_SHARED_TOKENS):
            key = (parent, tokens[:n])
            block.partial_keys.append(key)
            candidates = self.partial_blocks.setdefault(key, [])
            candidates.append(block.block_id)
            if len(candidates) > PARTIAL_CANDIDATES:  # the oldest stays findable by its longer keys
                oldest = self.blocks[candidates[0]]
                oldest.partial_keys.remove(key)
                self._unlist(key, oldest.block_id)
                if not oldest.partial_keys:
                    oldest.partial_tokens = None

    def _hand_out_first_if_uncached(self, block: Block) -> None:
        """A free block with nothing cached in it goes to the free list's head: handed out before cached ones."""
        if block.ref_count == 0 and block.block_hash is None and block.partial_tokens is None:
            self.free_block_ids.move_to_end(block.block_id, last=False)

    def cache_full_blocks(self, seq) -> None:
        """Register the sequence's newly completed (computed and full) blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_hashed_blocks:
            return  # most steps: no block filled up
        num_full = min(num_full, len(seq.block_table))
        for j in range(seq.num_hashed_blocks, num_full):
            parent = self.blocks[seq.block_table[j - 1]].block_hash if j > 0 else seq.request.cache_root
            chunk = tuple(seq.token_ids[j * self.block_size : (j + 1) * self.block_size])
            block = self.blocks[seq.block_table[j]]
            block.block_hash = hash_block(parent, chunk)
            block.parent_hash = parent
            block.token_ids = chunk
            self.hash_to_block_id.setdefault(block.block_hash, block.block_id)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, num_full)

    def free(self, seq) -> None:
        """Release the sequence's blocks, last block first, so a prefix outlives its tail in the cache."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        if self.enable_prefix_caching and seq.block_table:
            self._remember_blocks(seq)
        for block_id in reversed(seq.block_table):
            self._hand_out_first_if_uncached(self.blocks[block_id])
        seq.block_table = []
        seq.num_hashed_blocks = 0
        if seq.state_slot >= 0:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = -1


def _common_prefix(held: tuple[int, ...], wanted: tuple[int, ...], known: int) -> int:
    """How many leading tokens `held` and `wanted` share, knowing the first `known` are equal (slices compare in C)."""
    lo, hi = known, min(len(held), len(wanted))
    while lo < hi:  # the longest equal prefix is in [lo, hi]
        mid = (lo + hi + 1) // 2
        if held[:mid] == wanted[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
