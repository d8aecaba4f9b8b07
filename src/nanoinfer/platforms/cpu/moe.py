"""The CPU expert method: every MoE layer's expert weights packed once, at load, into csrc/moe.cpp's panels, and the
fused expert op (route, sort the token-expert pairs by expert, one grouped GEMM per projection over all experts,
the weighted sum back into each token), all in one C++ call.

Layers whose weights it does not take (float16, the extension not built) keep their weights and run the reference,
Platform.fused_moe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nanoinfer.platforms.cpu.ops import cpu_ops
from nanoinfer.platforms.cpu.process import release_freed_memory

# csrc/moe.cpp's activation codes
_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "swigluoai": 2}


@dataclass(frozen=True)
class PackedExperts:
    """One MoE layer's experts in csrc/moe.cpp's layout (pack_moe_weights): w13 [E, ceil(I / 8), steps(H), 16 | 32]
    gated panels (8 gate and the 8 matching up columns each), w2 [E, ceil(H / 16), steps(I), 16 | 32]; bfloat16
    panels hold their k-steps in pairs. Biases in float32, or None."""

    w13: torch.Tensor
    w2: torch.Tensor
    b13: torch.Tensor | None
    b2: torch.Tensor | None
    intermediate_size: int

    def tensors(self) -> list[torch.Tensor]:
        """What a step may read (roofline.expert_bytes counts them)."""
        return [t for t in (self.w13, self.w2, self.b13, self.b2) if t is not None]


def pack_experts(layer: nn.Module) -> PackedExperts | None:
    """The layer's experts packed for the fused op, or None where it does not run them."""
    ops, weight = cpu_ops(), layer.w13_weight
    if (ops is None or weight.dtype not in (torch.float32, torch.bfloat16) or weight.device.type != "cpu"
            or layer.activation not in _ACTIVATIONS):  # fmt: skip
        return None

    def bias(b: torch.Tensor | None) -> torch.Tensor | None:
        return None if b is None else b.detach().float().contiguous()

    w13 = ops.pack_moe_weights(weight.detach(), True)
    w2 = ops.pack_moe_weights(layer.w2_weight.detach(), False)
    return PackedExperts(w13, w2, bias(layer.w13_bias), bias(layer.w2_bias), layer.intermediate_size)


def prepack_experts(model: nn.Module) -> int:
    """Pack the experts of every module multiplying through the platform's expert method (`packed_experts`), then
    release their weights, as linear.prepack_linear_weights does: the packed copy is the only one a step reads.
    Returns how many layers were packed."""
    packed = 0
    for module in model.modules():
        if not getattr(module, "uses_expert_method", False):
            continue
        module.packed_experts = pack_experts(module)
        if module.packed_experts is None:
            continue
        for param in (module.w13_weight, module.w2_weight):
            param.data = torch.empty(0, dtype=param.dtype)
        release_freed_memory()  # layer by layer: the model's experts are never held twice
        packed += 1
    return packed


def fused_moe(layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor | None:  # fmt: skip
    """Platform.fused_moe through the packed experts, or None where the layer has none (the caller then runs the
    reference)."""
    packed = getattr(layer, "packed_experts", None)
    if packed is None:
        return None
    shape = x.shape
    out = cpu_ops().fused_moe(
        x.reshape(-1, shape[-1]), topk_ids.reshape(-1, topk_ids.shape[-1]).long(),
        topk_weights.reshape(-1, topk_weights.shape[-1]).float(), packed.w13, packed.w2, packed.b13, packed.b2,
        packed.intermediate_size, _ACTIVATIONS[layer.activation], layer.swiglu_alpha, layer.swiglu_limit,
    )  # fmt: skip
    return out.view(shape)
