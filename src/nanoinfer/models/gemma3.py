"""Gemma 3 (text): Gemma 2's layers with a Gemma RMSNorm over each head of q and k before rotary, sliding and global
layers by `layer_types` (5 : 1 in the published checkpoints) and a rotary table per layer type (the local base
rope_local_base_freq on sliding layers; the global ones may be scaled, e.g. linear). transformers'
modeling_gemma3.py is the spec.

Its attention applies no logit soft cap, attn_logit_softcapping or not: transformers' Gemma3Attention never passes
it to the attention function, so neither do we. Gemma3ForConditionalGeneration checkpoints (the vision-language
ones) run here too, their text part only.
"""

from __future__ import annotations

import copy

from nanoinfer.models.gemma2 import Gemma2ForCausalLM
from nanoinfer.models.llama import head_dim_of

ARCHITECTURE_VL = "Gemma3ForConditionalGeneration"
# Checkpoint prefixes of a vision-language checkpoint's language model -> ours: the published checkpoints and
# transformers' save_pretrained write language_model.model.* / language_model.lm_head.*; transformers 5's module
# names (model.language_model.*) are taken too.
_LANGUAGE_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                      ("language_model.lm_head.", "lm_head."))  # fmt: skip
_VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    gguf_global_every = 6
    gguf_27b_layers = 62

    def attention_options(self, hf_config, layer_idx: int) -> dict:
        head_dim = head_dim_of(hf_config)
        return dict(super().attention_options(hf_config, layer_idx), soft_cap=None,
                    q_norm=self.norm(hf_config, head_dim), k_norm=self.norm(hf_config, head_dim))  # fmt: skip

    def rope_layer_type(self, hf_config, layer_idx: int) -> str | None:
        return hf_config.layer_types[layer_idx]

    @classmethod
    def gguf_config(cls, gguf) -> dict:
        """Gemma 3's rope: rope.freq_base (and the linear scaling) is the global layers', the sliding ones' base is
        rope.freq_base_swa where newer converters write it, else 10000 (llama.cpp's fixed value). The file holds
        the text model only (a vision-language checkpoint's tower goes to a separate mmproj file)."""
        return {
            **super().gguf_config(gguf),
            "rope_theta": gguf.meta_float("rope.freq_base", 1_000_000.0),
            "rope_local_base_freq": gguf.meta_float("rope.freq_base_swa", 10_000.0),
            "attn_logit_softcapping": None,  # Gemma 3 applies none, and its converter refuses one
        }


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The language model of a Gemma 3 vision-language checkpoint; the vision tower and projector are skipped.
    Built from the top-level config or from its text part (language_config either way)."""

    def __init__(self, hf_config, backend, max_position: int):
        super().__init__(language_config(hf_config), backend, max_position)
        self.lm_head.soft_cap = None  # transformers' Gemma3ForConditionalGeneration applies no final soft cap

    @classmethod
    def text_config(cls, hf_config) -> tuple[object, str | None]:
        """(the config nanoinfer runs, a note for the user): the text part of the checkpoint's config."""
        return language_config(hf_config), "vision tower skipped: nanoinfer runs the text part"

    def sanitize(self, name: str, tensor_fn):
        for prefix, ours in _LANGUAGE_PREFIXES:
            if name.startswith(prefix):
                return [(ours + name[len(prefix) :], tensor_fn)]
        if name.startswith(_VISION_PREFIXES):
            return []
        return [(name, tensor_fn)]


def language_config(hf_config, architecture: str = ARCHITECTURE_VL):
    """A copy of the checkpoint's text_config that still says which checkpoint it is (its architectures, so the
    registry picks the vision-language class and its weight names; Gemma 3's unless told) and whether the head is
    tied (the top-level config decides in transformers). A config that is already the text part is returned as it
    is."""
    text = getattr(hf_config, "text_config", None)
    if text is None:
        return hf_config
    text = copy.deepcopy(text)
    text.architectures = [architecture]
    text.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", text.tie_word_embeddings))
    return text
