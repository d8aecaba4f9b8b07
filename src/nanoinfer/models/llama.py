"""Llama (Llama 2 and 3, SmolLM2): the pre-norm decoder the other dense families vary.

A family built on it overrides the hooks below: which options each layer's attention takes, the MLP's
activation, the norm. transformers' modeling_llama.py is the spec.
"""

from __future__ import annotations

from torch import nn

from nanoinfer.models.layers.attention import Attention
from nanoinfer.models.layers.decoder import CausalLM, DecoderModel, PreNormDecoderLayer
from nanoinfer.models.layers.mlp import GatedMLP
from nanoinfer.models.layers.norm import RMSNorm
from nanoinfer.models.layers.rotary import RotaryEmbedding


def head_dim_of(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


class LlamaForCausalLM(CausalLM):
    fused_decode_shape = "llama"  # csrc/decode_layers.cpp runs these layers (where their options allow)
    gguf_unpermute_qk = True  # llama.cpp's converter interleaves Llama's q/k rows for its rotary
    norm_class = RMSNorm

    def build_model(self, hf_config, backend, max_position: int) -> DecoderModel:
        rotary = RotaryEmbedding(hf_config, head_dim_of(hf_config), max_position)  # one table, every layer
        layers = [self.build_layer(hf_config, i, backend, rotary) for i in range(hf_config.num_hidden_layers)]
        return DecoderModel(hf_config.vocab_size, hf_config.hidden_size, layers, self.norm(hf_config))

    def build_layer(self, hf_config, layer_idx: int, backend, rotary) -> nn.Module:
        return PreNormDecoderLayer(
            self.build_attention(hf_config, layer_idx, backend, rotary), self.build_mlp(hf_config, layer_idx),
            self.norm(hf_config), self.norm(hf_config),
        )  # fmt: skip

    def build_attention(self, hf_config, layer_idx: int, backend, rotary) -> Attention:
        return Attention(
            hf_config.hidden_size, hf_config.num_attention_heads, hf_config.num_key_value_heads,
            head_dim_of(hf_config), backend, rotary, **self.attention_options(hf_config, layer_idx),
        )  # fmt: skip

    def attention_options(self, hf_config, layer_idx: int) -> dict:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return dict(qkv_bias=bias, o_bias=bias)

    def build_mlp(self, hf_config, layer_idx: int) -> nn.Module:
        return GatedMLP(hf_config.hidden_size, hf_config.intermediate_size, getattr(hf_config, "hidden_act", "silu"))

    def norm(self, hf_config, size: int | None = None) -> nn.Module:
        eps = getattr(hf_config, "rms_norm_eps", 1e-6)
        return self.norm_class(size or hf_config.hidden_size, eps)
