"""Qwen3 (dense): Llama's layers with an RMSNorm over each head of q and k before rotary. transformers'
modeling_qwen3.py is the spec."""

from __future__ import annotations

from nanoinfer.models.layers.attention import layer_sliding_window
from nanoinfer.models.llama import LlamaForCausalLM, head_dim_of


class Qwen3ForCausalLM(LlamaForCausalLM):
    gguf_unpermute_qk = False  # llama.cpp keeps Qwen's rows in HF's order

    def attention_options(self, hf_config, layer_idx: int) -> dict:
        head_dim = head_dim_of(hf_config)
        return dict(super().attention_options(hf_config, layer_idx), q_norm=self.norm(hf_config, head_dim),
                    k_norm=self.norm(hf_config, head_dim),
                    sliding_window=layer_sliding_window(hf_config, layer_idx))  # fmt: skip
