"""SmolLM3: Llama's layers where some layers have no position embedding (NoPE), and an optional sliding window on
layers of type "sliding_attention". transformers' modeling_smollm3.py is the spec.

`no_rope_layers[i]` is 1 where layer i DOES use rotary and 0 where it is a NoPE layer (the name says the opposite):
the published checkpoints drop rotary from every 4th layer.
"""

from __future__ import annotations

from torch import nn

from nanoinfer.models.llama import LlamaForCausalLM


class SmolLM3ForCausalLM(LlamaForCausalLM):
    def build_model(self, hf_config, backend, max_position: int):
        if getattr(hf_config, "mlp_bias", False):  # ValueError: Config turns it into a ConfigProblem
            raise ValueError("mlp_bias is set: nanoinfer's MLP has no biases (no published SmolLM3 sets it)")
        return super().build_model(hf_config, backend, max_position)

    def build_attention(self, hf_config, layer_idx: int, backend, rotary) -> nn.Module:
        uses_rope = bool(hf_config.no_rope_layers[layer_idx])
        return super().build_attention(hf_config, layer_idx, backend, rotary if uses_rope else None)

    def attention_options(self, hf_config, layer_idx: int) -> dict:
        sliding = (
            getattr(hf_config, "use_sliding_window", False) and hf_config.layer_types[layer_idx] == "sliding_attention"
        )
        window = hf_config.sliding_window if sliding else None
        return dict(super().attention_options(hf_config, layer_idx), sliding_window=window)
