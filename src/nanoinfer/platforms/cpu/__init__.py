"""The CPU platforms: CpuPlatform (plain torch ops, CPU process set-up, the lazily committed KV cache, sizing from
RAM) and CpuKernelPlatform, the same with nanoinfer's C++ kernels (ops.py) wherever they take the call.

Each kernel op checks what its kernel needs (dtype, layout) and otherwise calls the plain-torch op it
overrides; in float32 and bfloat16 the kernels round where the torch ops do (csrc/fused_ops.cpp).
"""

from __future__ import annotations

import torch

from nanoinfer.platforms.cpu import gated_delta as cpu_gated_delta
from nanoinfer.platforms.cpu import linear as cpu_linear
from nanoinfer.platforms.cpu import moe as cpu_moe
from nanoinfer.platforms.cpu.kv_cache import LazyKVCache, on_ordinary_pages
from nanoinfer.platforms.cpu.ops import cpu_ops_for
from nanoinfer.platforms.cpu.process import setup_process
from nanoinfer.platforms.interface import Platform

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class CpuPlatform(Platform):
    name = "cpu-torch"
    # The MLP of a long prefill runs at most this many bytes of [rows, 2 x intermediate] activations at a time,
    # which bounds the step's peak for wide MLPs; large, since freed blocks stay in the heap (process.py) and
    # smaller chunks only cost more GEMM calls (benchmarks/README.md).
    mlp_chunk_bytes = 256 << 20

    def setup_process(self, config, num_threads: int | None = None) -> None:
        setup_process(num_threads or config.num_threads)

    def describe(self) -> dict:
        cpu, flags = super().describe()["cpu"], []
        try:
            with open("/proc/cpuinfo") as f:
                first_cpu = f.read().split("\n\n")[0].splitlines()
            fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in first_cpu if ":" in line)}
            cpu, flags = fields.get("model name", cpu), fields.get("flags", "").split()
        except OSError:
            pass
        return {"cpu": cpu, "platform_kind": self.name,
                "cpu_features": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags],
                "cpu_kernels": self.kernels_description()}  # fmt: skip

    def kernels_description(self) -> str:
        return "off (torch ops)"

    def build_runner(self, config, block_bytes: int, make_runner, state_slot_bytes: int = 0):
        from nanoinfer import memory

        plan = memory.plan_cpu_kv_cache(config, block_bytes, state_slot_bytes)
        memory.check_fits(plan, config.max_model_len)
        return make_runner(config, plan.num_blocks, plan.num_state_slots), plan

    def allocate_kv_cache(self, shapes, dtype: torch.dtype, device: torch.device) -> LazyKVCache:
        return LazyKVCache(shapes, dtype)

    def allocate_state_cache(self, shapes, conv_dtype: torch.dtype, device: torch.device):
        """Uncommitted, like the KV cache: a slot's memory is committed when its first sequence writes it whole,
        so resident memory grows with the slots in use, not with the budget."""
        return [(on_ordinary_pages(conv, conv_dtype), on_ordinary_pages(ssm, torch.float32)) for conv, ssm in shapes]


