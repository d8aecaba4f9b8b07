"""The CPU's fused decode runner: every decoder layer of a pure-decode step in one C++ call
(csrc/decode_layers.cpp), the embedding and the final norm around it.

With the kernels at the CPU's compute and bandwidth ceilings, the Python around them (module calls, views,
checks, per layer) was what remained of a decode step (benchmarks/README.md). The C++ loop calls the same
kernels in the same order, so its output is bit for bit the per-layer path's.

It applies only where the per-layer path would call exactly those kernels: float32 with weights packed for our
panel GEMM or bfloat16 with weights packed for the AMX GEMM (the MLP's gated in both), one process (no tensor
parallelism), a model that says its layers are Llama-shaped (`fused_decode_shape`) and whose every layer keeps to
what the loop runs (rotary over the whole head, no q/k norms, window or soft cap, no o_proj or down_proj bias,
SiLU), the CPU attention backend, and a pure-decode step. Everything else takes the model's own forward, unchanged:
a layer shape this file does not know is never read here.
"""

from __future__ import annotations

import torch

from nanoinfer.attention.metadata import AttentionMetadata
from nanoinfer.platforms.cpu.attention import KERNEL_CACHE_DTYPES, CpuAttentionBackend

# The packed kinds of (qkv, o_proj, gate_up, down_proj) the C++ loop runs, by dtype.
_LINEAR_KINDS = {
    torch.float32: ["panels", "panels", "gated", "panels"],
    torch.bfloat16: ["amx", "amx", "amx_gated", "amx"],
}
_PROJECTIONS = {  # the C++ name -> the projection's path in a DecoderLayer
    "qkv_proj": "self_attn.qkv_proj",
    "o_proj": "self_attn.o_proj",
    "gate_up_proj": "mlp.gate_up_proj",
    "down_proj": "mlp.down_proj",
}


def layer_tensors(layer, k_cache: torch.Tensor, v_cache: torch.Tensor) -> dict[str, torch.Tensor]:
    """What csrc/decode_layers.cpp reads of one layer, by the names it reads them under (the one description
    both sides share: a missing name is an error there, naming it)."""
    named = {
        "input_layernorm": layer.input_layernorm.weight.detach(),
        "post_attention_layernorm": layer.post_attention_layernorm.weight.detach(),
        "k_cache": k_cache,
        "v_cache": v_cache,
    }
    if layer.self_attn.qkv_proj.bias is not None:
        named["qkv_bias"] = layer.self_attn.qkv_proj.bias.detach()
    for name, path in _PROJECTIONS.items():
        packed = layer.get_submodule(path).packed_weight
        named[name] = packed.data
        for form in ("compact", "compact_amx"):  # the weight's exact 4-bit forms, where it has them
            if getattr(packed, form) is not None:
                named[f"{name}.{form}"] = getattr(packed, form)
    return named


class FusedDecode:
    """A model's decode steps through csrc/decode_layers.cpp, over the KV caches it was built with."""

    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], ops):
        decoder = model.model
        attn = decoder.layers[0].self_attn
        self.decoder = decoder
        self.kv_caches = kv_caches
        self.layers = ops.DecodeLayers(
            [layer_tensors(layer, k, v) for layer, (k, v) in zip(decoder.layers, kv_caches)],
            attn.rotary.cos, attn.rotary.sin, attn.num_heads, attn.num_kv_heads, attn.head_dim,
            decoder.layers[0].mlp.gate_up_proj.output_sizes[0], decoder.norm.eps, attn.scale,
            attn.qkv_proj.packed_weight.kind == "amx",
        )  # fmt: skip

    @staticmethod
    def applies(model, kv_caches, backend) -> bool:
        """Would the per-layer path run exactly csrc/decode_layers.cpp's kernels for this model's decode steps?"""
        if getattr(model, "fused_decode_shape", None) != "llama":
            return False  # only Llama-shaped layers have the attributes read below
        decoder = model.model
        if len(kv_caches) != len(decoder.layers) or not decoder.layers or not isinstance(backend, CpuAttentionBackend):
            return False
        if getattr(decoder, "embed_scale", None) is not None or getattr(model.lm_head, "soft_cap", None) is not None:
            return False
        weight = decoder.norm.weight
        if weight.device.type != "cpu" or weight.dtype not in _LINEAR_KINDS:
            return False
        expected_kinds = _LINEAR_KINDS[weight.dtype]
        attn0 = decoder.layers[0].self_attn
        for layer, (k_cache, _) in zip(decoder.layers, kv_caches):
            a = layer.self_attn
            if any(getattr(layer.get_submodule(path), "lora", None) is not None for path in _PROJECTIONS.values()):
                return False  # adapters' deltas join the projections: the loop has no place for them
            packed = [getattr(layer.get_submodule(path), "packed_weight", None) for path in _PROJECTIONS.values()]
            if any(p is None for p in packed) or [p.kind for p in packed] != expected_kinds:
                return False
            if a.qk_norm or a.o_proj.bias is not None or layer.mlp.down_proj.bias is not None:
                return False
            if a.rotary is None or a.rotary.partial or a.sliding_window is not None or a.soft_cap is not None:
                return False
            # The layers' own shard count, not get_tp_size(): rank 0 builds its shard under tensor parallelism
            # and then runs it with the process-wide setting back at 1 (a sharded layer all-reduces).
            if a.o_proj.tp_size != 1 or layer.mlp.down_proj.tp_size != 1:
                return False
            if a.backend is not backend or k_cache.dtype not in KERNEL_CACHE_DTYPES or k_cache.device.type != "cpu":
                return False
            same_shape = (a.num_heads, a.num_kv_heads, a.head_dim, a.scale, a.rotary) == (
                attn0.num_heads, attn0.num_kv_heads, attn0.head_dim, attn0.scale, attn0.rotary
            )
            eps = (layer.input_layernorm.eps, layer.post_attention_layernorm.eps)
            if not same_shape or eps != (decoder.norm.eps, decoder.norm.eps):
                return False
        return attn0.rotary.cos.device.type == "cpu"

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
            logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states of every row, or of the rows in logits_indices, as the model's forward."""
        hidden = self.decoder.embed_tokens(input_ids).contiguous()
        hidden, residual = self.layers.run(
            hidden, positions, metadata.slot_mapping, metadata.block_tables, metadata.seq_lens
        )
        if logits_indices is not None and logits_indices.numel() != input_ids.numel():
            hidden, residual = hidden[logits_indices], residual[logits_indices]
        if hidden.shape[0] == 0:
            return hidden
        hidden, _ = self.decoder.norm(hidden, residual)
        return hidden
