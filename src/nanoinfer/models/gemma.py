"""Gemma (1): Llama's pre-norm layers with Gemma's RMSNorm (scales by 1 + w), a GeGLU MLP (gelu_pytorch_tanh) and
embeddings multiplied by sqrt(hidden_size). transformers' modeling_gemma.py is the spec.

GemmaForCausalLM.build_model is also Gemma 2's and 3's: they change the layers (build_layer, attention_options) and
which rotary table a layer reads (rope_layer_type).
"""

from __future__ import annotations

from nanoinfer.models.layers.decoder import DecoderModel
from nanoinfer.models.layers.norm import GemmaRMSNorm
from nanoinfer.models.layers.rotary import RotaryEmbedding
from nanoinfer.models.llama import LlamaForCausalLM, head_dim_of


class GemmaForCausalLM(LlamaForCausalLM):
    fused_decode_shape = None  # csrc/decode_layers.cpp runs SiLU layers without an embedding scale
    gguf_unpermute_qk = False  # llama.cpp's converter keeps Gemma's q/k rows in HF's order
    # llama.cpp's Gemma converters (1, 2 and 3) store every norm weight as 1 + w: the loader takes the 1 off
    gguf_norm_offset = 1.0
    norm_class = GemmaRMSNorm

    def build_model(self, hf_config, backend, max_position: int) -> DecoderModel:
        check_causal(hf_config)
        head_dim = head_dim_of(hf_config)
        tables: dict[str | None, RotaryEmbedding] = {}  # one table per rope layer type, shared by its layers
        layers = []
        for i in range(hf_config.num_hidden_layers):
            kind = self.rope_layer_type(hf_config, i)
            if kind not in tables:
                tables[kind] = RotaryEmbedding(hf_config, head_dim, max_position, layer_type=kind)
            layers.append(self.build_layer(hf_config, i, backend, tables[kind]))
        # transformers multiplies by sqrt(hidden_size) rounded to the model's dtype (DecoderModel does the same)
        return DecoderModel(hf_config.vocab_size, hf_config.hidden_size, layers, self.norm(hf_config),
                            embed_scale=hf_config.hidden_size**0.5)  # fmt: skip

    def rope_layer_type(self, hf_config, layer_idx: int) -> str | None:
        """The rope parameters a layer reads (rotary.rope_parameters): None, every layer the same."""
        return None

    @classmethod
    def gguf_config(cls, gguf) -> dict:
        # The GeGLU activation is implied by the architecture; llama.cpp writes no key for it (Gemma reads
        # hidden_act, Gemma 2 and 3 hidden_activation).
        act = "gelu_pytorch_tanh"
        return {**super().gguf_config(gguf), "hidden_act": act, "hidden_activation": act}


def check_causal(hf_config) -> None:
    """nanoinfer decodes causally; a config asking for bidirectional attention (an embedding model) is refused.
    A ValueError here is reported by Config as a problem with the model's config.json."""
    if getattr(hf_config, "use_bidirectional_attention", None):
        raise ValueError("use_bidirectional_attention is set: that is an encoder (embedding) model, and nanoinfer "
                         "generates only with causal attention")  # fmt: skip
