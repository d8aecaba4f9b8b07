"""Triton kernels for linear attention's two state-carrying ops (oracle: attention/gated_delta.py, which also
defines the state cache's layout and the metadata read here):
- causal_conv1d: one program per (sequence, block of channels) walks the sequence's rows in blocks, reading the
  K - 1 inputs before its first row from its conv_state slot (zeros without context), and at the end writes the
  last K - 1 inputs back. Reads and writes of a slot stay in one program, so one launch serves a decode step
  and a prefill step alike.
- gated_delta_rule: the single-token sequences of a step (all of a decode step) go through
  fused_recurrent_gated_delta_rule, one program per (sequence, value head, block of D_v) holding its part of the
  state S in registers; the longer ones through flash-linear-attention's chunked kernels when that package is
  installed, else through the reference's chunked form, sequence by sequence.
Neither the conv launch nor the recurrent one reads a value back to the host (grids come from shapes and
max_query_len, a host int), so a CUDA graph captures a decode step; only the prefill part reads the host lists.
"""

from __future__ import annotations

import functools
import itertools
import logging
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from nanoinfer.attention import gated_delta as reference

logger = logging.getLogger("nanoinfer")

L2NORM_EPS = tl.constexpr(1e-6)  # inside the rsqrt, as attention/gated_delta.py l2norm
FLA_MIN_VERSION = (0, 5)  # the first flash-linear-attention whose chunked kernel takes more value heads than key heads


@triton.jit
def _causal_conv1d_kernel(
    x_ptr, weight_ptr, conv_state_ptr, out_ptr, query_start_loc_ptr, seq_lens_ptr, state_slots_ptr,
    channels, stride_x_row, stride_w_channel, stride_state_slot, stride_state_channel, stride_out_row,
    WIDTH: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_STATE: tl.constexpr,  # next_power_of_2(WIDTH - 1): the state's columns
):
    seq = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = offs_c < channels
    start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - start
    slot = tl.load(state_slots_ptr + seq)
    # Channel masks: a padded row (slot < 0) reads nothing, so its output is silu(0) = 0, and writes no state;
    # without context the window starts at zeros. (tl.where: the interpreter mistypes a block & a scalar.)
    c_live = tl.where(slot >= 0, c_mask, False)
    c_state = tl.where(tl.load(seq_lens_ptr + seq) > query_len, c_live, False)
    state_dtype = conv_state_ptr.dtype.element_ty
    w_dtype = weight_ptr.dtype.element_ty
    state_row = conv_state_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_state_slot + offs_c * stride_state_channel
    x_rows = x_ptr + start.to(tl.int64) * stride_x_row

    for t_start in range(0, query_len, BLOCK_T):
        offs_t = t_start + tl.arange(0, BLOCK_T)  # rows within the sequence
        t_mask = offs_t < query_len
        acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for j in tl.static_range(WIDTH):
            pos = offs_t - (WIDTH - 1) + j  # the input this tap reads: a row, or (negative) a state column
            in_x = (pos >= 0)[:, None]
            x = tl.load(x_rows + pos.to(tl.int64)[:, None] * stride_x_row + offs_c[None, :],
                        mask=t_mask[:, None] & in_x & c_live[None, :], other=0.0)  # fmt: skip
            before = tl.load(state_row[None, :] + (pos + WIDTH - 1)[:, None],
                             mask=t_mask[:, None] & ~in_x & c_state[None, :], other=0.0)  # fmt: skip
            window = x.to(state_dtype).to(tl.float32) + before.to(tl.float32)  # one of the two is 0
            w = tl.load(weight_ptr + offs_c * stride_w_channel + j, mask=c_mask, other=0.0)
            acc += window * w.to(tl.float32)[None, :]
        # The reference's roundings: the convolution in the weight's dtype, silu in it too, then x's dtype.
        y = acc.to(w_dtype).to(tl.float32)
        if SILU:
            y = (y / (1.0 + tl.exp(-y))).to(w_dtype).to(tl.float32)
        out_ptrs = out_ptr + (start + offs_t).to(tl.int64)[:, None] * stride_out_row + offs_c[None, :]
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & c_mask[None, :])

    # The state keeps the last WIDTH - 1 inputs: rows of x, or (a sequence shorter than that) older state.
    # No other program owns these channels of this slot, but within this one the loop's reads of the old state
    # and the write below fall to different threads (different layouts): the barrier orders them.
    offs_s = tl.arange(0, BLOCK_STATE)
    pos = query_len - (WIDTH - 1) + offs_s
    s_mask = (offs_s < WIDTH - 1)[None, :]
    in_x = (pos >= 0)[None, :]
    x = tl.load(x_rows + pos.to(tl.int64)[None, :] * stride_x_row + offs_c[:, None],
                mask=s_mask & in_x & c_live[:, None], other=0.0)  # fmt: skip
    before = tl.load(state_row[:, None] + (pos + WIDTH - 1)[None, :], mask=s_mask & ~in_x & c_state[:, None],
                     other=0.0)  # fmt: skip
    kept = x.to(state_dtype).to(tl.float32) + before.to(tl.float32)  # one of the two is 0: exact
    tl.debug_barrier()
    tl.store(state_row[:, None] + offs_s[None, :], kept.to(state_dtype), mask=s_mask & c_live[:, None])


