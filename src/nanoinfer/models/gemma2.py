"""Gemma 2: Gemma with a norm after attention and after the MLP (sandwich norms), score scale
query_pre_attn_scalar ** -0.5, attention-logit soft-capping, sliding-window and global layers by `layer_types`
(alternating), and a final logit soft cap (CausalLM reads final_logit_softcapping). transformers'
modeling_gemma2.py is the spec.
"""

from __future__ import annotations

from torch import nn

from nanoinfer.models.gemma import GemmaForCausalLM
from nanoinfer.models.layers.attention import layer_sliding_window
from nanoinfer.models.layers.decoder import SandwichNormDecoderLayer
from nanoinfer.models.layers.mlp import GatedMLP


class Gemma2ForCausalLM(GemmaForCausalLM):
    # llama.cpp's names of the sandwich norms (its ffn_norm is the norm before the MLP, Llama's second one)
    gguf_tensor_names = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                         "post_ffw_norm": "post_feedforward_layernorm"}  # fmt: skip
    gguf_global_every = 2  # llama.cpp's fixed pattern: layer i slides unless (i + 1) is a multiple of this
    gguf_27b_layers = 46  # llama.cpp knows the 27B by its depth: its scores scale by (hidden / heads) ** -0.5

    def build_layer(self, hf_config, layer_idx: int, backend, rotary) -> nn.Module:
        return SandwichNormDecoderLayer(
            self.build_attention(hf_config, layer_idx, backend, rotary), self.build_mlp(hf_config, layer_idx),
            self.norm(hf_config), self.norm(hf_config), self.norm(hf_config), self.norm(hf_config),
        )  # fmt: skip

    def attention_options(self, hf_config, layer_idx: int) -> dict:
        return dict(super().attention_options(hf_config, layer_idx), scale=hf_config.query_pre_attn_scalar**-0.5,
                    sliding_window=layer_sliding_window(hf_config, layer_idx),
                    soft_cap=getattr(hf_config, "attn_logit_softcapping", None))  # fmt: skip

    def build_mlp(self, hf_config, layer_idx: int) -> nn.Module:
        # Gemma 2 and 3 read `hidden_activation` (Gemma 1 `hidden_act`, which their configs may also carry)
        return GatedMLP(hf_config.hidden_size, hf_config.intermediate_size, hf_config.hidden_activation)

    @classmethod
    def gguf_config(cls, gguf) -> dict:
        """Gemma 2's keys; query_pre_attn_scalar is not written: llama.cpp scales scores by head_dim ** -0.5 but
        on the 27B (hidden / heads, from gemma_pytorch), as HF's configs set it."""
        layers, every = gguf.meta("block_count"), cls.gguf_global_every
        hidden_per_head = gguf.meta("embedding_length") // gguf.meta("attention.head_count")
        head_dim = gguf.meta("attention.key_length", hidden_per_head)
        return {
            **super().gguf_config(gguf),
            "sliding_window": gguf.meta("attention.sliding_window"),
            "layer_types": ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)],
            "query_pre_attn_scalar": hidden_per_head if layers == cls.gguf_27b_layers else head_dim,
            "attn_logit_softcapping": gguf.meta_float("attn_logit_softcapping"),
            "final_logit_softcapping": gguf.meta_float("final_logit_softcapping"),
        }

