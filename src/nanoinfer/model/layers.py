"""Shared building blocks: RMSNorm, rotary embedding, gated MLP activation, vocab-parallel embedding/head.

Numerics follow Hugging Face's implementations (norm in float32, rotary tables from transformers' own
rope initialisers) so greedy output matches token for token in float32.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.distributed import all_gather_last_dim, all_reduce, get_tp_rank, get_tp_size
from nanoinfer.platforms.cpu.linear import GreedyLMHead, PackedWeight, linear
from nanoinfer.platforms.cpu.ops import cpu_ops

logger = logging.getLogger("nanoinfer")


def _fused_ops(x: torch.Tensor):
    """The C++ CPU kernels when they apply to x (float32 or bfloat16 on CPU, the kernels built), else None.
    In bfloat16 they round where the torch ops below do (csrc/fused_ops.cpp)."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    return cpu_ops()


def _triton_ops(x: torch.Tensor):
    """The Triton small-op kernels (kernels/fused_ops.py) for 16-bit x on CUDA, else None. float32 keeps torch's
    ops, whose exact roundings the float32 comparison with transformers relies on."""
    if x.device.type != "cuda" or x.dtype not in (torch.bfloat16, torch.float16) or not _TRITON_SMALL_OPS:
        return None
    from nanoinfer.platforms.cuda.kernels import fused_ops

    return fused_ops


# NANOINFER_TORCH_SMALL_OPS=1 runs RMSNorm, rotary and SiLU-and-mul through torch on CUDA too (to compare).
_TRITON_SMALL_OPS = (
    os.environ.get("NANOINFER_TORCH_SMALL_OPS") != "1" and importlib.util.find_spec("triton") is not None
)


