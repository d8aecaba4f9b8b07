"""The token bitmask of a step's constrained rows: filled by each sequence's matcher, applied to the logits.

Filling runs on a helper thread while the forward pass runs (xgrammar releases the GIL), so the mask is
usually ready when the logits are.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

_fill_thread: ThreadPoolExecutor | None = None


def constrained_rows(seqs) -> list[int]:
    return [i for i, seq in enumerate(seqs) if seq.is_constrained]


def fill_grammar_bitmask(seqs, vocab_size: int) -> Future | None:
    """Start filling the bitmask of `seqs`' constrained rows; None when no row is constrained."""
    rows = constrained_rows(seqs)
    if not rows:
        return None
    global _fill_thread
    if _fill_thread is None:
        _fill_thread = ThreadPoolExecutor(1, thread_name_prefix="nanoinfer-bitmask")
    return _fill_thread.submit(_fill, *_matchers(seqs, rows), vocab_size)


def _matchers(seqs, rows: list[int]) -> tuple[list, list[int | None]]:
    """The rows' matchers, and a token each row allows beside its grammar's: a model's thinking may open at the first
    token (sequence.ReasoningState), else None."""
    matchers = [seqs[i].grammar for i in rows]
    reasoning = [seqs[i].reasoning for i in rows]
    return matchers, [r.tokens.start_id if r is not None and r.at_first_token else None for r in reasoning]


def _fill(matchers, extra: list[int | None], vocab_size: int) -> torch.Tensor:
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(matchers), vocab_size)
    for row, (matcher, token_id) in enumerate(zip(matchers, extra)):
        matcher.fill_next_token_bitmask(bitmask, row)
        if token_id is not None:  # bit token_id % 32 of word token_id // 32, in int32
            bit = 1 << (token_id % 32)
            bitmask[row, token_id // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit
    return bitmask


def apply_grammar_bitmask(logits: torch.Tensor, seqs, pending: Future | None) -> torch.Tensor:
    """Set the logits of tokens a row's grammar forbids to -inf (float32 logits, rows as in `seqs`)."""
    rows = constrained_rows(seqs)
    if not rows:
        return logits
    import xgrammar

    bitmask = pending.result() if pending is not None else _fill(*_matchers(seqs, rows), logits.shape[-1])
    index = torch.tensor(rows, device=logits.device)
    masked = logits.index_select(0, index)  # a copy: logits may be an inference tensor (tensor parallel)
    xgrammar.apply_token_bitmask_inplace(masked, bitmask.to(logits.device, non_blocking=True))
    return logits.index_copy(0, index, masked)
