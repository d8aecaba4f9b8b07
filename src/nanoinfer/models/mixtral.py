"""Mixtral (8x7B, 8x22B): Mistral's layers with a mixture of experts in place of every MLP: `num_local_experts`
experts, the top `num_experts_per_tok` of a softmax over them, renormalized. Checkpoints name the block
`block_sparse_moe` and the experts' projections w1 (gate), w3 (up), w2 (down). transformers' modeling_mixtral.py is
the spec."""

from __future__ import annotations

from torch import nn

from nanoinfer.models.layers.moe import FusedMoE, SparseMoeBlock, TopKRouter
from nanoinfer.models.mistral import MistralForCausalLM


class MixtralForCausalLM(MistralForCausalLM):
    fused_decode_shape = None  # the fused C++ decode loop runs dense MLPs only

    @classmethod
    def gguf_config(cls, gguf) -> dict:
        """llama.cpp writes Mixtral as a llama with experts (models/registry.py routes it here): Llama's q/k row
        order and rope; the experts' width is feed_forward_length (Mixtral's intermediate_size), and no window."""
        experts, used = gguf.expert_counts()
        return {**super().gguf_config(gguf), "num_local_experts": experts, "num_experts_per_tok": used,
                "sliding_window": None}  # fmt: skip

    def build_mlp(self, hf_config, layer_idx: int) -> nn.Module:
        return SparseMoeBlock(
            TopKRouter(hf_config.hidden_size, hf_config.num_local_experts, hf_config.num_experts_per_tok),
            FusedMoE(hf_config.num_local_experts, hf_config.hidden_size, hf_config.intermediate_size,
                     getattr(hf_config, "hidden_act", "silu")),
        )  # fmt: skip

    def sanitize(self, name, tensor_fn):
        return [(name.replace(".block_sparse_moe.", ".mlp."), tensor_fn)]
