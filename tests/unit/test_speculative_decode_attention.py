"""Decode attention over runs of rows (csrc/paged_attention.cpp): speculative decoding lays out a sequence's
last token and its proposed tokens as consecutive decode rows of one block table with lengths n, n + 1, ...
The kernel computes such a run in one work item (on AMX, and on AVX-512 with float32 queries, as one row with
more query heads a KV head); each row must come out bit for bit as it does alone, and match float64 attention."""

from __future__ import annotations

import pytest
import torch

from nanoinfer.platforms.cpu.ops import cpu_ops

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="the CPU kernels are not built")


def _runs(num_seqs: int, run_len: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype,
          cache_dtype=None):
    gen = torch.Generator().manual_seed(run_len * 100 + num_heads)
    blocks_per_seq = -(-(300 + run_len) // block_size)
    num_blocks = num_seqs * blocks_per_seq
    cache_dtype = cache_dtype or dtype
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
    tables = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(num_seqs, blocks_per_seq)
    seqs, lens = [], []
    for s in range(num_seqs):
        first = 1 + (s * 97) % 300  # 1..300 tokens: shorter than a tile, partial tiles, across blocks
        for r in range(run_len):
            seqs.append(s)
            lens.append(first + r)
    query = torch.randn(len(seqs), num_heads, head_dim, generator=gen).to(dtype)
    return query, k_cache, v_cache, tables[seqs], torch.tensor(lens, dtype=torch.int32)


def _reference(query, k_cache, v_cache, tables, seq_lens, scale):
    out = []
    group = query.shape[1] // k_cache.shape[2]
    for b, n in enumerate(seq_lens.tolist()):
        k = k_cache[tables[b].long()].flatten(0, 1)[:n].double().repeat_interleave(group, dim=1)
        v = v_cache[tables[b].long()].flatten(0, 1)[:n].double().repeat_interleave(group, dim=1)
        probs = torch.softmax(torch.einsum("hd,thd->ht", query[b].double(), k) * scale, dim=-1)
        out.append(torch.einsum("ht,thd->hd", probs, v))
    return torch.stack(out)


@pytest.mark.parametrize("dtype, cache_dtype", [
    (torch.float32, None), (torch.bfloat16, None),
    (torch.float32, torch.bfloat16), (torch.float32, torch.float8_e4m3fn),  # kv_cache_dtype under float32
])  # fmt: skip
@pytest.mark.parametrize("heads", [(9, 3, 64, 256), (8, 2, 128, 16), (4, 4, 64, 256), (16, 1, 64, 256), (6, 2, 80, 16)])
@pytest.mark.parametrize("run_len", [2, 4, 6, 9])
@pytest.mark.parametrize("num_runs", ["one", "few", "many"])
def test_runs_of_rows_give_each_row_its_bits_alone(dtype, cache_dtype, heads, run_len, num_runs):
    """(9, 3): SmolLM2's heads, on AMX runs of up to 5 rows share a tile's 16 columns, longer runs split (on
    AVX-512, float32 queries: runs of up to 8 rows); (8, 2) with 16-token blocks: tiles cross blocks; (16, 1):
    a row fills the AMX tile's columns, so runs go row by row there; (6, 2, 80): a head size the AVX-512 loops
    take with run-time chunk counts (64 and 128 have unrolled ones). One run (fewer than threads): each work
    item is one KV head of it; few (3) and many (4 a thread): whole runs, where one AMX tile holds several KV
    heads' columns of several rows."""
    num_seqs = {"one": 1, "few": 3, "many": 4 * torch.get_num_threads() + 1}[num_runs]
    num_heads, num_kv_heads, head_dim, block_size = heads
    query, k_cache, v_cache, tables, lens = _runs(num_seqs, run_len, num_heads, num_kv_heads, head_dim, block_size,
                                                  dtype, cache_dtype)  # fmt: skip
    ops = cpu_ops()
    together = ops.paged_decode(query, k_cache, v_cache, tables, lens, 0.1, 0, 0.0)
    if num_seqs == 1:  # each row in a call of its own
        alone = torch.cat([ops.paged_decode(query[i : i + 1], k_cache, v_cache, tables[i : i + 1], lens[i : i + 1],
                                            0.1, 0, 0.0)
                           for i in range(len(lens))])  # fmt: skip
    else:  # the same rows in an order where no two neighbours make a run: every row computed alone
        order = torch.tensor(sorted(range(len(lens)), key=lambda i: (i % run_len, i // run_len)))
        alone = torch.empty_like(together)
        alone[order] = ops.paged_decode(query[order], k_cache, v_cache, tables[order], lens[order], 0.1, 0, 0.0)
    assert torch.equal(together, alone)
    # The first run on its own: one run, fewer than threads, so split by KV heads where the others went whole.
    first = ops.paged_decode(query[:run_len], k_cache, v_cache, tables[:run_len], lens[:run_len], 0.1, 0, 0.0)
    assert torch.equal(first, together[:run_len])
    expected = _reference(query, k_cache, v_cache, tables, lens, 0.1)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16 outputs: 8 mantissa bits (caches widen exactly)
    torch.testing.assert_close(together.double(), expected, atol=tolerance, rtol=tolerance)
