"""Gemma 4 (dense, text): Gemma 3's sandwich-norm layers with, per transformers' modeling_gemma4.py (the spec):

- q, k and v each normed over the head (v by an RMSNorm without weight), score scale 1;
- global layers ("full_attention" in layer_types) with their own head size and, with attention_k_eq_v, their own
  KV heads and values equal to the keys (the key projection before its norm and rotary; no v_proj);
- proportional rope on the global layers (rotary.py), the default on the sliding ones;
- per-layer input embeddings (hidden_size_per_layer_input > 0, E2B / E4B): a second embedding table and a
  projection of the embeddings give each layer a small input, gated into the stream after its MLP;
- KV sharing (num_kv_shared_layers): the last layers compute no keys and values and read those of the last
  earlier layer of their type: no cache of their own (ModelSpec, the runner), and double-wide MLPs there
  with use_double_wide_mlp;
- each layer's output scaled by its layer_scalar; norms scaling by w itself (not Gemma's 1 + w);
- the final logit soft cap, in Gemma4ForConditionalGeneration too.

The MoE variant (enable_moe_block, 26B-A4B) has experts beside each layer's dense MLP (layers/gemma4.py). The
layers are in layers/gemma4.py. Tensor parallelism is refused (the per-layer inputs and the shared caches are not
sharded). Gemma4ForConditionalGeneration checkpoints run here
for their text part: the vision and audio towers are skipped.
"""

from __future__ import annotations

from torch import nn

from nanoinfer.models.gemma import GemmaForCausalLM
from nanoinfer.models.gemma3 import language_config
from nanoinfer.models.layers.attention import layer_sliding_window
from nanoinfer.models.layers.gemma4 import Gemma4Attention, Gemma4DecoderLayer, Gemma4Model, Gemma4Router
from nanoinfer.models.layers.mlp import GatedMLP
from nanoinfer.models.layers.moe import FusedMoE
from nanoinfer.models.layers.norm import UnscaledRMSNorm
from nanoinfer.models.layers.rotary import RotaryEmbedding
from nanoinfer.models.olmo2 import Olmo2RMSNorm

ARCHITECTURE_VL = "Gemma4ForConditionalGeneration"
_LANGUAGE_PREFIX = "model.language_model."  # -> "model.": transformers 5's names of the language model
_TOWER_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
_KV_ONLY = ("k_proj", "v_proj", "k_norm", "v_norm")  # what a sharing layer does not have


