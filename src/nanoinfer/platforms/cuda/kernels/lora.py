"""Triton batched multi-LoRA (oracle: platforms/interface.py Platform.add_lora; Punica's BGMV/SGMV, as vLLM's
lora/ops/triton_ops shrink and expand): y += each row's own adapter's delta, in place, in two steps:
- shrink: h = x A[slot]^T for a tile of rows x a block of the S * R rank rows x a share of K (split-K), float32
  partials into a scratch buffer;
- expand, one launch per slice: the partials summed in a fixed order (no atomics: the same output every run),
  rounded to x's dtype, times that slice's columns of B[slot], added into y.
A tile's rows may use different slots: it makes one pass per distinct slot among its rows (rows in order, not
sorted: a prefill's rows share a slot, a decode tile has at most as many passes as adapters), keeping each row's
result from its own slot's pass only. Rows with slot -1 write nothing and cost nothing of their own (a tile of
them only exits at once; beside other rows their x is loaded with the tile, but no result of theirs is kept).
Grids and the scratch come from the shapes alone (T, K, N, S, R), never from row_slots' values, so a CUDA graph
captures every launch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_NO_SLOT = tl.constexpr(2**31 - 1)  # above every slot: the distinct-slot loop's end


@dataclass(frozen=True)
class LoraBlockConfig:
    """Tile sizes: BLOCK_M rows a program; the shrink's rank block at most block_r of the S * R rank rows wide and
    BLOCK_K deep; the expand's BLOCK_N columns wide."""

    block_m: int
    block_r: int
    block_k: int
    block_n: int
    num_warps: int = 4


# Decode tiles: a small batch's rows in few tiles, narrow rank blocks and K split wide, for programs enough to
# read A at full bandwidth. Prefill tiles load each adapter's A and B once for 64 rows (a prompt's rows share
# their slot) and read x once per 64 rank rows. Both compile for sm_90 without spilling registers in 16 bits
# (testing/triton_compile.py prints the usage).
DECODE_CONFIG = LoraBlockConfig(block_m=16, block_r=16, block_k=128, block_n=64)
PREFILL_CONFIG = LoraBlockConfig(block_m=64, block_r=64, block_k=32, block_n=64, num_warps=8)
_TARGET_PROGRAMS = 264  # two per SM of an H100: K's split and the expand's column runs aim at this many programs


def lora_block_config(num_rows: int) -> LoraBlockConfig:
    """The decode tiles up to 128 rows. For one model only T varies, so each CUDA graph bucket takes fixed tiles."""
    return DECODE_CONFIG if num_rows <= 128 else PREFILL_CONFIG


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, h_ptr, row_slots_ptr, num_rows, k_in, rank_rows, k_per_split,
    stride_x_row, stride_a_slot, stride_a_row, stride_h_split, stride_h_row,  # rows of x and a contiguous
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(row_slots_ptr + rows, mask=rows < num_rows, other=-1)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # rows of A: slice s's rank rows at s * R
    k_start = tl.program_id(2) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, k_in)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past T and rank rows past S * R read the last real one (a result no store keeps), so the loads in the
    # K loop are masked along K only: per-element masks there cost registers the tiles need.
    x_ptrs = x_ptr + tl.minimum(rows, num_rows - 1).to(tl.int64)[:, None] * stride_x_row + (k_start + offs_k)[None, :]
    a_offs = tl.minimum(offs_r, rank_rows - 1)[None, :] * stride_a_row + (k_start + offs_k)[:, None]  # A^T: [K, R]
    h_ptrs = h_ptr + tl.program_id(2) * stride_h_split + rows.to(tl.int64)[:, None] * stride_h_row + offs_r[None, :]
    h_mask = offs_r[None, :] < rank_rows
    slot = tl.min(tl.where(slots >= 0, slots, _NO_SLOT), axis=0)
    while slot < _NO_SLOT:  # one pass per distinct slot among the tile's rows, in increasing order
        a_ptrs = a_ptr + slot.to(tl.int64) * stride_a_slot + a_offs
        xk_ptrs = x_ptrs
        part = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k in range(k_start, k_end, BLOCK_K):
            k_mask = offs_k < k_end - k
            x = tl.load(xk_ptrs, mask=k_mask[None, :], other=0.0)
            a = tl.load(a_ptrs, mask=k_mask[:, None], other=0.0)
            if UPCAST:  # the interpreter cannot multiply bfloat16; same values, float32 arithmetic
                x = x.to(tl.float32)
                a = a.to(tl.float32)
            part = tl.dot(x, a, part, input_precision=DOT_PRECISION)  # row i of part: row i of x only
            xk_ptrs += BLOCK_K
            a_ptrs += BLOCK_K
        # Each pass stores its own rows only: every row is written once, and no accumulator lives across passes.
        tl.store(h_ptrs, part, mask=(slots == slot)[:, None] & h_mask)
        slot = tl.min(tl.where(slots > slot, slots, _NO_SLOT), axis=0)


