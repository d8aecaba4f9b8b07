"""Triton attention over the paged KV cache (oracle: attention/reference.py paged_attention_reference).

Two kernels share one inner loop (online softmax over key tiles read through the block table):
- decode (query_len 1 per sequence): one program per (sequence, KV head, context split); the query heads of
  a GQA group are the rows of one tile. Long contexts are split across programs (flash-decoding) and a
  second kernel merges the splits by their log-sum-exp.
- prefill (any query_len, cached prefix + new tokens, causal): one program per (sequence, query tile, KV
  head); a tile's rows are (token, query head of the group) pairs, so each key tile is read once per group.
Accumulation is float32; softmax runs in base 2 (exp2) with the scale folded into log2(e).
Attention sinks (gpt-oss: a logit per head in the softmax's sum, with no value) start a row's running state
at (max = sink, sum = 1); split decode leaves them to the merge, which adds each head's sink once.

The cache may be fp8 (e4m3 or e5m2, scale 1: kernels/store_kvcache.py writes it): keys and values are
widened to the query's dtype as they are loaded (exactly: fp8 values are bfloat16 and float16 values).
The decode launcher's keywords tile_n, num_splits, split_by_seq_len, num_warps and num_stages pick the variant
scripts/gpu_check.sh measures (benchmarks/tools/decode_variants.py); None keeps the default.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

_LOG2_E = 1.4426950408889634
_LOG2_E_JIT = tl.constexpr(_LOG2_E)  # the same constants, readable inside kernels
_LN_2 = tl.constexpr(0.6931471805599453)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CACHE_DTYPES = _DTYPES + (torch.float8_e4m3fn, torch.float8_e5m2)  # fp8: kv_cache_dtype fp8_e4m3 / fp8_e5m2
_TILE_N = 64  # keys per inner tile; must divide the block size, so a tile never crosses a block
_MIN_PARTITION_TILES = 4  # a decode split covers at least 4 tiles (256 keys): below that the merge costs more


@triton.jit
def _attend_kv_range(
    q, acc, m_i, l_i,  # q [M, D] query tile; acc [M, D], m_i/l_i [M] float32 running softmax state
    q_pos,  # [M] int32: context position of each row's token; row r sees keys at positions <= q_pos[r]
    k_cache_ptr, v_cache_ptr, block_table_ptr,  # block_table_ptr: this sequence's row of block_tables
    kv_head, stride_cache_block, stride_cache_token, stride_cache_head,
    kv_start, kv_end,  # key positions [kv_start, kv_end); kv_start is a multiple of TILE_N
    block_size, qk_scale,  # qk_scale = softmax scale * log2(e)
    window, soft_cap,  # sliding window (keys with q_pos - pos < window) and score soft cap; used when HAS_* are set
    HEAD_DIM: tl.constexpr, TILE_N: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    MIXED: tl.constexpr,  # the cache's dtype differs from the query's (kv_cache_dtype)
    HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr,
):
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for tile_start in range(kv_start, kv_end, TILE_N):
        # TILE_N divides block_size, so the whole tile lies in one cache block.
        block_id = tl.load(block_table_ptr + tile_start // block_size).to(tl.int64)
        in_block = tile_start % block_size + offs_n
        kv_offs = (block_id * stride_cache_block + in_block[:, None] * stride_cache_token
                   + kv_head * stride_cache_head + offs_d[None, :])
        pos = tile_start + offs_n
        in_range = pos < kv_end
        k = tl.load(k_cache_ptr + kv_offs, mask=in_range[:, None], other=0.0)
        v = tl.load(v_cache_ptr + kv_offs, mask=in_range[:, None], other=0.0)
        if UPCAST:  # the Triton interpreter cannot multiply bfloat16; same values, float32 arithmetic
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if MIXED:  # e.g. a float32 model over a bfloat16 cache: widen the keys, compute in the query's dtype
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if HAS_CAP:  # cap * tanh(score / cap), on the scaled score (transformers' order), then to base 2
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * (qk_scale * _LN_2)
            s = soft_cap * (2.0 * tl.sigmoid(2.0 * scores / soft_cap) - 1.0) * _LOG2_E_JIT
        else:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, TILE_N]
        visible = (pos[None, :] <= q_pos[:, None]) & in_range[None, :]
        if HAS_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # m_i starts finite (-1e30), so fully masked rows stay finite
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MIXED:
            p = p.to(v.dtype)
        else:
            # Round p to the cache dtype for the tensor-core dot, as flash-attention does.
            p = p.to(k_cache_ptr.dtype.element_ty)
            if UPCAST:
                p = p.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _sink_state(sinks_ptr, head, row_valid, m_i, l_i):
    """The running softmax state of rows whose heads have a sink: the sink's logit in base 2 as the max, its
    exp2(0) = 1 as the sum (padding rows keep theirs)."""
    sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0) * _LOG2_E_JIT
    return tl.where(row_valid, sink, m_i), tl.where(row_valid, 1.0, l_i)


@triton.jit
def _seq_partition_size(seq_len, num_splits, TILE_N: tl.constexpr):
    """Keys per split when a sequence's context is shared evenly by num_splits programs, in whole tiles (at
    least one, so an empty context divides by TILE_N, not 0)."""
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, TILE_N), num_splits), 1) * TILE_N


@triton.jit
def _paged_decode_kernel(
    out_ptr, split_out_ptr, split_lse_ptr, query_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    stride_q_token, stride_q_head, stride_out_token, stride_out_head,
    stride_split_seq, stride_split_head, stride_split_idx,  # split_out [seqs, H_q, splits, D]; lse drops D
    stride_cache_block, stride_cache_token, stride_cache_head, stride_table_seq,
    num_queries_per_kv, block_size, partition_size, qk_scale, window, soft_cap,
    sinks_ptr,  # float32 [H_q] sink logits, read when HAS_SINKS (and not IS_SPLIT: the merge adds them)
    HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, TILE_N: tl.constexpr,
    IS_SPLIT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, MIXED: tl.constexpr,
    SPLIT_BY_SEQ_LEN: tl.constexpr,  # partitions from this sequence's length, not the longest one's
    HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    if SPLIT_BY_SEQ_LEN:
        partition_size = _seq_partition_size(seq_len, tl.num_programs(2), TILE_N)
    kv_start = split * partition_size
    # Nested, not `and`: IS_SPLIT is resolved at compile time and the inner test at run time.
    if IS_SPLIT:  # noqa: SIM102
        if kv_start >= seq_len:  # the merge only reads splits that hold keys
            return
    kv_end = tl.minimum(kv_start + partition_size, seq_len)
    if HAS_WINDOW:  # start at the tile holding the window's first key (the mask hides the rest of that tile)
        kv_start = tl.maximum(kv_start, (tl.maximum(seq_len - window, 0) // TILE_N) * TILE_N)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    row_valid = offs_g < num_queries_per_kv
    head = kv_head * num_queries_per_kv + offs_g
    q = tl.load(query_ptr + seq.to(tl.int64) * stride_q_token + head[:, None] * stride_q_head + offs_d[None, :],
                mask=row_valid[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = tl.zeros([BLOCK_G], dtype=tl.int32) + (seq_len - 1)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_G], dtype=tl.float32) - 1e30
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    if HAS_SINKS:  # noqa: SIM102
        if not IS_SPLIT:  # a split's state leaves the sink out: the merge adds it once
            m_i, l_i = _sink_state(sinks_ptr, head, row_valid, m_i, l_i)
    acc, m_i, l_i = _attend_kv_range(
        q, acc, m_i, l_i, q_pos, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_table_seq,
        kv_head, stride_cache_block, stride_cache_token, stride_cache_head, kv_start, kv_end, block_size, qk_scale,
        window, soft_cap, HEAD_DIM, TILE_N, UPCAST, DOT_PRECISION, MIXED, HAS_WINDOW, HAS_CAP,
    )
    # l_i is 0 only for an empty context (a padded batch slot): write zeros, not NaN.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if IS_SPLIT:
        split_offs = seq.to(tl.int64) * stride_split_seq + head * stride_split_head + split * stride_split_idx
        tl.store(split_out_ptr + split_offs[:, None] + offs_d[None, :], out, mask=row_valid[:, None])
        tl.store(split_lse_ptr + split_offs // HEAD_DIM, m_i + tl.log2(l_safe), mask=row_valid)
    else:
        out_offs = seq.to(tl.int64) * stride_out_token + head[:, None] * stride_out_head + offs_d[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


@triton.jit
def _merge_splits_kernel(
    out_ptr, split_out_ptr, split_lse_ptr, seq_lens_ptr,
    stride_out_token, stride_out_head, stride_split_seq, stride_split_head, stride_split_idx,
    partition_size, max_splits, sinks_ptr,
    HEAD_DIM: tl.constexpr, TILE_N: tl.constexpr, SPLIT_BY_SEQ_LEN: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    if SPLIT_BY_SEQ_LEN:
        partition_size = _seq_partition_size(seq_len, max_splits, TILE_N)
    num_splits = tl.cdiv(seq_len, partition_size)
    offs_d = tl.arange(0, HEAD_DIM)
    base = seq.to(tl.int64) * stride_split_seq + head * stride_split_head
    # Online merge: each split's output is already normalised; weight it by exp2(its lse - running max). A sink
    # is one more "split" with weight exp2(sink) and output 0.
    m = float("-inf")
    l_sum = 0.0
    if HAS_SINKS:
        m = tl.load(sinks_ptr + head) * _LOG2_E_JIT
        l_sum = 1.0
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for split in range(num_splits):
        offs = base + split * stride_split_idx
        lse = tl.load(split_lse_ptr + offs // HEAD_DIM)
        part = tl.load(split_out_ptr + offs + offs_d)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        weight = tl.exp2(lse - m_new)
        acc = acc * alpha + part * weight
        l_sum = l_sum * alpha + weight
        m = m_new
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_out_token + head * stride_out_head + offs_d,
             out.to(out_ptr.dtype.element_ty))


@triton.jit
def _paged_prefill_kernel(
    out_ptr, query_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    stride_q_token, stride_q_head, stride_out_token, stride_out_head,
    stride_cache_block, stride_cache_token, stride_cache_head, stride_table_seq,
    num_queries_per_kv, tokens_per_tile, block_size, qk_scale, window, soft_cap,
    sinks_ptr,  # float32 [H_q] sink logits, read when HAS_SINKS
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, MIXED: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_begin = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    tile_first = q_tile * tokens_per_tile
    if tile_first >= query_len:  # the grid is sized for the longest query in the batch
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    num_cached = seq_len - query_len  # this step's query tokens are the last query_len of seq_len

    rows = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    token = tile_first + rows // num_queries_per_kv  # index within this sequence's query tokens
    head = kv_head * num_queries_per_kv + rows % num_queries_per_kv
    row_valid = (rows < tokens_per_tile * num_queries_per_kv) & (token < query_len)
    q_offs = (q_begin + token).to(tl.int64)[:, None] * stride_q_token + head[:, None] * stride_q_head
    q = tl.load(query_ptr + q_offs + offs_d[None, :], mask=row_valid[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = num_cached + token
    tile_last = tl.minimum(tile_first + tokens_per_tile, query_len) - 1
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1e30
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:
        m_i, l_i = _sink_state(sinks_ptr, head, row_valid, m_i, l_i)
    kv_start = 0
    if HAS_WINDOW:  # the tile's first query sees nothing before its window
        kv_start = (tl.maximum(num_cached + tile_first - window + 1, 0) // TILE_N) * TILE_N
    acc, m_i, l_i = _attend_kv_range(
        q, acc, m_i, l_i, q_pos, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_table_seq,
        kv_head, stride_cache_block, stride_cache_token, stride_cache_head, kv_start, num_cached + tile_last + 1,
        block_size, qk_scale, window, soft_cap, HEAD_DIM, TILE_N, UPCAST, DOT_PRECISION, MIXED, HAS_WINDOW, HAS_CAP,
    )
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_offs = (q_begin + token).to(tl.int64)[:, None] * stride_out_token + head[:, None] * stride_out_head
    tl.store(out_ptr + out_offs + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    num_splits: int | None = None,
    *,
    tile_n: int | None = None,
    split_by_seq_len: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence, query [num_seqs, H_q, D], over its seq_len cached keys.

    The grid is (num_seqs, H_kv, num_splits); with num_splits > 1 a merge kernel with grid (num_seqs, H_q)
    combines the splits. num_splits=None picks enough splits to fill the device. The grid depends only on
    num_seqs and max_seq_len, so a CUDA graph captured with max_seq_len = max_model_len serves any length.
    Returns [num_seqs, H_q, D] in query's dtype. sinks: float32 [H_q] sink logits (gpt-oss), or None.

    Variants (same results, for measuring; None / False is the default): tile_n keys per inner tile (a power
    of two >= 16 dividing the block size); split_by_seq_len shares each sequence's own context evenly over the
    num_splits programs instead of cutting every context at multiples of max_seq_len / num_splits (which
    leaves a short sequence's later splits empty); num_warps and num_stages are Triton's launch options.
    """
    num_seqs, num_heads, head_dim = query.shape
    _check_common("paged_decode_attention", query, k_cache, v_cache, block_tables, seq_lens, num_seqs)
    _check_sinks("paged_decode_attention", sinks, query)
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if tile_n is None:
        tile_n = _tile_size(block_size)
    _require(tile_n >= 16 and tile_n & (tile_n - 1) == 0 and block_size % tile_n == 0,
             f"tile_n {tile_n} must be a power of two >= 16 dividing the block size {block_size}",
             "paged_decode_attention")  # fmt: skip
    max_seq_len = max(int(max_seq_len), 1)
    num_tiles = triton.cdiv(max_seq_len, tile_n)
    if num_splits is None:
        wanted = triton.cdiv(_target_programs(query.device), num_seqs * num_kv_heads)
        num_splits = min(wanted, triton.cdiv(num_tiles, _MIN_PARTITION_TILES))
    num_splits = max(1, min(int(num_splits), num_tiles))
    partition_size = triton.cdiv(num_tiles, num_splits) * tile_n
    num_splits = triton.cdiv(max_seq_len, partition_size)  # rounding may leave the last split empty

    out = query.new_empty(query.shape)
    if num_seqs == 0:
        return out
    is_split = num_splits > 1
    if is_split:
        split_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        split_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    else:
        split_out = split_lse = out  # unused by the kernel; any tensor keeps the signature
    by_seq_len = bool(split_by_seq_len) and is_split
    launch = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None}
    group = num_heads // num_kv_heads
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        out, split_out, split_lse, query, k_cache, v_cache, block_tables, seq_lens,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        num_heads * num_splits * head_dim, num_splits * head_dim, head_dim,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        group, block_size, partition_size, scale * _LOG2_E, sliding_window or 0, soft_cap or 0.0,
        out if sinks is None else sinks,  # any tensor keeps the signature when unused
        HEAD_DIM=head_dim, BLOCK_G=max(16, triton.next_power_of_2(group)), TILE_N=tile_n,
        IS_SPLIT=is_split, UPCAST=_needs_upcast(query, k_cache), DOT_PRECISION=_dot_precision(query),
        MIXED=query.dtype != k_cache.dtype, SPLIT_BY_SEQ_LEN=by_seq_len, HAS_WINDOW=sliding_window is not None,
        HAS_CAP=soft_cap is not None, HAS_SINKS=sinks is not None, **launch,
    )
    if is_split:
        _merge_splits_kernel[(num_seqs, num_heads)](
            out, split_out, split_lse, seq_lens,
            out.stride(0), out.stride(1), num_heads * num_splits * head_dim, num_splits * head_dim, head_dim,
            partition_size, num_splits, out if sinks is None else sinks, HEAD_DIM=head_dim, TILE_N=tile_n,
            SPLIT_BY_SEQ_LEN=by_seq_len, HAS_SINKS=sinks is not None,
        )
    return out


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    block_m: int = 64,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of query [num_tokens, H_q, D] (sequences back to back, split by query_start_loc)
    over each sequence's cached prefix plus its new tokens, all read from the paged cache.

    The grid is (num_seqs, cdiv(max_query_len, block_m // group), H_kv); tiles past a sequence's query_len
    exit at once. Returns [num_tokens, H_q, D] in query's dtype. sinks: float32 [H_q] sink logits, or None.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    _check_common("paged_prefill_attention", query, k_cache, v_cache, block_tables, seq_lens, num_seqs)
    _check_sinks("paged_prefill_attention", sinks, query)
    _require(
        query_start_loc.shape == (num_seqs + 1,) and query_start_loc.dtype == torch.int32,
        f"query_start_loc must be int32 [{num_seqs + 1}], got {query_start_loc.dtype} "
        f"{tuple(query_start_loc.shape)}",
        "paged_prefill_attention",
    )
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    _require(
        block_m >= 16 and block_m & (block_m - 1) == 0 and block_m >= group,
        f"block_m {block_m} must be a power of two >= max(16, group={group})", "paged_prefill_attention",
    )
    out = query.new_empty(query.shape)
    if num_tokens == 0 or num_seqs == 0:
        return out
    tokens_per_tile = block_m // group
    grid = (num_seqs, triton.cdiv(max(int(max_query_len), 1), tokens_per_tile), num_kv_heads)
    _paged_prefill_kernel[grid](
        out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        group, tokens_per_tile, block_size, scale * _LOG2_E, sliding_window or 0, soft_cap or 0.0,
        out if sinks is None else sinks,
        HEAD_DIM=head_dim, BLOCK_M=block_m, TILE_N=_tile_size(block_size), UPCAST=_needs_upcast(query, k_cache),
        DOT_PRECISION=_dot_precision(query), MIXED=query.dtype != k_cache.dtype,
        HAS_WINDOW=sliding_window is not None, HAS_CAP=soft_cap is not None, HAS_SINKS=sinks is not None,
    )
    return out


def _check_common(
    caller: str, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, num_seqs: int,
) -> None:
    _require(query.dim() == 3, f"query must be [tokens, H_q, D], got {tuple(query.shape)}", caller)
    num_heads, head_dim = query.shape[1], query.shape[2]
    _require(k_cache.dim() == 4, f"k_cache must be [blocks, block_size, H_kv, D], got {tuple(k_cache.shape)}", caller)
    num_kv_heads = k_cache.shape[2]
    _require(
        k_cache.shape[3] == head_dim and v_cache.shape == k_cache.shape,
        f"cache shapes k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)} do not match head_dim {head_dim}",
        caller,
    )
    _require(
        num_heads % num_kv_heads == 0,
        f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})", caller,
    )
    _require(
        head_dim >= 16 and head_dim & (head_dim - 1) == 0, f"head_dim {head_dim} must be a power of two >= 16",
        caller,
    )
    _require(query.stride(2) == 1, f"query's last dim must be contiguous, strides {query.stride()}", caller)
    _require(
        k_cache.stride(3) == 1 and v_cache.stride() == k_cache.stride(),
        f"k/v cache strides {k_cache.stride()}, {v_cache.stride()}: must match, last dim contiguous", caller,
    )
    _require(
        query.dtype in _DTYPES and k_cache.dtype in _CACHE_DTYPES and v_cache.dtype == k_cache.dtype,
        f"query/k_cache/v_cache dtypes {query.dtype}/{k_cache.dtype}/{v_cache.dtype}: the query's must be one of "
        "float32, float16, bfloat16, the caches' one of those or fp8 (e4m3fn, e5m2), the two caches alike (the "
        "query's may differ: kv_cache_dtype)", caller,
    )
    _require(
        block_tables.dim() == 2 and block_tables.shape[0] == num_seqs and block_tables.dtype == torch.int32
        and block_tables.stride(1) == 1,
        f"block_tables must be int32 [{num_seqs}, max_blocks] with contiguous rows, got {block_tables.dtype} "
        f"{tuple(block_tables.shape)} strides {block_tables.stride()}", caller,
    )
    _require(
        seq_lens.shape == (num_seqs,) and seq_lens.dtype == torch.int32,
        f"seq_lens must be int32 [{num_seqs}], got {seq_lens.dtype} {tuple(seq_lens.shape)}", caller,
    )
    devices = {t.device for t in (query, k_cache, v_cache, block_tables, seq_lens)}
    _require(len(devices) == 1, f"all tensors must be on one device, got {sorted(map(str, devices))}", caller)
    _tile_size(k_cache.shape[1])