class CpuKernelPlatform(CpuPlatform):
    name = "cpu"
    reads_q4_blocks = True

    def __init__(self, ops):
        self.ops = ops  # the compiled extension (ops.py)

    def kernels_description(self) -> str:
        return getattr(self.ops, "simd", "built")

    def prepare_model(self, model) -> int:
        return cpu_linear.prepack_linear_weights(model) + cpu_moe.prepack_experts(model)

    def rms_norm(self, x, weight, eps, residual=None):
        if x.dtype in _KERNEL_DTYPES and weight.dtype == x.dtype:
            if residual is None:
                return self.ops.rms_norm(x, weight, eps)
            if x.is_contiguous() and residual.is_contiguous():
                self.ops.fused_add_rms_norm(x, residual, weight, eps)  # x := norm, residual := sum, in place
                return x, residual
        return super().rms_norm(x, weight, eps, residual)

    def silu_and_mul(self, x):
        if x.dtype in _KERNEL_DTYPES and x.dim() == 2 and x.is_contiguous():
            return self.ops.silu_and_mul(x)
        return super().silu_and_mul(x)

    def rotary_embedding(self, positions, q, k, cos, sin):
        if q.dtype in _KERNEL_DTYPES and q.stride(-1) == 1 and k.stride(-1) == 1 and cos.device == q.device:
            self.ops.rotary_embedding(positions, q, k, cos, sin)  # in place
            return q, k
        return super().rotary_embedding(positions, q, k, cos, sin)

    def argmax(self, logits):
        # The C++ argmax is many times faster than torch's here, with the same first-index tie rule.
        if logits.dtype in _KERNEL_DTYPES and logits.dim() == 2 and logits.shape[1] > 0:
            return self.ops.greedy_argmax(logits)
        return super().argmax(logits)

    def linear(self, layer, x, bias):
        return cpu_linear.linear(x, layer.weight, bias, getattr(layer, "packed_weight", None))

    def silu_and_mul_linear(self, layer, x):
        packed = getattr(layer, "packed_weight", None)
        if packed is not None and packed.gated:
            return cpu_linear.gated_linear(x, packed)
        return super().silu_and_mul_linear(layer, x)

    def fused_moe(self, layer, x, topk_weights, topk_ids):
        out = cpu_moe.fused_moe(layer, x, topk_weights, topk_ids)
        return out if out is not None else super().fused_moe(layer, x, topk_weights, topk_ids)

    def add_lora(self, y, x, lora_a, lora_b, row_slots, slice_offsets):
        # csrc/lora.cpp: every adapter's rows of the step in one call (grouped by slot inside, both products tiled)
        dtype = x.dtype
        if (dtype in _KERNEL_DTYPES and y.dtype == lora_a.dtype == lora_b.dtype == dtype and x.dim() == y.dim() == 2
                and x.stride(-1) == 1 and y.stride(-1) == 1 and lora_a.is_contiguous() and lora_b.is_contiguous()
                and row_slots.dtype == torch.int32 and row_slots.is_contiguous()
                and slice_offsets[0] == 0 and slice_offsets[-1] == y.shape[1]):  # fmt: skip
            self.ops.add_lora(y, x, lora_a, lora_b, row_slots, list(slice_offsets))
            return
        super().add_lora(y, x, lora_a, lora_b, row_slots, slice_offsets)

    # Linear attention through csrc/gated_delta.cpp (decode and prefill kernels), the reference where they do not apply
    def causal_conv1d(self, x, weight, conv_state, metadata):
        out = cpu_gated_delta.causal_conv1d(x, weight, conv_state, metadata)
        return out if out is not None else super().causal_conv1d(x, weight, conv_state, metadata)

    def gated_delta_rule(self, q, k, v, g, beta, ssm_state, metadata):
        out = cpu_gated_delta.gated_delta_rule(q, k, v, g, beta, ssm_state, metadata)
        return out if out is not None else super().gated_delta_rule(q, k, v, g, beta, ssm_state, metadata)

    def has_greedy_lm_head(self, lm_head) -> bool:
        return cpu_linear.has_greedy_kernel(lm_head)

    def greedy_token_ids(self, lm_head, hidden_states):
        return cpu_linear.greedy_token_ids(lm_head, hidden_states)

    def attention_backend(self, name: str):
        from nanoinfer.platforms.cpu.attention import CpuAttentionBackend

        return CpuAttentionBackend(self.ops)

    def decode_runner(self, model, kv_caches, backend):
        from nanoinfer.platforms.cpu.decode_runner import FusedDecode

        return FusedDecode(model, kv_caches, self.ops) if FusedDecode.applies(model, kv_caches, backend) else None


def cpu_platform(cpu_kernels: str) -> CpuPlatform:
    """The C++ kernels' platform when `cpu_kernels` (Config's: auto | wait | off) gets them, else plain torch."""
    ops = cpu_ops_for(cpu_kernels)
    return CpuKernelPlatform(ops) if ops is not None else CpuPlatform()
