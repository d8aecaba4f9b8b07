"""Every decoder layer of a pure-decode step in one C++ call on CPU (csrc/decode_layers.cpp).

With the kernels at the CPU's compute and bandwidth ceilings, the Python around them (module calls, views,
checks, per layer) was what remained of a decode step outside them (benchmarks/README.md). The C++ loop
calls the same kernels in the same order, so its output is bit for bit the per-layer path's.

It applies only where the per-layer path would call exactly those kernels: on CPU with the kernels built,
float32 with weights packed for our panel GEMM or bfloat16 with weights packed for the AMX GEMM (the MLP's
gated in both), one process (no tensor parallelism), Llama / Qwen2-shaped layers (no Qwen3 q/k norms, no
o_proj or down_proj bias), the torch attention backend with its CPU kernel, and a pure-decode step.
Everything else takes the per-layer path, unchanged.
"""

from __future__ import annotations

import torch

from nanoinfer.attention.metadata import AttentionMetadata
from nanoinfer.attention.torch_backend import _KERNEL_CACHE_DTYPES, TorchBackend
from nanoinfer.platforms.cpu.ops import cpu_ops

# The packed kinds of (qkv, o_proj, gate_up, down_proj) the C++ loop runs, by dtype.
_LINEAR_KINDS = {
    torch.float32: ["panels", "panels", "gated", "panels"],
    torch.bfloat16: ["amx", "amx", "amx_gated", "amx"],
}


class FusedDecode:
    """A model's per-layer tensors in csrc/decode_layers.cpp's order, with the KV caches they go with."""

    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        attn = model.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.scale = attn.scale
        self.eps = model.norm.eps
        self.intermediate_size = model.layers[0].mlp.gate_up_proj.output_sizes[0]
        self.rotary = attn.rotary
        self.amx = attn.qkv_proj.packed_weight.kind == "amx"
        empty = torch.empty(0)
        self.tensors: list[torch.Tensor] = []
        for layer, (k_cache, v_cache) in zip(model.layers, kv_caches):
            a, mlp = layer.self_attn, layer.mlp
            bias = a.qkv_proj.bias.detach() if a.qkv_proj.bias is not None else empty
            self.tensors += [
                layer.input_layernorm.weight.detach(), a.qkv_proj.packed_weight.data, bias,
                a.o_proj.packed_weight.data, layer.post_attention_layernorm.weight.detach(),
                mlp.gate_up_proj.packed_weight.data, mlp.down_proj.packed_weight.data, k_cache, v_cache,
            ]  # fmt: skip
            projections = (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
            for field in ("compact", "compact_amx"):
                for proj in projections:
                    form = getattr(proj.packed_weight, field)
                    self.tensors.append(form if form is not None else empty)

    @staticmethod
    def applies(model, kv_caches) -> bool:
        """Would the per-layer path run exactly csrc/decode_layers.cpp's kernels for this model's decode steps?"""
        ops = cpu_ops()
        if ops is None or len(kv_caches) != len(model.layers) or not model.layers:
            return False
        weight = model.norm.weight
        if weight.device.type != "cpu" or weight.dtype not in _LINEAR_KINDS:
            return False
        expected_kinds = _LINEAR_KINDS[weight.dtype]
        attn0 = model.layers[0].self_attn
        for layer, (k_cache, _) in zip(model.layers, kv_caches):
            a, mlp = layer.self_attn, layer.mlp
            kinds = (a.qkv_proj.packed_weight, a.o_proj.packed_weight, mlp.gate_up_proj.packed_weight,
                     mlp.down_proj.packed_weight)  # fmt: skip
            if any(p is None for p in kinds) or [p.kind for p in kinds] != expected_kinds:
                return False
            if a.qk_norm or a.o_proj.bias is not None or mlp.down_proj.bias is not None:
                return False
            # The layers' own shard count, not get_tp_size(): rank 0 builds its shard under tensor parallelism
            # and then runs it with the process-wide setting back at 1 (a sharded layer all-reduces).
            if a.o_proj.tp_size != 1 or mlp.down_proj.tp_size != 1:
                return False
            if not isinstance(a.backend, TorchBackend) or not a.backend.use_cpu_kernel:
                return False
            if k_cache.dtype not in _KERNEL_CACHE_DTYPES or k_cache.device.type != "cpu":
                return False
            same_shape = (a.num_heads, a.num_kv_heads, a.head_dim, a.scale, a.rotary) == (
                attn0.num_heads, attn0.num_kv_heads, attn0.head_dim, attn0.scale, attn0.rotary
            )
            eps = (layer.input_layernorm.eps, layer.post_attention_layernorm.eps)
            if not same_shape or eps != (model.norm.eps, model.norm.eps):
                return False
        return attn0.rotary.cos.device.type == "cpu"

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata):
        """(hidden, residual) after the last layer, as the per-layer loop returns them."""
        return cpu_ops().decode_layers(
            hidden.contiguous(), positions, metadata.slot_mapping, metadata.block_tables, metadata.seq_lens,
            self.tensors, self.rotary.cos, self.rotary.sin, self.num_heads, self.num_kv_heads, self.head_dim,
            self.intermediate_size, self.eps, self.scale, self.amx,
        )  # fmt: skip
