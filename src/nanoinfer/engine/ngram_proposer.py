"""N-gram speculation (vLLM's `ngram` method, "prompt lookup decoding"): propose the tokens that followed the
latest earlier occurrence of a sequence's last n tokens, for the model to verify in one step.

A decode step reads every weight and every cached key and value of a sequence once, whatever the number of
tokens it computes for that sequence; when the proposal is right, the sequence gains several tokens for
one read. Greedy output is unchanged: the model's own greedy token is computed at every proposed position
and a proposal is kept only up to the first token that differs (scheduler.py).

Each sequence keeps an index from n-gram to the end of its latest occurrence, extended as tokens are
appended, so a proposal costs a few dict lookups instead of a scan of the whole sequence (a scan in Python
cost a large share of a decode step).
"""

from __future__ import annotations


class NgramIndex:
    """n-gram (a tuple of n token ids, min_n <= n <= max_n) -> the end of its latest occurrence that has a
    token after it, over one sequence's tokens. Occurrences ending at the last token are left out: the
    sequence's own tail would always match itself."""

    __slots__ = ("ends", "num_indexed", "lengths")

    def __init__(self, min_n: int, max_n: int):
        self.lengths = (min_n, max_n)
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.num_indexed = 0  # n-grams ending before this position are in `ends`

    def extend(self, token_ids: list[int]) -> None:
        """Index the n-grams that end before the last token (later occurrences replace earlier ones)."""
        last = len(token_ids) - 1
        for end in range(max(self.num_indexed, 1), last + 1):
            for n, ends in self.ends.items():
                if end >= n:
                    ends[tuple(token_ids[end - n : end])] = end
        self.num_indexed = max(self.num_indexed, last + 1)


class NgramProposer:
    """Proposes up to k tokens for a sequence, matching its last max_n..min_n tokens (longest first)."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, seq, max_tokens: int) -> list[int]:
        """Up to min(k, max_tokens) token ids to verify after `seq`'s last token; [] when nothing matches."""
        limit = min(self.k, max_tokens)
        if limit <= 0:
            return []
        token_ids = seq.token_ids
        index = seq.ngram_index
        if index is None or index.lengths != (self.min_n, self.max_n):
            index = seq.ngram_index = NgramIndex(self.min_n, self.max_n)
        index.extend(token_ids)
        size = len(token_ids)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            end = index.ends[n].get(tuple(token_ids[size - n :]))
            if end is not None:
                return token_ids[end : min(end + limit, size)]
        return []
