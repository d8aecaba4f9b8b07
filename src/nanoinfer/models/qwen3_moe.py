"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder): Qwen3's attention with a mixture of experts in place of
the MLP. Layer i has experts unless it is in `mlp_only_layers` or (i + 1) is not a multiple of
`decoder_sparse_step`; those keep a dense MLP of `intermediate_size`. The router takes the top `num_experts_per_tok`
of a softmax over `num_experts`, renormalized when `norm_topk_prob`. transformers' modeling_qwen3_moe.py is the spec.
"""

from __future__ import annotations

from torch import nn

from nanoinfer.models.layers.moe import FusedMoE, SparseMoeBlock, TopKRouter
from nanoinfer.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    fused_decode_shape = None  # the fused C++ decode loop runs dense MLPs only

    @classmethod
    def gguf_config(cls, gguf) -> dict:
        """llama.cpp's qwen3moe: experts in every layer (it has no dense ones), the top k always renormalized
        (its graph fixes that; the converter writes no norm_topk_prob, which Qwen3-MoE checkpoints set true), the
        expert width from expert_feed_forward_length, else feed_forward_length / expert_used_count as llama.cpp."""
        experts, used = gguf.expert_counts()
        width = gguf.meta("expert_feed_forward_length") or gguf.meta("feed_forward_length") // used
        return {**super().gguf_config(gguf), "num_experts": experts, "num_experts_per_tok": used,
                "moe_intermediate_size": width, "norm_topk_prob": True, "decoder_sparse_step": 1,
                "mlp_only_layers": []}  # fmt: skip

    def attention_options(self, hf_config, layer_idx: int) -> dict:
        # every layer windowed with use_sliding_window (no layer_types), as transformers' config sets it
        window = hf_config.sliding_window if getattr(hf_config, "use_sliding_window", False) else None
        return dict(super().attention_options(hf_config, layer_idx), sliding_window=window)

    def build_mlp(self, hf_config, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(hf_config, layer_idx):
            return super().build_mlp(hf_config, layer_idx)
        return SparseMoeBlock(
            TopKRouter(hf_config.hidden_size, hf_config.num_experts, hf_config.num_experts_per_tok,
                       renormalize=bool(getattr(hf_config, "norm_topk_prob", False))),
            FusedMoE(hf_config.num_experts, hf_config.hidden_size, hf_config.moe_intermediate_size,
                     getattr(hf_config, "hidden_act", "silu")),
        )  # fmt: skip


def is_sparse_layer(hf_config, layer_idx: int) -> bool:
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    return (layer_idx not in (getattr(hf_config, "mlp_only_layers", None) or [])
            and hf_config.num_experts > 0 and (layer_idx + 1) % step == 0)  # fmt: skip


