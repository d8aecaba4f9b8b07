"""gpt-oss (gpt-oss-20b, gpt-oss-120b): pre-norm layers with a mixture of experts in every one. Attention has q/k/v/o
biases and a learned sink logit per head (Attention(sinks=True)), sliding-window (128) and full layers alternating by
`layer_types`, YaRN rope. The router (with a bias) takes the top `num_experts_per_tok` logits, then a softmax over
those; the experts (with biases) apply the clamped SwiGLU, "swigluoai". transformers' modeling_gpt_oss.py is the spec.

Checkpoints hold the experts as transformers' GptOssExperts does (gate_up_proj [E, H, 2I] with gate and up interleaved
on the last axis, down_proj [E, I, H], and their biases), or as published, in MXFP4 (`*_blocks` and `*_scales`, which
transformers' integrations/mxfp4.py reads); `sanitize` turns both into FusedMoE's layout, dequantized at load.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoinfer.models.layers.attention import layer_sliding_window
from nanoinfer.models.layers.moe import FusedMoE, SparseMoeBlock, TopKRouter
from nanoinfer.models.llama import LlamaForCausalLM
from nanoinfer.models.olmo2 import Olmo2RMSNorm

# The 16 values of an MXFP4 element's 4-bit code (e2m1: sign, two exponent bits, one mantissa bit)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_MXFP4_PARTS = ("_blocks", "_scales")


class GptOssForCausalLM(LlamaForCausalLM):
    fused_decode_shape = None  # the fused C++ decode loop runs dense MLPs only
    # transformers keeps gpt-oss's norms in float32 (_keep_in_fp32_modules): scaled in float32, then rounded
    norm_class = Olmo2RMSNorm

    def __init__(self, hf_config, backend, max_position: int):
        super().__init__(hf_config, backend, max_position)
        # MXFP4 halves read so far, by tensor name: each waits for its other half (they may lie in other files)
        self._mxfp4_parts: dict[str, dict[str, torch.Tensor]] = {}

    def attention_options(self, hf_config, layer_idx: int) -> dict:
        return dict(super().attention_options(hf_config, layer_idx), sinks=True,
                    sliding_window=layer_sliding_window(hf_config, layer_idx))  # fmt: skip

    def build_mlp(self, hf_config, layer_idx: int) -> nn.Module:
        num_experts = hf_config.num_local_experts
        return SparseMoeBlock(
            TopKRouter(hf_config.hidden_size, num_experts, hf_config.num_experts_per_tok, scoring="topk_softmax",
                       bias=True),
            FusedMoE(num_experts, hf_config.hidden_size, hf_config.intermediate_size, "swigluoai", bias=True,
                     swiglu_alpha=getattr(hf_config, "swiglu_alpha", 1.702), swiglu_limit=hf_config.swiglu_limit),
        )  # fmt: skip

    def sanitize(self, name: str, tensor_fn):
        """The router's `mlp.router.` is the MoE block's `mlp.gate.`; the experts' tensors go to transformers' fused
        names in FusedMoE's layout ([E, 2I, H] gate rows then up rows, [E, H, I]); an MXFP4 pair is dequantized
        once both halves have been read."""
        name = name.replace(".mlp.router.", ".mlp.gate.")
        if ".mlp.experts." not in name:
            return [(name, tensor_fn)]
        part = next((p for p in _MXFP4_PARTS if name.endswith(p)), None)
        if part is not None:
            base = name[: -len(part)]
            parts = self._mxfp4_parts.setdefault(base, {})
            parts[part] = tensor_fn()
            if len(parts) < len(_MXFP4_PARTS):
                return []
            del self._mxfp4_parts[base]
            # [E, rows, cols] as nn.Linear weights: gate_up's rows interleaved (gate j, up j), down's [E, H, I]
            weight = dequantize_mxfp4(parts["_blocks"], parts["_scales"])
            if base.endswith(".gate_up_proj"):
                weight = gate_rows_then_up(weight)
            return [(base, lambda: weight)]
        if name.endswith(".gate_up_proj"):  # [E, H, 2I], interleaved columns
            return [(name, lambda: gate_rows_then_up(tensor_fn().transpose(1, 2)))]
        if name.endswith(".gate_up_proj_bias"):  # [E, 2I], interleaved
            return [(name, lambda: gate_rows_then_up(tensor_fn()))]
        if name.endswith(".down_proj"):  # [E, I, H]
            return [(name, lambda: tensor_fn().transpose(1, 2))]
        return [(name, tensor_fn)]

    # llama.cpp's gpt-oss GGUF (its converter's GptOssModel): the norm before the experts is post_attention_norm, the
    # sinks attn_sinks; the router (ffn_gate_inp), its bias and the experts' stacked tensors and biases are generic
    gguf_tensor_names = {"post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks"}
    gguf_unpermute_qk = False  # gpt-oss rotates halves (NeoX style): llama.cpp keeps HF's row order

    @classmethod
    def gguf_config(cls, gguf) -> dict:
        """llama.cpp's gpt-oss: the experts' width is expert_feed_forward_length; sliding layers every other one from
        layer 0 (llama.cpp's swa pattern 2, or attention.sliding_window_pattern); q/k/v/o biases always; the SwiGLU
        constants llama.cpp's graph hard-codes (alpha 1.702, limit 7, gpt-oss's own). YaRN comes from the rope
        scaling keys with transformers' unrounded correction range (truncate false): the file cannot say it, every
        gpt-oss config sets it, and llama.cpp's converter takes gpt-oss checkpoints only."""
        experts, used = gguf.expert_counts()
        layers = gguf.meta("block_count")
        pattern = gguf.meta("attention.sliding_window_pattern", 2)
        sliding = (list(pattern) if isinstance(pattern, list)
                   else [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)])  # fmt: skip
        scaling = gguf.rope_scaling()
        if scaling is not None and scaling["rope_type"] == "yarn":
            scaling = {**scaling, "truncate": False}
        return {
            **super().gguf_config(gguf),
            "num_local_experts": experts,
            "num_experts_per_tok": used,
            "intermediate_size": gguf.meta("expert_feed_forward_length") or gguf.meta("feed_forward_length"),
            "sliding_window": gguf.meta("attention.sliding_window"),
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
            "attention_bias": True,
            "swiglu_alpha": 1.702,
            "swiglu_limit": 7.0,
            "rope_scaling": scaling,
        }


def gate_rows_then_up(interleaved: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] with gate j at row 2j and up j at row 2j + 1 -> [E, 2I, ...]: the gate rows, then the up rows."""
    return torch.cat([interleaved[:, 0::2], interleaved[:, 1::2]], dim=1)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """OCP MXFP4 -> float32, as transformers' convert_moe_packed_tensors reads gpt-oss's: blocks [E, R, G, 16] uint8
    (32 4-bit codes a block, two a byte, the low nibble first), scales [E, R, G] uint8 (block g's power of two, biased
    by 127) -> [E, R, G * 32]. One expert at a time: the codes' index tensor is 16 bytes a packed byte."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    *lead, groups, width = blocks.shape
    out = torch.empty(*lead, groups, 2 * width, dtype=torch.float32)
    for e in range(blocks.shape[0]):
        packed = blocks[e].to(torch.uint8)
        codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2).long()  # [R, G, 32]
        out[e] = torch.ldexp(lut[codes], scales[e].to(torch.int32).sub(127).unsqueeze(-1))
    return out.flatten(-2)
