"""Triton fused mixture-of-experts (oracle: platforms/interface.py Platform.fused_moe), in three steps:
- align: token-expert pairs sorted by expert (token order within one), each expert's run padded to BLOCK_M;
- a grouped GEMM over every expert at once, run twice: x @ w13[e]^T (+ bias) with the gated activation fused
  (gate and up tiles side by side), then h @ w2[e]^T (+ bias) times each pair's routing weight;
- each token's sum over its k pairs, in float32 in a fixed order (no atomics: the same output every run).
Nothing reads a value back to the host: buffers and grids are sized from T, k and E alone (the padded bound
T * k + E * (BLOCK_M - 1)), so a CUDA graph captures the whole path and blocks beyond the real ones exit early.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_ACTIVATIONS = ("silu", "gelu_tanh", "swigluoai")
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@dataclass(frozen=True)
class MoeBlockConfig:
    """Tile sizes of the grouped GEMM: BLOCK_M pairs of one expert x BLOCK_N output columns, BLOCK_K deep."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


# A block holds one expert's pairs, so what sets BLOCK_M is how many pairs each expert gets: a decode step
# gives most experts a few, and 64-row blocks would be mostly padding there.
DECODE_CONFIG = MoeBlockConfig(block_m=16, block_n=64, block_k=64)
PREFILL_CONFIG = MoeBlockConfig(block_m=64, block_n=64, block_k=64)


def moe_block_config(num_pairs: int, num_experts: int) -> MoeBlockConfig:
    """The decode tiles while experts average at most 16 pairs. For one model only T varies, so each CUDA graph
    bucket always takes the same tiles."""
    return DECODE_CONFIG if num_pairs <= 16 * num_experts else PREFILL_CONFIG