def _check_sinks(caller: str, sinks: torch.Tensor | None, query: torch.Tensor) -> None:
    if sinks is not None:
        _require(
            sinks.shape == (query.shape[1],) and sinks.dtype == torch.float32 and sinks.is_contiguous()
            and sinks.device == query.device,
            f"sinks must be contiguous float32 [{query.shape[1]}] on {query.device}, got {sinks.dtype} "
            f"{tuple(sinks.shape)} on {sinks.device}", caller,
        )


def _tile_size(block_size: int) -> int:
    tile = min(_TILE_N, block_size & -block_size)  # largest power of two dividing block_size, capped
    _require(tile >= 16, f"KV block size {block_size} must be a multiple of 16", "paged attention")
    return tile


@functools.lru_cache
def _target_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 16


def _dot_precision(query: torch.Tensor) -> str:
    # float32 models are for checking against float32 references: exact products, not TF32. For 16-bit
    # inputs the setting is moot; "tf32" is Triton's default.
    return "ieee" if query.dtype == torch.float32 else "tf32"


def _needs_upcast(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    # The interpreter stores bfloat16 as raw uint16 bits, so tl.dot on it is garbage; compiled code is fine.
    bf16 = torch.bfloat16 in (query.dtype, k_cache.dtype)
    return bf16 and os.environ.get("TRITON_INTERPRET") == "1"


def _require(condition: bool, message: str, caller: str) -> None:
    # A failed check is a bug in the caller (model runner), not a user error: plain exception, never caught.
    if not condition:
        raise ValueError(f"{caller}: {message}")
