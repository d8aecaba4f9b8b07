"""Triton kernels for the small per-layer ops on CUDA in 16-bit dtypes: (residual add +) RMSNorm, SiLU-and-mul,
rotary embedding. One launch each instead of the 2-14 elementwise kernels torch runs for every op.

Why: a Qwen3-0.6B decode step launches ~55 such small kernels per layer (28 layers) through torch, each a few
microseconds even inside a CUDA graph, next to 4 GEMMs and the attention; fused, ~5 per layer. The oracle is
the torch code in model/layers.py, and every rounding it does is done here too, in the same order (16-bit
results of each op, float32 inside RMSNorm and SiLU), so results agree to the last bit except where a float32
sum is added up in another order. float32 models keep the torch ops: they are for checking against
transformers token for token, where a fused multiply-add could change a last bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, out_ptr, residual_out_ptr, weight_ptr,
    stride_x_row, stride_x_head, stride_r_row, stride_o_row, stride_o_head, stride_ro_row,
    num_heads, n_cols, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x_row + head * stride_x_head + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # x + residual, rounded to the 16-bit dtype as torch's add does; it is also the new residual.
        r = tl.load(residual_ptr + row * stride_r_row + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_ro_row + offs, x, mask=mask)
    h = x.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / n_cols
    normed = (h * tl.rsqrt(variance + eps)).to(x.dtype)  # HF: norm in float32, back to the dtype ...
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)  # ... then times the weight, rounded
    tl.store(out_ptr + row * stride_o_row + head * stride_o_head + offs, out, mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of x [T, N] or [T, H, N] (a strided view of a fused projection is fine);
    with residual [T, N], (norm(x + residual), x + residual). Outputs are new contiguous tensors."""
    _require(x.stride(-1) == 1 and x.dim() in (2, 3), f"x must be [T, N] or [T, H, N] with contiguous rows, got "
             f"{tuple(x.shape)} strides {x.stride()}")  # fmt: skip
    _require(x.dtype in (torch.bfloat16, torch.float16), f"x dtype {x.dtype}: 16-bit only (float32 keeps torch)")
    n_cols = x.shape[-1]
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    num_rows, num_heads = x3.shape[0], x3.shape[1]
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    has_residual = residual is not None
    if has_residual:
        same = residual.shape == x.shape and residual.dtype == x.dtype
        _require(x.dim() == 2 and same and residual.stride(-1) == 1,
                 f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
        residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        residual, residual_out = out, out  # unused by the kernel
    if num_rows:
        _rms_norm_kernel[(num_rows, num_heads)](
            x3, residual, out, residual_out, weight,
            x3.stride(0), x3.stride(1), residual.stride(0), out.stride(0), out.stride(1), residual_out.stride(0),
            num_heads, n_cols, eps, BLOCK=triton.next_power_of_2(n_cols), HAS_RESIDUAL=has_residual,
        )  # fmt: skip
    out = out if x.dim() == 3 else out.squeeze(1)
    return (out, residual_out) if has_residual else out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x_row, stride_o_row, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    gate = tl.load(x_ptr + row * stride_x_row + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x_row + n_cols + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # F.silu: float32 inside, rounded to the dtype
    out = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)  # times up, rounded
    tl.store(out_ptr + row * stride_o_row + offs, out, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for x [T, 2I] -> [T, I]."""
    _require(x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] % 2 == 0, f"x must be [T, 2I], rows contiguous, "
             f"got {tuple(x.shape)} strides {x.stride()}")  # fmt: skip
    _require(x.dtype in (torch.bfloat16, torch.float16), f"x dtype {x.dtype}: 16-bit only (float32 keeps torch)")
    num_rows, n_cols = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_rows, n_cols, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(n_cols))
    if num_rows:
        _silu_and_mul_kernel[(num_rows, triton.cdiv(n_cols, block))](x, out, x.stride(0), out.stride(0), n_cols,
                                                                      BLOCK=block)  # fmt: skip
    return out


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr,
    stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_qo_row, stride_ko_row, stride_cos_row,
    num_q_heads, HALF: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pos = tl.load(positions_ptr + row).to(tl.int64)
    offs = tl.arange(0, HALF)
    if head < num_q_heads:
        src = q_ptr + row * stride_q_row + head * stride_q_head
        dst = q_out_ptr + row * stride_qo_row + head * 2 * HALF
    else:
        src = k_ptr + row * stride_k_row + (head - num_q_heads) * stride_k_head
        dst = k_out_ptr + row * stride_ko_row + (head - num_q_heads) * 2 * HALF
    x1 = tl.load(src + offs)
    x2 = tl.load(src + HALF + offs)
    dtype = x1.dtype
    # The tables are float32; torch's path casts them to the dtype first (cos[positions].to(q.dtype)).
    cos1 = tl.load(cos_ptr + pos * stride_cos_row + offs).to(dtype).to(tl.float32)
    cos2 = tl.load(cos_ptr + pos * stride_cos_row + HALF + offs).to(dtype).to(tl.float32)
    sin1 = tl.load(sin_ptr + pos * stride_cos_row + offs).to(dtype).to(tl.float32)
    sin2 = tl.load(sin_ptr + pos * stride_cos_row + HALF + offs).to(dtype).to(tl.float32)
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    # q * cos + rotate_half(q) * sin with rotate_half(q) = [-q2, q1]: each product and the sum rounded, as in
    # torch's three separate ops (no fused multiply-add across a rounding).
    out1 = ((a1 * cos1).to(dtype).to(tl.float32) + (-a2 * sin1).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((a2 * cos2).to(dtype).to(tl.float32) + (a1 * sin2).to(dtype).to(tl.float32)).to(dtype)
    tl.store(dst + offs, out1)
    tl.store(dst + HALF + offs, out2)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q [T, H, D] and k [T, H_kv, D] (strided views of a fused projection are fine);
    cos/sin [max_position, D] float32 tables, positions [T]."""
    head_dim = q.shape[-1]
    _require(q.dim() == 3 and k.dim() == 3 and k.shape[-1] == head_dim and q.shape[0] == k.shape[0],
             f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, heads, D] with one D")  # fmt: skip
    _require(q.stride(-1) == 1 and k.stride(-1) == 1, "q and k rows must be contiguous in D")
    _require(head_dim % 2 == 0 and (head_dim // 2) & (head_dim // 2 - 1) == 0,
             f"head_dim {head_dim} must be twice a power of two")  # fmt: skip
    _require(q.dtype == k.dtype and q.dtype in (torch.bfloat16, torch.float16),
             f"q/k dtypes {q.dtype}/{k.dtype}: one 16-bit dtype (float32 keeps torch)")  # fmt: skip
    _require(cos.stride(-1) == 1 and cos.stride() == sin.stride(), "cos/sin tables must be alike, rows contiguous")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    num_rows = q.shape[0]
    if num_rows:
        _rotary_kernel[(num_rows, q.shape[1] + k.shape[1])](
            positions, q, k, q_out, k_out, cos, sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), k_out.stride(0), cos.stride(0),
            q.shape[1], HALF=head_dim // 2,
        )  # fmt: skip
    return q_out, k_out


def _require(condition: bool, message: str) -> None:
    # A failed check is a bug in the caller (the model), not a user error: plain exception, never caught.
    if not condition:
        raise ValueError(f"fused_ops: {message}")
