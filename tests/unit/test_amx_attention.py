"""The AMX attention paths for bfloat16 queries over a bfloat16 cache, on a CPU with AMX, against float64:
- decode's key pass (csrc/paged_attention.cpp, attend_amx), over the tile edge cases: sequences shorter than a
  tile, partial tiles, block sizes under 16 (tiles that cross blocks go through a padded copy), head groupings
  that fill the 16 query columns differently, and a grouping too wide for them (the AVX-512 path takes it);
- prefill (csrc/prefill_attention.cpp, attend_amx): fresh prompts and chunks over a cached prefix, lengths
  around the 16-row, 32-key and 64-key tile edges, head sizes of one to eight 32-dim chunks."""

from __future__ import annotations

import pytest
import torch

from nanoinfer.attention.reference import paged_attention_reference
from nanoinfer.platforms.cpu.ops import cpu_ops

pytestmark = pytest.mark.skipif(cpu_ops() is None or not cpu_ops().amx_available(), reason="no AMX on this CPU")


def _decode_batch(seq_lens, num_heads, num_kv_heads, head_dim, block_size, seed=0, shuffle=True):
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 2
    order = torch.randperm(num_blocks, generator=gen) if shuffle else torch.arange(num_blocks)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[used: used + n]
        used += n
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).bfloat16()
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).bfloat16()
    return query, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32)