@triton.jit
def _moe_align_kernel(
    topk_ids_ptr, padded_starts_ptr, sorted_pairs_ptr, block_expert_ptr, num_pairs,
    BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
):
    # One program per expert: it places its own pairs at its padded start, in pair (= token) order, and
    # labels its blocks. No other program writes there, so no atomics are needed.
    expert = tl.program_id(0)
    start = tl.load(padded_starts_ptr + expert)
    end = tl.load(padded_starts_ptr + expert + 1)
    offs = tl.arange(0, BLOCK)
    for block in range(start // BLOCK_M, end // BLOCK_M, BLOCK):
        tl.store(block_expert_ptr + block + offs, expert, mask=block + offs < end // BLOCK_M)
    placed = start
    for chunk in range(0, num_pairs, BLOCK):
        pairs = chunk + offs
        ids = tl.load(topk_ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        match = (ids == expert).to(tl.int32)
        rank = tl.cumsum(match, axis=0) - match  # earlier pairs of this expert in the chunk
        tl.store(sorted_pairs_ptr + placed + rank, pairs, mask=match != 0)
        placed += tl.sum(match, axis=0)


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, bias_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr, topk_weights_ptr,
    num_pairs, top_k, n_out, k_in,  # n_out: output columns (I, or H); k_in: the reduced dimension (H, or I)
    stride_a_row, stride_w_expert, stride_w_n, stride_bias_expert, stride_out_row,  # rows of a and w contiguous
    swiglu_alpha, swiglu_limit,
    GATED: tl.constexpr,  # True: A = x rows of each pair's token, out = h by sorted position, activation fused;
                          # False: A = h by sorted position, out = routing weight * y by pair
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert < 0:  # beyond the last expert's padded run: the grid is sized for the worst case
        return
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # sorted positions
    pairs = tl.load(sorted_pairs_ptr + rows)
    valid = pairs < num_pairs  # padding holds num_pairs
    if GATED:
        a_rows = (pairs // top_k).to(tl.int64)
    else:
        a_rows = rows.to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_a_row + offs_k[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_w_expert + offs_n[None, :] * stride_w_n + offs_k[:, None]  # [K, N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # the up rows' tile (GATED), n_out rows below gate
    for k_start in range(0, k_in, BLOCK_K):
        k_mask = offs_k < k_in - k_start
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:  # the interpreter cannot multiply bfloat16; same values, float32 arithmetic
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if GATED:
            w_up = tl.load(w_ptrs + n_out * stride_w_n, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if UPCAST:
                w_up = w_up.to(tl.float32)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        bias_ptrs = bias_ptr + expert.to(tl.int64) * stride_bias_expert + offs_n
        acc += tl.load(bias_ptrs, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_ptrs + n_out, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    # Each rounding the reference does (its F.linear output, the activation's steps) is done here too.
    y = acc.to(dtype).to(tl.float32)
    out_mask = valid[:, None] & n_mask[None, :]
    if GATED:
        up = acc_up.to(dtype).to(tl.float32)
        if ACTIVATION == "silu":
            act = (y / (1.0 + tl.exp(-y))).to(dtype).to(tl.float32)
            h = act * up
        elif ACTIVATION == "gelu_tanh":
            inner = _SQRT_2_OVER_PI * (y + 0.044715 * y * y * y)
            tanh = 1.0 - 2.0 / (1.0 + tl.exp(2.0 * inner))  # exp overflowing to inf gives the right limit, 1
            act = (0.5 * y * (1.0 + tanh)).to(dtype).to(tl.float32)
            h = act * up
        else:  # swigluoai (gpt-oss): gate clamped above, up clamped both ways, (up + 1) * gate * sigmoid(alpha gate)
            gate = tl.minimum(y, swiglu_limit)
            up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
            glu = (gate / (1.0 + tl.exp(-gate * swiglu_alpha))).to(dtype).to(tl.float32)
            h = (up + 1.0).to(dtype).to(tl.float32) * glu
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_out_row + offs_n[None, :]
        tl.store(out_ptrs, h.to(dtype), mask=out_mask)
    else:
        weight = tl.load(topk_weights_ptr + pairs, mask=valid, other=0.0).to(dtype).to(tl.float32)
        out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_out_row + offs_n[None, :]
        tl.store(out_ptrs, (y * weight[:, None]).to(dtype), mask=out_mask)


@triton.jit
def _moe_sum_kernel(y_ptr, out_ptr, hidden, stride_y_token, stride_out_row, TOP_K: tl.constexpr,
                    BLOCK: tl.constexpr):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # the pairs in the router's order, every run the same
        acc += tl.load(y_ptr + token * stride_y_token + j * hidden + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_out_row + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, block_expert) for topk_ids [T, k]: sorted_pairs [T*k + E*(block_m-1)] int32 holds the pair
    indices (t * k + j) grouped by expert, each expert's run padded to a multiple of block_m with T*k;
    block_expert [that / block_m] int32 is each block's expert, -1 past the last run."""
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    flat_ids = topk_ids.reshape(-1)
    capacity = num_pairs + num_experts * (block_m - 1)  # every expert's padding at its worst
    # bincount would read the largest id back to size its result: a scatter into E counters does not
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    counts.scatter_add_(0, flat_ids.long(), torch.ones(num_pairs, dtype=torch.int32, device=device))
    padded_starts = torch.zeros(num_experts + 1, dtype=torch.int32, device=device)
    torch.cumsum((counts + block_m - 1) // block_m * block_m, dim=0, out=padded_starts[1:])
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    block_expert = torch.full((triton.cdiv(capacity, block_m),), -1, dtype=torch.int32, device=device)
    block = min(1024, triton.next_power_of_2(max(num_pairs, 16)))
    _moe_align_kernel[(num_experts,)](flat_ids, padded_starts, sorted_pairs, block_expert, num_pairs,
                                      BLOCK_M=block_m, BLOCK=block)  # fmt: skip
    return sorted_pairs, block_expert


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    config: MoeBlockConfig | None = None,
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) for x [T, H] -> [T, H] in x's dtype.

    w13 [E, 2I, H] (each expert's gate rows, then its up rows), w2 [E, H, I], in x's dtype; biases [E, 2I] and
    [E, H]; topk_weights [T, k] (float32) and topk_ids [T, k]. config: tile sizes (default: by T * k and E)."""
    _require(x.dim() == 2 and x.stride(-1) == 1, f"x must be [T, H] with contiguous rows, got {tuple(x.shape)} "
             f"strides {x.stride()}")  # fmt: skip
    _require(x.dtype in _DTYPES and w13.dtype == x.dtype and w2.dtype == x.dtype,
             f"x/w13/w2 dtypes {x.dtype}/{w13.dtype}/{w2.dtype}: one of float32, float16, bfloat16")  # fmt: skip
    num_tokens, hidden = x.shape
    num_experts, intermediate = w2.shape[0], w2.shape[2]
    _require(w13.shape == (num_experts, 2 * intermediate, hidden) and w2.shape == (num_experts, hidden, intermediate),
             f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} must be [E, 2I, H] and [E, H, I] with H = {hidden}")
    _require(w13.stride(-1) == 1 and w2.stride(-1) == 1, f"w13/w2 rows must be contiguous, got strides "
             f"{w13.stride()}/{w2.stride()}")  # fmt: skip
    _require(topk_ids.shape == topk_weights.shape and topk_ids.dim() == 2 and topk_ids.shape[0] == num_tokens,
             f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must be [T, k], "
             f"T = {num_tokens}")  # fmt: skip
    _require(activation in _ACTIVATIONS, f"activation {activation!r} is not one of {_ACTIVATIONS}")
    for name, bias, width in (("w13_bias", w13_bias, 2 * intermediate), ("w2_bias", w2_bias, hidden)):
        _require(bias is None or (bias.shape == (num_experts, width) and bias.stride(-1) == 1),
                 f"{name} {None if bias is None else tuple(bias.shape)} must be [{num_experts}, {width}]")
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_pairs == 0:
        return out
    config = config or moe_block_config(num_pairs, num_experts)
    sorted_pairs, block_expert = moe_align(topk_ids, num_experts, config.block_m)
    topk_weights = topk_weights.contiguous()
    h = torch.empty(sorted_pairs.numel(), intermediate, dtype=x.dtype, device=x.device)  # by sorted position
    y = out if top_k == 1 else torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)  # by pair
    shared = dict(
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        UPCAST=x.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1",
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # float32 is for exact comparisons
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    num_blocks = block_expert.numel()
    _moe_gemm_kernel[(num_blocks, triton.cdiv(intermediate, config.block_n))](
        x, w13, x if w13_bias is None else w13_bias, h, sorted_pairs, block_expert, topk_weights,
        num_pairs, top_k, intermediate, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), 0 if w13_bias is None else w13_bias.stride(0),
        h.stride(0), float(swiglu_alpha), float(swiglu_limit),
        GATED=True, ACTIVATION=activation, HAS_BIAS=w13_bias is not None, **shared,
    )  # fmt: skip
    _moe_gemm_kernel[(num_blocks, triton.cdiv(hidden, config.block_n))](
        h, w2, x if w2_bias is None else w2_bias, y, sorted_pairs, block_expert, topk_weights,
        num_pairs, top_k, hidden, intermediate,
        h.stride(0), w2.stride(0), w2.stride(1), 0 if w2_bias is None else w2_bias.stride(0),
        y.stride(0), float(swiglu_alpha), float(swiglu_limit),
        GATED=False, ACTIVATION="none", HAS_BIAS=w2_bias is not None, **shared,  # one down kernel for all
    )  # fmt: skip
    if top_k > 1:
        block = min(1024, triton.next_power_of_2(hidden))
        _moe_sum_kernel[(num_tokens, triton.cdiv(hidden, block))](y, out, hidden, top_k * hidden, out.stride(0),
                                                                   TOP_K=top_k, BLOCK=block)  # fmt: skip
    return out


def fused_moe_layer(layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """fused_moe with a models/layers/moe.FusedMoE's weights and activation."""
    return fused_moe(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, activation=layer.activation,
                     w13_bias=layer.w13_bias, w2_bias=layer.w2_bias, swiglu_alpha=layer.swiglu_alpha,
                     swiglu_limit=layer.swiglu_limit)  # fmt: skip


def _require(condition: bool, message: str) -> None:
    # A failed check is a bug in the caller (the model), not a user error: plain exception, never caught.
    if not condition:
        raise ValueError(f"fused_moe: {message}")