def enable_triton_small_ops(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the model's small ops run through the Triton kernels on this device and dtype. The first time on
    CUDA, each kernel is compiled and run once on a tiny input; if that fails (a Triton or driver this code
    was not tried with), torch's ops stay in use for the whole process, with one warning, instead of the
    engine failing to start."""
    global _TRITON_SMALL_OPS
    if not _TRITON_SMALL_OPS or device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    problem = check_small_ops(device, dtype)
    if problem is not None:
        _TRITON_SMALL_OPS = False
        logger.warning("Triton small-op kernels unavailable (%s); using torch's ops.", problem)
    return problem is None


def check_small_ops(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Run each small-op kernel once on a tiny input: None when all ran, else the first error, in one line."""
    try:
        from nanoinfer.platforms.cuda.kernels import fused_ops

        x = torch.randn(2, 3, 64, device=device).to(dtype)
        weight = torch.ones(64, device=device, dtype=dtype)
        table = torch.ones(4, 64, device=device)
        fused_ops.rms_norm(x, weight, 1e-6)
        fused_ops.rms_norm(x[:, 0], weight, 1e-6, x[:, 1].contiguous())
        fused_ops.silu_and_mul(x[:, 0])
        fused_ops.rotary_embedding(torch.zeros(2, dtype=torch.long, device=device), x, x[:, :1], table, table)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # any failure means: do not use them; the message says why
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x) or, with a residual, (norm(x + residual), x + residual): the fused pre-norm step.

        On CPU in float32 one C++ pass does it, and the fused form overwrites both inputs (x with the
        norm, residual with the sum): the decoder layer owns them and reads neither afterwards."""
        ops = _fused_ops(x)
        if ops is not None and self.weight.dtype == x.dtype:
            if residual is None:
                return ops.rms_norm(x, self.weight, self.eps)
            if x.is_contiguous() and residual.is_contiguous():
                ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
                return x, residual
        triton_ops = _triton_ops(x)
        if triton_ops is not None and x.stride(-1) == 1 and self.weight.dtype == x.dtype:
            if residual is None or (x.dim() == 2 and residual.stride(-1) == 1):
                return triton_ops.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    ops = _fused_ops(x)
    if ops is not None and x.dim() == 2 and x.is_contiguous():
        return ops.silu_and_mul(x)
    triton_ops = _triton_ops(x)
    if triton_ops is not None and x.dim() == 2 and x.stride(-1) == 1:
        return triton_ops.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class RotaryEmbedding(nn.Module):
    """cos/sin tables indexed by position; the inverse frequencies come from transformers' rope initialisers
    so every rope_type it knows (default, llama3, linear, yarn, ...) matches it exactly."""

    def __init__(self, hf_config, head_dim: int, max_position: int):
        super().__init__()
        inv_freq, scaling = _rope_inv_freq(hf_config, head_dim)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_position, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        # Plain attributes, not buffers: model.to(bfloat16) must not round the tables (HF keeps them float32).
        self.cos = emb.cos() * scaling
        self.sin = emb.sin() * scaling

    def to_device(self, device: torch.device) -> None:
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, H, D], k [T, H_kv, D] -> rotated (on CPU in float32: rotated in place, one C++ pass)."""
        ops = _fused_ops(q)
        if ops is not None and q.stride(-1) == 1 and k.stride(-1) == 1 and self.cos.device == q.device:
            ops.rotary_embedding(positions, q, k, self.cos, self.sin)
            return q, k
        triton_ops = _triton_ops(q)
        if triton_ops is not None and q.stride(-1) == 1 and k.stride(-1) == 1 and self.cos.device == q.device:
            return triton_ops.rotary_embedding(positions, q, k, self.cos, self.sin)
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_inv_freq(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # scaled rotary: transformers' formulas

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; each rank embeds its ids and the results are summed."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // self.tp_size)
        self.start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.zeros(self.shard_size, hidden_size))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None):
        rows = loaded[self.start : self.start + self.shard_size]
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        in_shard = (local >= 0) & (local < self.shard_size)
        out = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * in_shard.unsqueeze(-1)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> logits over the full vocabulary, in the model's dtype (each rank computes its
    vocabulary shard). Not widened to float32 here: greedy rows take their argmax from the bfloat16 logits
    as they are (the widening is exact and order-preserving), and the sampler widens the rest itself: a
    widening copy of every row would cost each step a pass over all the logits."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__(vocab_size, hidden_size)
        self.packed_weight: PackedWeight | None = None  # set by cpu_gemm.prepack_linear_weights
        self.greedy_from_bfloat16 = self.tp_size == 1  # may prepack_linear_weights add `greedy_head`?
        self.greedy_head: GreedyLMHead | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden_states, self.weight, None, self.packed_weight)
        if self.tp_size > 1:
            logits = all_gather_last_dim(logits)[..., : self.vocab_size]
        return logits

    @property
    def has_greedy_kernel(self) -> bool:
        """Does greedy_token_ids skip writing the logits here? float32 with its bfloat16 copy (greedy_head), or
        bfloat16 packed for AMX (the argmax taken in the GEMM's epilogue)."""
        packed = self.packed_weight
        return self.greedy_head is not None or (packed is not None and packed.kind == "amx" and self.tp_size == 1)

    def greedy_token_ids(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The argmax of forward(hidden_states) a row (the first index on a tie), without the logits where a
        kernel allows: float32 from the bfloat16 copy (a CPU with AMX), the same tokens without the float32
        product; bfloat16 on AMX from the GEMM's sums as they are rounded, never stored."""
        head, packed = self.greedy_head, self.packed_weight
        on_cpu = hidden_states.device.type == "cpu" and hidden_states.dim() == 2
        if on_cpu and head is not None and hidden_states.dtype == torch.float32:
            token_ids = cpu_ops().greedy_lm_head(
                hidden_states, head.amx_packed, head.weight_norms, packed.data, packed.out_features
            )
        elif on_cpu and self.has_greedy_kernel and hidden_states.dtype == torch.bfloat16:
            token_ids = cpu_ops().amx_greedy_argmax(hidden_states, packed.data, packed.out_features)
        else:
            return torch.argmax(self(hidden_states), dim=-1)
        full = (token_ids < 0).nonzero().flatten()  # rows whose hidden state or bfloat16 logits are not finite
        if len(full):
            token_ids[full] = torch.argmax(self(hidden_states[full]), dim=-1)
        return token_ids
