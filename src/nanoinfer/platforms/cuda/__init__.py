"""The CUDA platform: Triton small-op kernels for 16-bit models (kernels/fused_ops.py), the experts of MoE models
(kernels/fused_moe.py), the flash-attn and Triton attention backends, decode through CUDA graphs, and a KV cache
sized from what a warm-up pass measured.

float32 keeps torch's small ops, whose exact roundings the float32 comparison with transformers relies on.
NANOINFER_TORCH_SMALL_OPS=1 keeps them in 16-bit too (to compare).
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from nanoinfer.platforms.interface import Platform

logger = logging.getLogger("nanoinfer")
_TRITON_DTYPES = (torch.bfloat16, torch.float16)


class CudaPlatform(Platform):
    name = "cuda"

    def __init__(self, dtype: str = "bfloat16"):
        wanted = os.environ.get("NANOINFER_TORCH_SMALL_OPS") != "1" and importlib.util.find_spec("triton") is not None
        self.triton_small_ops = wanted and dtype in ("bfloat16", "float16")  # until prepare_model tries them
        # The experts run through Triton in every dtype: the reference reads expert counts back to the host,
        # which a CUDA graph cannot capture.
        self.triton_moe = importlib.util.find_spec("triton") is not None
        self.eager_experts = False  # set by prepare_model: experts on the reference path cannot be graph-captured
        # Linear attention's conv and delta rule through Triton (kernels/gated_delta.py): the reference reads the
        # host lists, which a CUDA graph's decode metadata does not carry.
        self.triton_gated_delta = importlib.util.find_spec("triton") is not None
        self.eager_linear_attention = False  # set by prepare_model, as eager_experts

    def prepare_model(self, model) -> int:
        """Compile and run each small-op kernel, and the fused-MoE kernel on a mixture of experts, once on a tiny
        input before the engine relies on them; on a failure (a Triton or driver this code was not tried with)
        torch's ops stay in use, with one warning (the experts' then decode without CUDA graphs: the reference
        reads expert counts back to the host)."""
        if self.triton_small_ops:
            device = next(model.parameters()).device
            problem = check_small_ops(device, next(model.parameters()).dtype)
            if problem is not None:
                self.triton_small_ops = False
                logger.warning("Triton small-op kernels unavailable (%s); using torch's ops.", problem)
        experts = next((m for m in model.modules() if getattr(m, "uses_expert_method", False)), None)
        if experts is not None and self.triton_moe:
            problem = check_fused_moe(experts)
            if problem is not None:
                self.triton_moe = False
                logger.warning("Triton fused-MoE kernel unavailable (%s); the experts run on torch's ops and "
                               "decode without CUDA graphs.", problem)  # fmt: skip
        self.eager_experts = experts is not None and not self.triton_moe
        linear = [m for m in model.modules() if getattr(m, "is_linear_attention", False)]
        if linear and self.triton_gated_delta:
            problem = check_gated_delta(linear[0])
            if problem is not None:
                self.triton_gated_delta = False
                logger.warning("Triton linear-attention kernels unavailable (%s); the linear-attention layers run on "
                               "torch's ops and decode without CUDA graphs.", problem)  # fmt: skip
        self.eager_linear_attention = bool(linear) and not self.triton_gated_delta
        return 0

    def _fused_ops(self, x: torch.Tensor):
        if not self.triton_small_ops or x.dtype not in _TRITON_DTYPES or x.device.type != "cuda":
            return None
        from nanoinfer.platforms.cuda.kernels import fused_ops

        return fused_ops

    def rms_norm(self, x, weight, eps, residual=None):
        ops = self._fused_ops(x)
        if ops is not None and x.stride(-1) == 1 and weight.dtype == x.dtype:
            if residual is None or (x.dim() == 2 and residual.stride(-1) == 1):
                return ops.rms_norm(x, weight, eps, residual)
        return super().rms_norm(x, weight, eps, residual)

    def silu_and_mul(self, x):
        ops = self._fused_ops(x)
        if ops is not None and x.dim() == 2 and x.stride(-1) == 1:
            return ops.silu_and_mul(x)
        return super().silu_and_mul(x)

    def rotary_embedding(self, positions, q, k, cos, sin):
        ops = self._fused_ops(q)
        half = q.shape[-1] // 2  # the Triton kernel tiles half a head: a power of two (Phi-3-mini's 48 is not)
        if (ops is not None and q.stride(-1) == 1 and k.stride(-1) == 1 and cos.device == q.device
                and half & (half - 1) == 0):  # fmt: skip
            return ops.rotary_embedding(positions, q, k, cos, sin)
        return super().rotary_embedding(positions, q, k, cos, sin)

    def fused_moe(self, layer, x, topk_weights, topk_ids):
        if self.triton_moe and x.device.type == "cuda":
            from nanoinfer.platforms.cuda.kernels.fused_moe import fused_moe_layer

            return fused_moe_layer(layer, x, topk_weights, topk_ids)
        return super().fused_moe(layer, x, topk_weights, topk_ids)

    def causal_conv1d(self, x, weight, conv_state, metadata):
        if self.triton_gated_delta and x.device.type == "cuda":
            from nanoinfer.platforms.cuda.kernels import gated_delta

            return gated_delta.causal_conv1d(x, weight, conv_state, metadata)
        return super().causal_conv1d(x, weight, conv_state, metadata)

    def gated_delta_rule(self, q, k, v, g, beta, ssm_state, metadata):
        """Single-token sequences (all of a decode step) through the recurrent kernel, graph-capturable; longer
        ones through flash-linear-attention when installed, else the reference's chunked form."""
        if self.triton_gated_delta and v.device.type == "cuda":
            from nanoinfer.platforms.cuda.kernels import gated_delta

            return gated_delta.gated_delta_rule(q, k, v, g, beta, ssm_state, metadata)
        return super().gated_delta_rule(q, k, v, g, beta, ssm_state, metadata)

    def add_lora(self, y, x, lora_a, lora_b, row_slots, slice_offsets):
        """Through Triton's shrink and expand (kernels/lora.py) in every dtype: the reference reads row_slots back
        to the host, which a CUDA graph cannot capture."""
        if x.device.type == "cuda" and importlib.util.find_spec("triton") is not None:
            from nanoinfer.platforms.cuda.kernels import lora

            return lora.add_lora(y, x, lora_a, lora_b, row_slots, slice_offsets)
        return super().add_lora(y, x, lora_a, lora_b, row_slots, slice_offsets)

    def attention_backend(self, name: str):
        if name == "flash-attn":
            from nanoinfer.platforms.cuda.flash_attn_backend import FlashAttnBackend

            return FlashAttnBackend()
        if name == "triton":
            from nanoinfer.platforms.cuda.triton_backend import TritonBackend

            return TritonBackend()
        return super().attention_backend(name)

    def uses_cuda_graphs(self, config, backend_name: str) -> bool:
        """Decode through CUDA graphs unless enforce_eager, with one rank and a backend whose kernels capture."""
        return (not config.enforce_eager and config.tensor_parallel_size == 1 and not self.eager_experts
                and not self.eager_linear_attention and backend_name in ("triton", "flash-attn"))  # fmt: skip

    def build_runner(self, config, block_bytes: int, make_runner, state_slot_bytes: int = 0):
        from nanoinfer.platforms.cuda.memory_planning import build_cuda_runner

        return build_cuda_runner(config, block_bytes, make_runner, state_slot_bytes)


