"""Qwen3.5 and Qwen3.6 (dense 0.8B-27B, and the MoE 35B-A3B to 397B-A17B): Qwen3-Next's hybrid layers with the linear
layers' input projections published flat (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) and a dense MLP in every
layer, or experts plus a shared expert in every layer of the MoE models, whose top k are always renormalized.

The published checkpoints are vision-language ones (Qwen3_5ForConditionalGeneration: model.language_model.* beside
model.visual.*): nanoinfer runs their text part and skips the vision tower. Their rotary is multimodal (mrope), but a
text token's three position ids are equal, and then it is the plain rotary of the partial_rotary_factor.
transformers' modeling_qwen3_5.py and modeling_qwen3_5_moe.py are the spec.
"""

from __future__ import annotations

from torch import nn

from nanoinfer.models.gemma3 import language_config
from nanoinfer.models.layers.mlp import GatedMLP
from nanoinfer.models.qwen3_next import Qwen3NextForCausalLM

# Checkpoint prefixes of a vision-language checkpoint's language model -> ours, and its vision tower, which nanoinfer
# skips (the multi-token-prediction head, mtp.*, as Qwen3-Next's)
_LANGUAGE_PREFIXES = (("model.language_model.", "model."),)
_SKIPPED_PREFIXES = ("model.visual.", "visual.")


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    def build_mlp(self, hf_config, layer_idx: int) -> nn.Module:
        return GatedMLP(hf_config.hidden_size, hf_config.intermediate_size, hf_config.hidden_act)

    def sanitize(self, name: str, tensor_fn):
        for prefix, ours in _LANGUAGE_PREFIXES:
            if name.startswith(prefix):
                name = ours + name[len(prefix) :]
        if name.startswith(_SKIPPED_PREFIXES):
            return []
        return super().sanitize(name, tensor_fn)


class TextPartOfVisionLanguage:
    """Mixed in before a family class: the language model of a Qwen3.5 vision-language checkpoint (the form Qwen
    publishes), built from the top-level config or its text part; the vision tower is skipped."""

    architecture: str  # the checkpoint's, kept on its text config so the registry picks this class again

    def __init__(self, hf_config, backend, max_position: int):
        super().__init__(language_config(hf_config, self.architecture), backend, max_position)

    @classmethod
    def text_config(cls, hf_config) -> tuple[object, str | None]:
        return language_config(hf_config, cls.architecture), "vision tower skipped: nanoinfer runs the text part"


class Qwen3_5ForConditionalGeneration(TextPartOfVisionLanguage, Qwen3_5ForCausalLM):
    architecture = "Qwen3_5ForConditionalGeneration"


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    def build_mlp(self, hf_config, layer_idx: int) -> nn.Module:
        return self.build_moe(hf_config, renormalize=True)  # transformers' Qwen3_5MoeTopKRouter always renormalizes


class Qwen3_5MoeForConditionalGeneration(TextPartOfVisionLanguage, Qwen3_5MoeForCausalLM):
    architecture = "Qwen3_5MoeForConditionalGeneration"