@triton.jit
def _fused_recurrent_gated_delta_rule_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, ssm_state_ptr, out_ptr, query_start_loc_ptr, seq_lens_ptr, state_slots_ptr,
    scale, k_dim, v_dim,
    stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_v_row, stride_v_head,
    stride_g_row, stride_g_head, stride_beta_row, stride_beta_head,
    stride_state_slot, stride_state_head, stride_state_k, stride_out_row, stride_out_head,
    HEAD_GROUP: tl.constexpr,  # value heads per key head
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)  # the value head
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_mask = offs_v < v_dim
    row = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) - row != 1:  # a longer sequence of a mixed step: the chunked path
        return
    row = row.to(tl.int64)
    out_ptrs = out_ptr + row * stride_out_row + head * stride_out_head + offs_v
    slot = tl.load(state_slots_ptr + seq)
    if slot < 0:  # a padded row of a CUDA graph: zeros out, no state touched
        tl.store(out_ptrs, tl.zeros((BLOCK_V,), dtype=out_ptr.dtype.element_ty), mask=v_mask)
        return
    with_state = tl.load(seq_lens_ptr + seq) > 1  # without context the sequence starts from S = 0

    offs_k = tl.arange(0, BLOCK_K)
    k_mask = offs_k < k_dim
    k_head = head // HEAD_GROUP
    q = tl.load(q_ptr + row * stride_q_row + k_head * stride_q_head + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row * stride_k_row + k_head * stride_k_head + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + L2NORM_EPS)
    q = q * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + L2NORM_EPS)
    v = tl.load(v_ptr + row * stride_v_row + head * stride_v_head + offs_v, mask=v_mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_g_row + head * stride_g_head).to(tl.float32)
    beta = tl.load(beta_ptr + row * stride_beta_row + head * stride_beta_head).to(tl.float32)

    state_ptrs = (ssm_state_ptr + slot.to(tl.int64) * stride_state_slot + head * stride_state_head
                  + offs_k[:, None] * stride_state_k + offs_v[None, :])  # fmt: skip
    s_mask = k_mask[:, None] & v_mask[None, :]
    state = tl.load(state_ptrs, mask=tl.where(with_state, s_mask, False), other=0.0)  # S [D_k, BLOCK_V]
    state = state * tl.exp(g)
    delta = (v - tl.sum(state * k[:, None], axis=0)) * beta  # beta (v - S^T k)
    state = state + k[:, None] * delta[None, :]
    out = tl.sum(state * q[:, None], axis=0)  # S^T q
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=v_mask)
    tl.store(state_ptrs, state, mask=s_mask)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, metadata,
                  activation: str | None = "silu") -> torch.Tensor:  # fmt: skip
    """reference.causal_conv1d in one launch for any step: x [T, C] (rows contiguous; a view of a wider
    projection is fine), weight [C, K], conv_state [num_slots, C, K - 1]. Returns [T, C] in x's dtype."""
    channels, width = weight.shape
    _require(x.dim() == 2 and x.shape[1] == channels and x.stride(-1) == 1,
             f"x {tuple(x.shape)} strides {x.stride()} must be [T, {channels}] with contiguous rows")  # fmt: skip
    _require(weight.stride(-1) == 1 and width >= 2,
             f"weight {tuple(weight.shape)} must be [C, K >= 2] with contiguous rows")  # fmt: skip
    _require(conv_state.dim() == 3 and conv_state.shape[1:] == (channels, width - 1) and conv_state.stride(-1) == 1,
             f"conv_state {tuple(conv_state.shape)} must be [num_slots, {channels}, {width - 1}]")  # fmt: skip
    _require(activation in ("silu", None), f"activation {activation!r}: silu or None")
    _check_metadata(metadata)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_seqs = metadata.state_slots.shape[0]
    if num_seqs == 0:
        return out
    # Decode rows are one token: a wide block of channels each. Prefill walks rows in blocks (tiles that
    # compile for sm_90 without spilling registers: testing/triton_compile.py prints the usage).
    block_t = min(16 if x.element_size() <= 2 else 8, triton.next_power_of_2(max(metadata.max_query_len, 1)))
    block_c = 256 if block_t == 1 else 64
    _causal_conv1d_kernel[(num_seqs, triton.cdiv(channels, block_c))](
        x, weight, conv_state, out, metadata.query_start_loc, metadata.seq_lens, metadata.state_slots,
        channels, x.stride(0), weight.stride(0), conv_state.stride(0), conv_state.stride(1), out.stride(0),
        WIDTH=width, SILU=activation == "silu", BLOCK_T=block_t, BLOCK_C=block_c,
        BLOCK_STATE=triton.next_power_of_2(width - 1),
    )  # fmt: skip
    return out


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     ssm_state: torch.Tensor, metadata) -> torch.Tensor:  # fmt: skip
    """reference.gated_delta_rule: single-token sequences through the recurrent kernel (no host reads, so a
    decode step is graph-capturable), the others (only when max_query_len > 1) through prefill_gated_delta_rule."""
    num_tokens, num_k_heads, k_dim = q.shape
    num_v_heads, v_dim = v.shape[1], v.shape[2]
    _require(k.shape == q.shape and v.shape[0] == num_tokens and num_v_heads % num_k_heads == 0,
             f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: q and k [T, H_k, D_k], "
             f"v [T, H_v, D_v] with H_v a multiple of H_k")  # fmt: skip
    _require(g.shape == (num_tokens, num_v_heads) and beta.shape == g.shape,
             f"g {tuple(g.shape)} and beta {tuple(beta.shape)} must be [{num_tokens}, {num_v_heads}]")
    _require(all(t.stride(-1) == 1 for t in (q, k, v)), "q, k and v need contiguous heads")
    _require(ssm_state.dim() == 4 and ssm_state.shape[1:] == (num_v_heads, k_dim, v_dim)
             and ssm_state.dtype == torch.float32 and ssm_state.stride(-1) == 1,
             f"ssm_state {tuple(ssm_state.shape)} {ssm_state.dtype} must be float32 "
             f"[num_slots, {num_v_heads}, {k_dim}, {v_dim}]")  # fmt: skip
    _check_metadata(metadata)
    prefill = metadata.max_query_len > 1
    # A longer sequence whose slot is negative is written by neither path: zeros, as the reference's.
    out = (torch.zeros if prefill else torch.empty)(v.shape, dtype=v.dtype, device=v.device)
    fused_recurrent_gated_delta_rule(q, k, v, g, beta, ssm_state, metadata, out)
    if prefill:
        prefill_gated_delta_rule(q, k, v, g, beta, ssm_state, metadata, out)
    return out


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, ssm_state, metadata, out: torch.Tensor) -> None:
    """The rule for every sequence of one token, into out [T, H_v, D_v]; programs of longer sequences exit."""
    num_seqs = metadata.state_slots.shape[0]
    if num_seqs == 0:
        return
    num_k_heads, k_dim = q.shape[1], q.shape[2]
    num_v_heads, v_dim = v.shape[1], v.shape[2]
    # Small blocks of D_v give a small batch many programs; 16 x D_k 128 on 4 warps compiles without spills.
    block_v = min(16, triton.next_power_of_2(v_dim))
    _fused_recurrent_gated_delta_rule_kernel[(num_seqs, num_v_heads, triton.cdiv(v_dim, block_v))](
        q, k, v, g, beta, ssm_state, out, metadata.query_start_loc, metadata.seq_lens, metadata.state_slots,
        float(k_dim**-0.5), k_dim, v_dim,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2), out.stride(0), out.stride(1),
        HEAD_GROUP=num_v_heads // num_k_heads, BLOCK_K=triton.next_power_of_2(k_dim), BLOCK_V=block_v,
        num_warps=4,
    )  # fmt: skip


