"""Gemma 2: Gemma with a norm after attention and after the MLP (sandwich norms), score scale
query_pre_attn_scalar ** -0.5, attention-logit soft-capping, sliding-window and global layers by `layer_types`
(alternating), and a final logit soft cap (CausalLM reads final_logit_softcapping). transformers'
modeling_gemma2.py is the spec.
"""

from __future__ import annotations

from torch import nn

from nanoinfer.models.gemma import GemmaForCausalLM
from nanoinfer.models.layers.decoder import SandwichNormDecoderLayer
from nanoinfer.models.layers.mlp import GatedMLP


class Gemma2ForCausalLM(GemmaForCausalLM):
    def build_layer(self, hf_config, layer_idx: int, backend, rotary) -> nn.Module:
        return SandwichNormDecoderLayer(
            self.build_attention(hf_config, layer_idx, backend, rotary), self.build_mlp(hf_config, layer_idx),
            self.norm(hf_config), self.norm(hf_config), self.norm(hf_config), self.norm(hf_config),
        )  # fmt: skip

    def attention_options(self, hf_config, layer_idx: int) -> dict:
        return dict(super().attention_options(hf_config, layer_idx), scale=hf_config.query_pre_attn_scalar**-0.5,
                    sliding_window=sliding_window_of(hf_config, layer_idx),
                    soft_cap=getattr(hf_config, "attn_logit_softcapping", None))  # fmt: skip

    def build_mlp(self, hf_config, layer_idx: int) -> nn.Module:
        # Gemma 2 and 3 read `hidden_activation` (Gemma 1 `hidden_act`, which their configs may also carry)
        return GatedMLP(hf_config.hidden_size, hf_config.intermediate_size, hf_config.hidden_activation)


def sliding_window_of(hf_config, layer_idx: int) -> int | None:
    """The config's sliding_window on a "sliding_attention" layer, None (every key) on the others."""
    if hf_config.layer_types[layer_idx] != "sliding_attention":
        return None
    return getattr(hf_config, "sliding_window", None)