def _reference(query, k_cache, v_cache, tables, seq_lens, scale):
    """float64 attention over the same bfloat16 values, one sequence at a time."""
    out = []
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    group = query.shape[1] // hkv
    for b, n in enumerate(seq_lens.tolist()):
        slots = [int(tables[b, t // bs]) * bs + t % bs for t in range(n)]
        k = k_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = v_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        p = torch.softmax(torch.einsum("hd,thd->ht", query[b].double(), k) * scale, dim=-1)
        out.append(torch.einsum("ht,thd->hd", p, v))
    return torch.stack(out)


# Lengths: under a tile, one tile, one past, a pair of tiles and one past, long. Heads (Hq, Hkv): SmolLM2's
# 9 / 3 (three KV heads share one tile's columns), one KV head per query head (16 heads in one group, then a
# second group), 16 query heads on one KV head (a full tile), and 24 on one (over 16: the AVX-512 path).
@pytest.mark.parametrize("block_size", [4, 16, 256])
@pytest.mark.parametrize("heads", [(9, 3), (20, 20), (16, 1), (12, 2), (24, 1)])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
def test_amx_decode_attention_matches_float64_reference(block_size, heads, head_dim):
    seq_lens = [1, 15, 16, 17, 32, 33, 300]
    query, k_cache, v_cache, tables, lens = _decode_batch(seq_lens, *heads, head_dim, block_size, seed=head_dim)
    scale = head_dim**-0.5
    got = cpu_ops().paged_decode(query, k_cache, v_cache, tables, lens, scale, 0, 0.0)
    expected = _reference(query, k_cache, v_cache, tables, lens, scale)
    assert got.dtype == torch.bfloat16 and got.shape == query.shape
    # bfloat16 output (a relative step of 2^-8) and float32 sums in another order: a step or two, no more.
    torch.testing.assert_close(got.double(), expected, rtol=2**-7, atol=2e-3)


# (9, 3): one row's three query heads a KV head, five KV heads' columns to a tile (each live column built on its
# own); (36, 3): a run of four rows as one, twelve columns of one KV head (all sixteen built at once).
@pytest.mark.parametrize("heads", [(9, 3), (36, 3), (16, 1)])
def test_amx_decode_value_pass_keeps_float32_accuracy(heads):
    """The value pass takes the probabilities as two bfloat16 parts (~16 bits): nearly every output is the
    float64 result correctly rounded to bfloat16; with one rounding of p a third of them missed (prefill)."""
    seq_lens = [1, 31, 32, 33, 150, 300, 257]
    query, k_cache, v_cache, tables, lens = _decode_batch(seq_lens, *heads, 64, 16, seed=7)
    got = cpu_ops().paged_decode(query, k_cache, v_cache, tables, lens, 0.125, 0, 0.0)
    expected = _reference(query, k_cache, v_cache, tables, lens, 0.125)
    assert (got.double() == expected.bfloat16().double()).float().mean() > 0.99


def test_tiles_read_in_place_and_through_the_padded_copy_give_the_same_bits():
    """A tile of 16 tokens is read in place when its rows are evenly spaced; the same tokens in blocks of 4
    laid out in order are evenly spaced too, and shuffled they are not (a padded copy): same sums either way."""
    seq_lens = [16, 48, 100]
    in_place = _decode_batch(seq_lens, 9, 3, 64, 4, seed=1, shuffle=False)
    query, k_cache, v_cache, tables, lens = in_place
    # The same rows under a shuffled block order: move each block where the new table points.
    perm = torch.randperm(k_cache.shape[0], generator=torch.Generator().manual_seed(2))
    k_shuffled, v_shuffled = torch.empty_like(k_cache), torch.empty_like(v_cache)
    k_shuffled[perm] = k_cache
    v_shuffled[perm] = v_cache
    tables_shuffled = perm[tables.long()].int()
    a = cpu_ops().paged_decode(query, k_cache, v_cache, tables, lens, 0.125, 0, 0.0)
    b = cpu_ops().paged_decode(query, k_shuffled, v_shuffled, tables_shuffled, lens, 0.125, 0, 0.0)
    assert torch.equal(a, b)


def test_amx_path_agrees_with_the_generic_reference_of_the_engine():
    """The engine's own reference (reference.py, float32) on a decode batch, as the backend tests use it."""
    from nanoinfer.attention.metadata import AttentionMetadata

    seq_lens = [5, 40, 257]
    query, k_cache, v_cache, tables, lens = _decode_batch(seq_lens, 9, 3, 64, 16, seed=3)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(len(seq_lens), dtype=torch.int64),
        query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
        seq_lens=lens,
        block_tables=tables,
        max_query_len=1,
        max_seq_len=max(seq_lens),
        query_lens_cpu=[1] * len(seq_lens),
        seq_lens_cpu=seq_lens,
    )
    expected = paged_attention_reference(query, k_cache, v_cache, metadata, 0.125)
    got = cpu_ops().paged_decode(query, k_cache, v_cache, tables, lens, 0.125, 0, 0.0)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


def _prefill_reference(query, k_cache, v_cache, tables, q_starts, q_lens, seq_lens, scale):
    """float64 causal attention of each chunk's queries (the last q_len positions of its sequence)."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    group = query.shape[1] // hkv
    for b, (start, q_len, n) in enumerate(zip(q_starts.tolist(), q_lens.tolist(), seq_lens.tolist())):
        slots = [int(tables[b, t // bs]) * bs + t % bs for t in range(n)]
        k = k_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        v = v_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        q = query[start: start + q_len].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        positions = torch.arange(n - q_len, n)
        scores = scores.masked_fill(torch.arange(n)[None, :] > positions[:, None], float("-inf"))
        out[start: start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("block_size", [64, 256])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (16, 2)])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])  # 96: a last group of two 16-dim output tiles
def test_amx_prefill_attention_matches_float64_reference(block_size, heads, head_dim):
    # (q_len, seq_len): fresh prompts around the tile edges, and chunks after a cached prefix.
    chunks = [(1, 1), (15, 15), (16, 16), (17, 17), (33, 33), (64, 64), (65, 65), (300, 300), (20, 150), (1, 97),
              (64, 200)]
    q_lens = [q for q, _ in chunks]
    seq_lens = [n for _, n in chunks]
    _, k_cache, v_cache, tables, lens = _decode_batch(seq_lens, *heads, head_dim, block_size, seed=head_dim + 1)
    gen = torch.Generator().manual_seed(block_size)
    query = torch.randn(sum(q_lens), heads[0], head_dim, generator=gen).bfloat16()
    q_starts = torch.tensor([sum(q_lens[:i]) for i in range(len(q_lens))], dtype=torch.int32)
    q_lens_t = torch.tensor(q_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    out = torch.empty_like(query)
    cpu_ops().paged_prefill(query, k_cache, v_cache, tables, q_starts, q_lens_t, lens, scale, out, 0, 0.0)
    expected = _prefill_reference(query, k_cache, v_cache, tables, q_starts, q_lens_t, lens, scale)
    # The probabilities enter the second product as two bfloat16 parts (~16 bits): the output is the float64
    # result rounded to bfloat16, a step off now and then.
    torch.testing.assert_close(out.double(), expected, rtol=2**-7, atol=2e-3)
    assert (out.double() == expected.bfloat16().double()).float().mean() > 0.98