def prefill_gated_delta_rule(q, k, v, g, beta, ssm_state, metadata, out: torch.Tensor) -> None:
    """The rule for every sequence of more than one token (host lists required), into its rows of out."""
    slots = metadata.state_slots.tolist()
    chosen = [(start, rows, has_context, slot) for (start, rows, has_context), slot
              in zip(reference.sequence_spans(metadata), slots) if rows > 1 and slot >= 0]  # fmt: skip
    if not chosen:
        return
    if len(chosen) == len(slots):  # a step of prompts only: every row, in order
        rows_of = slice(None)
    else:
        rows_of = torch.cat([torch.arange(start, start + rows) for start, rows, _, _ in chosen]).to(q.device)
    lens = [rows for _, rows, _, _ in chosen]
    has_context = [has for _, _, has, _ in chosen]
    slots = [slot for _, _, _, slot in chosen]
    args = (q[rows_of], k[rows_of], v[rows_of], g[rows_of], beta[rows_of])
    chunk = fla_chunk_gated_delta_rule()
    if chunk is not None:
        o = _fla_prefill(chunk, *args, ssm_state, lens, has_context, slots)
    else:
        subset = SimpleNamespace(state_slots=torch.tensor(slots, dtype=torch.int32),
                                 query_lens_cpu=lens, seq_lens_cpu=[n + has for n, has in zip(lens, has_context)])
        o = reference.gated_delta_rule(*args, ssm_state, subset)
    out[rows_of] = o.to(out.dtype)


