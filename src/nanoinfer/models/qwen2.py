"""Qwen2 / Qwen2.5: Llama's layers with biases on q, k and v (never on o_proj). transformers' modeling_qwen2.py."""

from __future__ import annotations

from nanoinfer.models.layers.attention import layer_sliding_window
from nanoinfer.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    gguf_unpermute_qk = False  # llama.cpp keeps Qwen's rows in HF's order

    def attention_options(self, hf_config, layer_idx: int) -> dict:
        return dict(qkv_bias=True, o_bias=False, sliding_window=layer_sliding_window(hf_config, layer_idx))