def one_line(error: Exception) -> str:
    """An exception as "Type: its first line", for a start-up check's one warning."""
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def check_fused_moe(layer) -> str | None:
    """Run the fused-MoE kernel once on two tokens through `layer`'s own experts: None when it ran, else the
    error, in one line."""
    try:
        from nanoinfer.platforms.cuda.kernels.fused_moe import fused_moe_layer

        device, dtype = layer.w13_weight.device, layer.w13_weight.dtype
        x = torch.randn(2, layer.hidden_size, device=device).to(dtype)
        k = min(2, layer.num_experts)
        topk_ids = torch.arange(k, device=device).repeat(2, 1)
        fused_moe_layer(layer, x, torch.full((2, k), 1.0 / k, device=device), topk_ids)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # any failure means: do not use it; the message says why
        return one_line(e)
    return None


def check_gated_delta(layer) -> str | None:
    """Run the linear-attention kernels once, on a decode step of two sequences through `layer`'s own shapes (one
    with context, one without) and scratch state: None when they ran, else the error, in one line."""
    try:
        from nanoinfer.attention.metadata import AttentionMetadata
        from nanoinfer.platforms.cuda.kernels import gated_delta

        device, dtype = layer.conv1d_weight.device, layer.conv1d_weight.dtype
        conv_shape, ssm_shape = layer.state_shapes(2)
        conv_state = torch.zeros(conv_shape, device=device, dtype=dtype)
        ssm_state = torch.zeros(ssm_shape, device=device)
        metadata = AttentionMetadata(
            slot_mapping=torch.zeros(2, dtype=torch.int64, device=device),
            query_start_loc=torch.arange(3, dtype=torch.int32, device=device),
            seq_lens=torch.tensor([5, 1], dtype=torch.int32, device=device),
            block_tables=torch.zeros(2, 1, dtype=torch.int32, device=device), max_query_len=1, max_seq_len=5,
            state_slots=torch.arange(2, dtype=torch.int32, device=device),
        )  # fmt: skip
        mixed = gated_delta.causal_conv1d(torch.randn(2, layer.conv_dim, device=device).to(dtype), layer.conv1d_weight,
                                          conv_state, metadata)  # fmt: skip
        q, k, v = mixed.split([layer.key_size, layer.key_size, layer.value_size], dim=-1)
        heads = torch.rand(2, layer.num_v_heads, device=device)
        gated_delta.gated_delta_rule(q.reshape(2, layer.num_k_heads, -1), k.reshape(2, layer.num_k_heads, -1),
                                     v.reshape(2, layer.num_v_heads, -1), -heads, heads, ssm_state, metadata)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # any failure means: do not use them; the message says why
        return one_line(e)
    return None


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
        return one_line(e)
    return None
