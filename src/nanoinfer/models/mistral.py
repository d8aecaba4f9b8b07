"""Mistral: Llama's layers with an optional sliding window on every layer (`sliding_window`; None in Mistral v0.2+
and Ministral's full-attention checkpoints). transformers' modeling_mistral.py is the spec."""

from __future__ import annotations

from nanoinfer.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    def attention_options(self, hf_config, layer_idx: int) -> dict:
        window = getattr(hf_config, "sliding_window", None)
        return dict(super().attention_options(hf_config, layer_idx), sliding_window=window)
