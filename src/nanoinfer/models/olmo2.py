"""OLMo 2: post-norm layers (attention -> norm -> add, MLP -> norm -> add, no norm before either) with an RMSNorm over
the whole q and k projections (all heads at once) before rotary. transformers' modeling_olmo2.py is the spec.
"""

from __future__ import annotations

from torch import nn

from nanoinfer.errors import ModelLoadError
from nanoinfer.models.layers.decoder import PostNormDecoderLayer
from nanoinfer.models.layers.norm import GemmaRMSNorm
from nanoinfer.models.llama import LlamaForCausalLM, head_dim_of


class Olmo2RMSNorm(GemmaRMSNorm):
    """OLMo's RMSNorm scales by w in float32 and rounds once (Llama's rounds, then scales): GemmaRMSNorm's
    arithmetic on the checkpoint's plain w. In float32 both are the platform's plain op."""

    weight_offset = 0.0  # w as the checkpoint holds it


class Olmo2ForCausalLM(LlamaForCausalLM):
    norm_class = Olmo2RMSNorm
    fused_decode_shape = None  # post-norm layers: not the Llama shape csrc/decode_layers.cpp runs
    gguf_unpermute_qk = False  # OLMo 2 rotates halves (NeoX style): llama.cpp keeps HF's row order
    gguf_tensor_names = {"post_attention_norm": "post_attention_layernorm",
                         "post_ffw_norm": "post_feedforward_layernorm"}  # fmt: skip

    def build_layer(self, hf_config, layer_idx: int, backend, rotary) -> nn.Module:
        return PostNormDecoderLayer(
            self.build_attention(hf_config, layer_idx, backend, rotary), self.build_mlp(hf_config, layer_idx),
            self.norm(hf_config), self.norm(hf_config),
        )  # fmt: skip

    def attention_options(self, hf_config, layer_idx: int) -> dict:
        head_dim = head_dim_of(hf_config)
        q_norm = self.norm(hf_config, hf_config.num_attention_heads * head_dim)
        k_norm = self.norm(hf_config, hf_config.num_key_value_heads * head_dim)
        return dict(super().attention_options(hf_config, layer_idx), q_norm=q_norm, k_norm=k_norm,
                    qk_norm_per_head=False)  # fmt: skip

    @classmethod
    def gguf_config(cls, gguf) -> dict:
        # llama.cpp writes OLMo 3 as olmo2 too, told apart by its sliding window (and YaRN on the global layers)
        if gguf.meta("attention.sliding_window") is not None:
            raise ModelLoadError(f"{gguf.path} is an OLMo 3 GGUF (llama.cpp's olmo2 architecture with a sliding "
                                 "window), which nanoinfer does not read yet; run the model's Hugging Face folder "
                                 "instead.")
        return super().gguf_config(gguf)