class Gemma4ForCausalLM(GemmaForCausalLM):
    norm_class = Olmo2RMSNorm  # w as stored, scaled in float32 before rounding (transformers' Gemma4RMSNorm)
    supports_tensor_parallel = False  # Config refuses tensor_parallel_size > 1 (module docstring)

    def build_model(self, hf_config, backend, max_position: int) -> Gemma4Model:
        check_text_config(hf_config)
        self.kv_sources = kv_sources(hf_config)
        tables: dict[tuple, RotaryEmbedding] = {}  # one table per layer type (and head size), shared by its layers
        layers = []
        for i, kind in enumerate(hf_config.layer_types):
            head_dim, _ = attention_shape(hf_config, i)
            if (kind, head_dim) not in tables:
                tables[kind, head_dim] = RotaryEmbedding(hf_config, head_dim, max_position, layer_type=kind)
            layers.append(self.build_layer(hf_config, i, backend, tables[kind, head_dim]))
        per_layer = getattr(hf_config, "hidden_size_per_layer_input", None) or None  # 0 or None: none
        return Gemma4Model(
            hf_config.vocab_size, hf_config.hidden_size, layers, self.norm(hf_config),
            embed_scale=hf_config.hidden_size**0.5, per_layer_input_size=per_layer,
            per_layer_vocab_size=getattr(hf_config, "vocab_size_per_layer_input", None),
            per_layer_norm=self.norm(hf_config, per_layer) if per_layer else None,
        )  # fmt: skip

    def build_layer(self, hf_config, layer_idx: int, backend, rotary) -> nn.Module:
        per_layer = getattr(hf_config, "hidden_size_per_layer_input", None) or None
        layer = Gemma4DecoderLayer(
            self.build_attention(hf_config, layer_idx, backend, rotary), self.build_mlp(hf_config, layer_idx),
            *(self.norm(hf_config) for _ in range(4)), hidden_act=hf_config.hidden_activation,
            per_layer_input_size=per_layer, post_per_layer_input_norm=self.norm(hf_config) if per_layer else None,
        )  # fmt: skip
        if getattr(hf_config, "enable_moe_block", False):
            eps = getattr(hf_config, "rms_norm_eps", 1e-6)
            layer.add_experts(
                Gemma4Router(hf_config.hidden_size, hf_config.num_experts, hf_config.top_k_experts, eps),
                FusedMoE(hf_config.num_experts, hf_config.hidden_size, hf_config.moe_intermediate_size,
                         hf_config.hidden_activation),
                *(self.norm(hf_config) for _ in range(3)),
            )  # fmt: skip
        return layer

    def build_attention(self, hf_config, layer_idx: int, backend, rotary) -> Gemma4Attention:
        head_dim, num_kv_heads = attention_shape(hf_config, layer_idx)
        sliding = hf_config.layer_types[layer_idx] == "sliding_attention"
        source = self.kv_sources[layer_idx]
        return Gemma4Attention(
            hf_config.hidden_size, hf_config.num_attention_heads, num_kv_heads, head_dim, backend, rotary,
            bias=bool(getattr(hf_config, "attention_bias", False)),
            sliding_window=layer_sliding_window(hf_config, layer_idx),
            k_eq_v=bool(getattr(hf_config, "attention_k_eq_v", False)) and not sliding, kv_shared_from=source,
            q_norm=self.norm(hf_config, head_dim),
            k_norm=self.norm(hf_config, head_dim) if source is None else None,
            v_norm=UnscaledRMSNorm(getattr(hf_config, "rms_norm_eps", 1e-6)) if source is None else None,
        )  # fmt: skip

    def build_mlp(self, hf_config, layer_idx: int) -> nn.Module:
        wide = getattr(hf_config, "use_double_wide_mlp", False) and self.kv_sources[layer_idx] is not None
        size = hf_config.intermediate_size * (2 if wide else 1)
        return GatedMLP(hf_config.hidden_size, size, hf_config.hidden_activation)

    def sanitize(self, name: str, tensor_fn):
        # Checkpoints may keep k/v projections and norms of the sharing layers, which transformers ignores too.
        if ".self_attn." in name and name.split(".self_attn.")[1].split(".")[0] in _KV_ONLY:
            layer = int(name.split(".layers.")[1].split(".")[0])
            if self.kv_sources[layer] is not None:
                return []
        return [(name, tensor_fn)]


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """The language model of a Gemma 4 checkpoint with vision (and audio) towers, which are skipped. Built from the
    top-level config or its text part (language_config either way); transformers applies the final soft cap here
    too."""

    def __init__(self, hf_config, backend, max_position: int):
        super().__init__(language_config(hf_config, ARCHITECTURE_VL), backend, max_position)

    @classmethod
    def text_config(cls, hf_config) -> tuple[object, str | None]:
        """(the config nanoinfer runs, a note for the user): the text part of the checkpoint's config."""
        note = "vision and audio towers skipped: nanoinfer runs the text part"
        return language_config(hf_config, ARCHITECTURE_VL), note

    def sanitize(self, name: str, tensor_fn):
        if name.startswith(_TOWER_PREFIXES):
            return []
        if name.startswith(_LANGUAGE_PREFIX):
            name = "model." + name[len(_LANGUAGE_PREFIX) :]
        return super().sanitize(name, tensor_fn)


def check_text_config(hf_config) -> None:
    """What nanoinfer does not run, refused (a ValueError is reported by Config as a problem with config.json)."""
    # "vision" attends bidirectionally over image tokens only: text is causal, which is all nanoinfer feeds
    if getattr(hf_config, "use_bidirectional_attention", None) == "all":
        raise ValueError("use_bidirectional_attention is 'all': that is an encoder (embedding) model, and "
                         "nanoinfer generates only with causal attention")  # fmt: skip


def attention_shape(hf_config, layer_idx: int) -> tuple[int, int]:
    """(head size, KV heads) of a layer. transformers resolves the global layers' own (global_head_dim, and
    num_global_key_value_heads with attention_k_eq_v) into per_layer_config; reading head_dim off the config
    itself raises there when layers differ. Configs without it keep them as fields of their own."""
    per_layer = getattr(hf_config, "per_layer_config", None)
    if per_layer is not None:
        layer = per_layer[layer_idx]
        return layer.head_dim, layer.num_key_value_heads
    full = hf_config.layer_types[layer_idx] == "full_attention"
    head_dim = (getattr(hf_config, "global_head_dim", None) if full else None) or hf_config.head_dim
    k_eq_v = full and getattr(hf_config, "attention_k_eq_v", False)
    num_kv_heads = getattr(hf_config, "num_global_key_value_heads", None) if k_eq_v else None
    return head_dim, num_kv_heads or hf_config.num_key_value_heads


def kv_sources(hf_config) -> list[int | None]:
    """Per layer, the layer whose keys and values it reads (None: its own): from the first of the last
    num_kv_shared_layers on, the last earlier layer of the same type (transformers' kv_sharing_modes)."""
    layer_types = list(hf_config.layer_types)
    first_shared = len(layer_types) - (getattr(hf_config, "num_kv_shared_layers", 0) or 0)
    sources: list[int | None] = [None] * len(layer_types)
    for i in range(max(first_shared, 0), len(layer_types)):
        earlier = [j for j in range(max(first_shared, 0)) if layer_types[j] == layer_types[i]]
        if not earlier:
            raise ValueError(f"num_kv_shared_layers ({hf_config.num_kv_shared_layers}) leaves no earlier "
                             f"{layer_types[i]} layer for layer {i} to read its keys and values from")  # fmt: skip
        sources[i] = earlier[-1]
    return sources
