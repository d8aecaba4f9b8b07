"""Qwen3-Next (Qwen3-Next-80B-A3B): a hybrid of Gated DeltaNet layers (linear attention with a fixed-size state per
sequence, models/layers/gated_delta_net.py) and gated attention layers, by `layer_types` (three linear to one full
in the published checkpoints), with a mixture of experts plus a shared expert as the MLP.

Its attention layers: q_proj also gives each head an output gate (sigmoid, before o_proj), q and k are normed per
head, rotary turns the first partial_rotary_factor of each head. Every RMSNorm scales by 1 + w (GemmaRMSNorm); the
linear layers' output norm is a gated one over each value head. transformers' modeling_qwen3_next.py is the spec.

A checkpoint's in_proj_qkvz and in_proj_ba group each key head's rows with those of the value heads it serves; they
are regrouped at load into the layer's flat [q | k | v | z | b | a] projection, as Qwen3.5's flat in_proj_qkv (and
its in_proj_z, in_proj_b, in_proj_a) are split into it.
"""

from __future__ import annotations

from torch import nn

from nanoinfer.models.layers.decoder import CausalLM, DecoderModel, PreNormDecoderLayer
from nanoinfer.models.layers.gated_delta_net import GatedDeltaNet
from nanoinfer.models.layers.mlp import GatedMLP
from nanoinfer.models.layers.moe import FusedMoE, SharedExpertMoeBlock, TopKRouter
from nanoinfer.models.layers.norm import GemmaRMSNorm
from nanoinfer.models.llama import LlamaForCausalLM, head_dim_of
from nanoinfer.models.qwen3_moe import is_sparse_layer

# The fused input projection's shards (GatedDeltaNet.in_proj), by the checkpoint names they load from
_IN_PROJ = {f"in_proj_{part}": ("in_proj", i) for i, part in enumerate("qkvzba")}
# Checkpoint tensors holding several of those shards -> (the shards, whether grouped by key head (Qwen3-Next) or
# one after the other (Qwen3.5))
_FUSED_IN_PROJ = {"in_proj_qkvz": ("qkvz", True), "in_proj_ba": ("ba", True), "in_proj_qkv": ("qkv", False)}


class Qwen3NextForCausalLM(LlamaForCausalLM):
    fused_decode_shape = None  # the fused C++ decode loop runs attention layers only
    norm_class = GemmaRMSNorm
    packed_modules = {**CausalLM.packed_modules, **_IN_PROJ}

    def build_model(self, hf_config, backend, max_position: int) -> DecoderModel:
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf_config.hidden_act!r}: the linear-attention convolution runs silu only")
        return super().build_model(hf_config, backend, max_position)

    def build_layer(self, hf_config, layer_idx: int, backend, rotary) -> nn.Module:
        # Both kinds of layer sit where the decoder layer keeps its attention (self_attn): the checkpoint's
        # linear_attn names are mapped there (sanitize).
        if hf_config.layer_types[layer_idx] == "linear_attention":
            mixer = self.build_linear_attention(hf_config)
        else:
            mixer = self.build_attention(hf_config, layer_idx, backend, rotary)
        return PreNormDecoderLayer(mixer, self.build_mlp(hf_config, layer_idx), self.norm(hf_config),
                                   self.norm(hf_config))  # fmt: skip

    def build_linear_attention(self, hf_config) -> GatedDeltaNet:
        return GatedDeltaNet(hf_config.hidden_size, hf_config.linear_num_key_heads, hf_config.linear_num_value_heads,
                             hf_config.linear_key_head_dim, hf_config.linear_value_head_dim,
                             hf_config.linear_conv_kernel_dim, getattr(hf_config, "rms_norm_eps", 1e-6))  # fmt: skip

    def attention_options(self, hf_config, layer_idx: int) -> dict:
        head_dim = head_dim_of(hf_config)
        return dict(super().attention_options(hf_config, layer_idx), q_norm=self.norm(hf_config, head_dim),
                    k_norm=self.norm(hf_config, head_dim),
                    output_gate=bool(getattr(hf_config, "attn_output_gate", True)))  # fmt: skip

    def build_mlp(self, hf_config, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(hf_config, layer_idx):
            return super().build_mlp(hf_config, layer_idx)
        return self.build_moe(hf_config, renormalize=bool(getattr(hf_config, "norm_topk_prob", True)))

    def build_moe(self, hf_config, renormalize: bool) -> nn.Module:
        hidden = hf_config.hidden_size
        return SharedExpertMoeBlock(
            TopKRouter(hidden, hf_config.num_experts, hf_config.num_experts_per_tok, renormalize=renormalize),
            FusedMoE(hf_config.num_experts, hidden, hf_config.moe_intermediate_size, hf_config.hidden_act),
            GatedMLP(hidden, hf_config.shared_expert_intermediate_size, hf_config.hidden_act), hidden,
        )  # fmt: skip

    def sanitize(self, name: str, tensor_fn):
        if name.startswith("mtp."):
            return []  # the multi-token-prediction head (speculative decoding in vLLM), which transformers skips too
        name = name.replace(".linear_attn.", ".self_attn.").replace(".conv1d.weight", ".conv1d_weight")
        for fused, (parts, grouped) in _FUSED_IN_PROJ.items():
            if name.endswith(f".self_attn.{fused}.weight"):
                return self._split_in_proj(name, fused, tensor_fn, parts, grouped)
        return [(name, tensor_fn)]

    def _split_in_proj(self, name: str, fused: str, tensor_fn, parts: str, grouped: bool):
        """The shards `parts` (of q, k, v, z, b, a) in one checkpoint tensor: one after the other, or grouped by key
        head (each key head's rows of each shard, then the next head's)."""
        layer = self.linear_attention_layers()[0]
        tp = layer.tp_size
        groups = layer.num_k_heads * tp if grouped else 1
        rows = {"q": layer.key_size * tp, "k": layer.key_size * tp, "v": layer.value_size * tp,
                "z": layer.value_size * tp, "b": layer.num_v_heads * tp, "a": layer.num_v_heads * tp}  # fmt: skip
        widths = {p: rows[p] // groups for p in parts}  # rows a group holds of each

        def part(which: str):
            def read():
                tensor = tensor_fn()
                tensor = tensor.reshape(groups, -1, tensor.shape[-1])
                start = sum(widths[p] for p in parts[: parts.index(which)])
                return tensor[:, start : start + widths[which]].reshape(-1, tensor.shape[-1])

            return read

        return [(name.replace(f".{fused}.", f".in_proj_{p}."), part(p)) for p in parts]
