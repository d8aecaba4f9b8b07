"""Qwen2 / Qwen2.5: Llama's layers with biases on q, k and v (never on o_proj). transformers' modeling_qwen2.py."""

from __future__ import annotations

from nanoinfer.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    gguf_unpermute_qk = False  # llama.cpp keeps Qwen's rows in HF's order

    def attention_options(self, hf_config, layer_idx: int) -> dict:
        return dict(qkv_bias=True, o_bias=False, sliding_window=qwen_sliding_window(hf_config, layer_idx))


def qwen_sliding_window(hf_config, layer_idx: int) -> int | None:
    """The window of a layer `layer_types` marks "sliding_attention" (transformers sets them from
    use_sliding_window and max_window_layers; published Qwen2/2.5/3 checkpoints turn it off), else None."""
    layer_types = getattr(hf_config, "layer_types", None)
    if not layer_types or layer_types[layer_idx] != "sliding_attention":
        return None
    return getattr(hf_config, "sliding_window", None)