@triton.jit
def _lora_expand_kernel(
    h_ptr, b_ptr, y_ptr, row_slots_ptr, num_rows, rank, h_start, n_start, n_end, cols_per_program, num_splits,
    stride_h_split, stride_h_row, stride_b_slot, stride_b_rank, stride_y_row,  # rows of b and y contiguous
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(row_slots_ptr + rows, mask=rows < num_rows, other=-1)
    live = slots >= 0
    slot = tl.min(tl.where(live, slots, _NO_SLOT), axis=0)
    if slot == _NO_SLOT:  # no row of the tile has an adapter
        return
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    # h: this slice's R columns, the split-K partials summed in split order, rounded to x's (= y's) dtype; read
    # once for all of this program's columns
    dtype = y_ptr.dtype.element_ty
    h_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_h_row + (h_start + offs_r)[None, :]
    h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for split in range(num_splits):
        h += tl.load(h_ptrs + split * stride_h_split, mask=live[:, None] & r_mask[None, :], other=0.0)
    h = h.to(dtype)
    if UPCAST:
        h = h.to(tl.float32)
    n_lo = n_start + tl.program_id(1) * cols_per_program  # this slice's columns of B and y
    n_hi = tl.minimum(n_lo + cols_per_program, n_end)
    offs_n = tl.arange(0, BLOCK_N)
    y_rows = y_ptr + rows.to(tl.int64)[:, None] * stride_y_row
    while slot < _NO_SLOT:  # as in the shrink: each pass reads and writes its own rows of y only
        chosen = (slots == slot)[:, None]
        b_rows = b_ptr + slot.to(tl.int64) * stride_b_slot + offs_r[:, None] * stride_b_rank
        for n in range(n_lo, n_hi, BLOCK_N):
            cols = n + offs_n
            n_mask = cols[None, :] < n_hi
            b = tl.load(b_rows + cols[None, :], mask=r_mask[:, None] & n_mask, other=0.0)  # [BLOCK_R, BLOCK_N]
            if UPCAST:
                b = b.to(tl.float32)
            delta = tl.dot(h, b, input_precision=DOT_PRECISION)
            y = tl.load(y_rows + cols[None, :], mask=chosen & n_mask, other=0.0).to(tl.float32)
            tl.store(y_rows + cols[None, :], (y + delta).to(dtype), mask=chosen & n_mask)
        slot = tl.min(tl.where(slots > slot, slots, _NO_SLOT), axis=0)


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, row_slots: torch.Tensor,
             slice_offsets: tuple[int, ...], config: LoraBlockConfig | None = None) -> None:  # fmt: skip
    """Platform.add_lora: y [T, N] += each row's delta, in place. x [T, K]; lora_a [L, S * R, K] and lora_b
    [L, R, N] in x's dtype; row_slots [T] int32 (-1: no adapter); slice_offsets (0, ..., N), S + 1 of them.
    config: tile sizes (default: by T)."""
    _require(x.dim() == 2 and y.dim() == 2 and x.shape[0] == y.shape[0] and x.stride(-1) == 1 and y.stride(-1) == 1,
             f"x {tuple(x.shape)} and y {tuple(y.shape)} must be [T, K] and [T, N] with contiguous rows")  # fmt: skip
    _require(x.dtype in _DTYPES and y.dtype == x.dtype and lora_a.dtype == x.dtype and lora_b.dtype == x.dtype,
             f"x/y/lora_a/lora_b dtypes {x.dtype}/{y.dtype}/{lora_a.dtype}/{lora_b.dtype}: one of float32, "
             "float16, bfloat16")  # fmt: skip
    num_rows, k_in = x.shape
    n_out = y.shape[1]
    num_slices = len(slice_offsets) - 1
    rank = lora_b.shape[1]
    _require(lora_a.dim() == 3 and lora_b.dim() == 3 and lora_a.shape[0] == lora_b.shape[0]
             and lora_a.shape[1:] == (num_slices * rank, k_in) and lora_b.shape[2] == n_out
             and lora_a.stride(-1) == 1 and lora_b.stride(-1) == 1,
             f"lora_a {tuple(lora_a.shape)} and lora_b {tuple(lora_b.shape)} must be [L, S * R, {k_in}] and "
             f"[L, R, {n_out}] with contiguous rows, S = {num_slices}")  # fmt: skip
    _require(num_slices >= 1 and slice_offsets[0] == 0 and slice_offsets[-1] == n_out
             and all(lo <= hi for lo, hi in zip(slice_offsets, slice_offsets[1:])),
             f"slice_offsets {slice_offsets} must rise from 0 to {n_out}")  # fmt: skip
    _require(row_slots.shape == (num_rows,) and row_slots.dtype == torch.int32 and row_slots.stride(0) == 1,
             f"row_slots {tuple(row_slots.shape)} {row_slots.dtype} must be int32 [{num_rows}]")  # fmt: skip
    if num_rows == 0 or rank == 0:
        return
    config = config or lora_block_config(num_rows)
    rank_rows = num_slices * rank
    shrink_block_r = max(16, min(config.block_r, triton.next_power_of_2(rank_rows)))  # 16: tl.dot's least size
    row_tiles, rank_blocks = triton.cdiv(num_rows, config.block_m), triton.cdiv(rank_rows, shrink_block_r)
    # Split K while the programs are few (and each share keeps at least two K blocks): a decode step's few tiles
    # would otherwise walk all of K alone.
    max_splits = triton.cdiv(k_in, 2 * config.block_k)
    num_splits = max(1, min(max_splits, triton.cdiv(_TARGET_PROGRAMS, row_tiles * rank_blocks)))
    k_per_split = max(1, triton.cdiv(k_in, num_splits * config.block_k)) * config.block_k
    num_splits = max(1, triton.cdiv(k_in, k_per_split))  # no empty share
    h = torch.empty(num_splits, num_rows, rank_rows, dtype=torch.float32, device=x.device)
    shared = dict(
        UPCAST=x.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1",
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # float32 is for exact comparisons
        num_warps=config.num_warps,
    )  # fmt: skip
    _lora_shrink_kernel[(row_tiles, rank_blocks, num_splits)](
        x, lora_a, h, row_slots, num_rows, k_in, rank_rows, k_per_split,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), h.stride(0), h.stride(1),
        BLOCK_M=config.block_m, BLOCK_R=shrink_block_r, BLOCK_K=config.block_k, **shared,
    )  # fmt: skip
    expand_block_r = max(16, triton.next_power_of_2(rank))
    for s in range(num_slices):  # one launch a slice: a column block never straddles two slices' h
        lo, hi = slice_offsets[s], slice_offsets[s + 1]
        if hi == lo:
            continue
        # Each program walks a run of column blocks, reading h (all split partials) once for the run, not once a
        # block: runs of one block for a decode step's few row tiles, longer ones for a prefill's many.
        num_blocks = triton.cdiv(hi - lo, config.block_n)
        num_runs = min(num_blocks, triton.cdiv(_TARGET_PROGRAMS, row_tiles))
        cols_per_program = triton.cdiv(num_blocks, num_runs) * config.block_n
        _lora_expand_kernel[(row_tiles, triton.cdiv(hi - lo, cols_per_program))](
            h, lora_b, y, row_slots, num_rows, rank, s * rank, lo, hi, cols_per_program, num_splits,
            h.stride(0), h.stride(1), lora_b.stride(0), lora_b.stride(1), y.stride(0),
            BLOCK_M=config.block_m, BLOCK_R=expand_block_r, BLOCK_N=config.block_n, **shared,
        )  # fmt: skip


def _require(condition: bool, message: str) -> None:
    # A failed check is a bug in the caller (the LoRA layer), not a user error: plain exception, never caught.
    if not condition:
        raise ValueError(f"add_lora: {message}")
