"""OLMo 3: OLMo 2's layers with a sliding window on the layers `layer_types` marks "sliding_attention" (three in four
in the published checkpoints) and rotary parameters per layer type (YaRN on the full-attention layers of the
long-context checkpoints). transformers' modeling_olmo3.py is the spec.
"""

from __future__ import annotations

from nanoinfer.models.layers.attention import layer_sliding_window
from nanoinfer.models.layers.decoder import DecoderModel
from nanoinfer.models.layers.rotary import RotaryEmbedding
from nanoinfer.models.llama import head_dim_of
from nanoinfer.models.olmo2 import Olmo2ForCausalLM


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    def build_model(self, hf_config, backend, max_position: int) -> DecoderModel:
        head_dim = head_dim_of(hf_config)
        # one table per layer type: the rope parameters are nested by layer type (transformers 5)
        rotary = {kind: RotaryEmbedding(hf_config, head_dim, max_position, layer_type=kind)
                  for kind in sorted(set(hf_config.layer_types))}  # fmt: skip
        layers = [
            self.build_layer(hf_config, i, backend, rotary[hf_config.layer_types[i]])
            for i in range(hf_config.num_hidden_layers)
        ]
        return DecoderModel(hf_config.vocab_size, hf_config.hidden_size, layers, self.norm(hf_config))

    def attention_options(self, hf_config, layer_idx: int) -> dict:
        return dict(super().attention_options(hf_config, layer_idx),
                    sliding_window=layer_sliding_window(hf_config, layer_idx))  # fmt: skip