def _fla_prefill(chunk, q, k, v, g, beta, ssm_state, lens, has_context, slots) -> torch.Tensor:
    """flash-linear-attention's varlen chunked rule: sequences back to back in one batch row, cu_seqlens, and one
    initial state each (gathered from the slots, zeros without context); final states scattered back."""
    device = q.device
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.long, device=device)
    slot_index = torch.tensor(slots, dtype=torch.long, device=device)
    keep = torch.tensor(has_context, dtype=torch.bool, device=device)[:, None, None, None]
    initial_state = torch.where(keep, ssm_state[slot_index], 0.0)  # where, not *: a never-written slot may hold NaN
    o, final_state = chunk(q[None], k[None], v[None], g[None].float(), beta[None], scale=q.shape[-1] ** -0.5,
                           initial_state=initial_state, output_final_state=True, cu_seqlens=cu_seqlens,
                           use_qk_l2norm_in_kernel=True)  # fmt: skip
    ssm_state[slot_index] = final_state.to(ssm_state.dtype)
    return o[0]


@functools.cache
def fla_chunk_gated_delta_rule():
    """flash-linear-attention's chunk_gated_delta_rule when a version that takes H_v > H_k is installed, else None
    (the reference's chunked form runs instead). Imported on first use: the package is optional."""
    try:
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:  # not installed, or it does not import here: the reference path, said once
        logger.info("flash-linear-attention unavailable (%s): prefill of linear attention takes the chunked torch "
                    "path.", type(e).__name__)  # fmt: skip
        return None
    version = tuple(int(part) for part in itertools.takewhile(str.isdigit, fla.__version__.split(".")[:2]))
    if version < FLA_MIN_VERSION:
        logger.warning("flash-linear-attention %s is older than %s: prefill of linear attention takes the chunked "
                       "torch path.", fla.__version__, ".".join(map(str, FLA_MIN_VERSION)))  # fmt: skip
        return None
    return chunk_gated_delta_rule


def _check_metadata(metadata) -> None:
    slots = metadata.state_slots
    _require(slots is not None and slots.dtype == torch.int32 and slots.shape == metadata.seq_lens.shape,
             "metadata.state_slots must be int32 [num_seqs]")  # fmt: skip
    _require(metadata.query_start_loc.dtype == torch.int32 and metadata.seq_lens.dtype == torch.int32,
             "metadata.query_start_loc and seq_lens must be int32")


def _require(condition: bool, message: str) -> None:
    # A failed check is a bug in the caller (the model), not a user error: plain exception, never caught.
    if not condition:
        raise ValueError(f"gated_delta: {message}")
