"""Obviously correct torch versions of the paged-cache operations: the oracle every fast path is tested
against. Slow on purpose (one sequence at a time, no fusion); never used on a hot path.

KV cache layout (all backends): k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

import torch

from nanoinfer.attention.metadata import AttentionMetadata


def store_kvcache_reference(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write key/value [num_tokens, H_kv, D] into their slots; slot -1 is skipped."""
    block_size = k_cache.shape[1]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = key[i]
        v_cache[slot // block_size, slot % block_size] = value[i]


def gather_sequence_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: list[int], seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [seq_len, H_kv, D] of one sequence, read block by block."""
    block_size = k_cache.shape[1]
    keys, values = [], []
    for pos in range(seq_len):
        block_id = block_table[pos // block_size]
        keys.append(k_cache[block_id, pos % block_size])
        values.append(v_cache[block_id, pos % block_size])
    return torch.stack(keys), torch.stack(values)


def paged_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of query [num_tokens, H_q, D] over each sequence's cached context.

    Query token j of a sequence with query_len q and seq_len s sits at position p = s - q + j and attends
    to positions 0..p, or with a sliding window W to p - W + 1..p. A soft cap c maps each score x (after the
    scale) to c * tanh(x / c). Attention sinks [H_q] (gpt-oss): one more logit per head in the softmax, with no
    value: out = sum_i e^(s_i) v_i / (sum_i e^(s_i) + e^(sink)). Grouped-query attention: query head h reads
    KV head h // (H_q // H_kv).
    """
    num_heads = query.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    starts = metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens.tolist()
    for i, seq_len in enumerate(seq_lens):
        q = query[starts[i] : starts[i + 1]].float()  # [q_len, H_q, D]
        q_len = q.shape[0]
        if q_len == 0:
            continue
        table = metadata.block_tables[i].tolist()
        k, v = gather_sequence_kv(k_cache, v_cache, table, seq_len)
        k = k.float().repeat_interleave(group, dim=1)  # [s, H_q, D]
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [H_q, q_len, s]
        if soft_cap is not None:
            scores = torch.tanh(scores / soft_cap) * soft_cap
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=query.device).unsqueeze(0)
        hidden = k_pos > q_pos
        if sliding_window is not None:
            hidden |= k_pos <= q_pos - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:  # a last column per head: its probability is dropped, its weight stays in the sum
            sink_column = sinks.float().view(num_heads, 1, 1).expand(num_heads, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[starts[i] : starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
