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

    def build_mlp(self, hf_config, layer_idx: int) -> nn.Module:
        return SparseMoeBlock(
            TopKRouter(hf_config.hidden_size, hf_config.num_local_experts, hf_config.num_experts_per_tok),
            FusedMoE(hf_config.num_local_experts, hf_config.hidden_size, hf_config.intermediate_size,
                     getattr(hf_config, "hidden_act", "silu")),
        )  # fmt: skip

    def sanitize(self, name, tensor_fn):
        return [(name.replace(".block_sparse_moe.", ".mlp."), tensor_fn)]
