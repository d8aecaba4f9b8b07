"""The decoder stack every family builds on: DecoderModel (embedding, layers, final norm) and CausalLM (the LM head,
weight-name mapping, the model's spec), with the three layer shapes the families use:

    PreNormDecoderLayer       norm -> attention -> add, norm -> MLP -> add           Llama, Qwen, Mistral, Phi-3
    SandwichNormDecoderLayer  the same with a norm after attention and after the MLP  Gemma 2, 3, 4
    PostNormDecoderLayer      attention -> norm -> add, MLP -> norm -> add            OLMo 2, 3

Inputs are flat token batches [num_tokens] with AttentionMetadata; no padding. A layer takes and returns
(hidden, residual), the stream being their sum, so the next norm can add and normalise in one fused op.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from nanoinfer.attention.metadata import AttentionMetadata
from nanoinfer.models.layers.adaptable import lora_targets
from nanoinfer.models.layers.attention import Attention
from nanoinfer.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nanoinfer.models.layers.rotary import RotaryEmbedding
from nanoinfer.models.spec import AttentionLayerSpec, LinearAttentionLayerSpec, ModelSpec


class PreNormDecoderLayer(nn.Module):
    def __init__(self, self_attn: Attention, mlp: nn.Module, input_layernorm: nn.Module,
                 post_attention_layernorm: nn.Module):  # fmt: skip
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm

    def forward(self, positions, hidden_states, residual, kv_cache, metadata, output_rows=None):
        """(hidden, residual) of every row, or of output_rows only (their attention still sees every row)."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, metadata, output_rows)
        if output_rows is not None:
            residual = residual[output_rows]
            if output_rows.numel() == 0:
                return hidden_states, residual
        return self.feed_forward(hidden_states, residual)

    def feed_forward(self, attended, residual):
        """(hidden, residual) after attention's output `attended` joins the residual stream and the MLP runs."""
        hidden_states, residual = self.post_attention_layernorm(attended, residual)
        return self.mlp(hidden_states), residual


class SandwichNormDecoderLayer(PreNormDecoderLayer):
    """The pre-norm layer with attention's output and the MLP's normed before they join the stream."""

    def __init__(self, self_attn: Attention, mlp: nn.Module, input_layernorm: nn.Module,
                 post_attention_layernorm: nn.Module, pre_feedforward_layernorm: nn.Module,
                 post_feedforward_layernorm: nn.Module):  # fmt: skip
        super().__init__(self_attn, mlp, input_layernorm, post_attention_layernorm)
        self.pre_feedforward_layernorm = pre_feedforward_layernorm
        self.post_feedforward_layernorm = post_feedforward_layernorm

    def feed_forward(self, attended, residual):
        hidden_states = self.post_attention_layernorm(attended)
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual


class PostNormDecoderLayer(nn.Module):
    def __init__(self, self_attn: Attention, mlp: nn.Module, post_attention_layernorm: nn.Module,
                 post_feedforward_layernorm: nn.Module):  # fmt: skip
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.post_attention_layernorm = post_attention_layernorm
        self.post_feedforward_layernorm = post_feedforward_layernorm

    def forward(self, positions, hidden_states, residual, kv_cache, metadata, output_rows=None):
        stream = hidden_states if residual is None else hidden_states + residual
        hidden_states = self.self_attn(positions, stream, kv_cache, metadata, output_rows)
        if output_rows is not None:
            stream = stream[output_rows]
            if output_rows.numel() == 0:
                return hidden_states, stream
        stream = stream + self.post_attention_layernorm(hidden_states)
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class DecoderModel(nn.Module):
    """embed_tokens -> layers -> norm. embed_scale multiplies the embeddings (Gemma: sqrt(hidden_size), rounded to
    the model's dtype as transformers does)."""

    def __init__(self, vocab_size: int, hidden_size: int, layers: Iterable[nn.Module], norm: nn.Module,
                 embed_scale: float | None = None):  # fmt: skip
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.embed_scale = embed_scale

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            hidden_states = hidden_states * torch.tensor(self.embed_scale, dtype=hidden_states.dtype)
        return hidden_states

    def forward(self, input_ids, positions, kv_caches, metadata, logits_indices=None):
        """The final hidden states of every row, or of the rows in logits_indices (in that order).

        Why logits_indices: only the rows a step samples are read after the model, and the last layer's
        keys and values come from its input, so its o_proj, MLP and norms run for those rows alone (a prompt's
        step samples one row a prompt). Each kept row's arithmetic, and so its bits, are the same as when every
        row runs (the kernels' row sums do not depend on how many rows there are)."""
        hidden_states, residual = self.embed(input_ids), None
        if logits_indices is not None and logits_indices.numel() == input_ids.numel():
            logits_indices = None  # every row, in row order (the runner's are ascending): nothing to leave out
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            rows = logits_indices if i == last else None
            hidden_states, residual = layer(positions, hidden_states, residual, kv_cache, metadata, rows)
        if hidden_states.shape[0] == 0:
            return hidden_states
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class CausalLM(nn.Module):
    """A decoder with an LM head. A family subclasses it and builds `self.model` in `build_model`.

    Weights are named as in HF checkpoints, with q/k/v and gate/up fused (see `packed_modules`); a family whose
    checkpoint names differ maps them in `sanitize` (Phi-3's fused projections, Gemma 3's `language_model.`).
    """

    # checkpoint name fragment -> (our fused parameter fragment, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # The layer shape a platform's fused decode runner may run (platforms/cpu/decode_runner.py), or None.
    fused_decode_shape: str | None = None
    supports_tensor_parallel = True  # False: Config and plan-memory keep the family on one rank

    def __init__(self, hf_config, backend, max_position: int):
        super().__init__()
        self.model = self.build_model(hf_config, backend, max_position)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size,
                                      soft_cap=getattr(hf_config, "final_logit_softcapping", None))  # fmt: skip
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def build_model(self, hf_config, backend, max_position: int) -> DecoderModel:
        raise NotImplementedError

    def forward(self, input_ids, positions, kv_caches, metadata: AttentionMetadata, logits_indices=None):
        return self.model(input_ids, positions, kv_caches, metadata, logits_indices)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def sanitize(self, name: str, tensor_fn) -> Iterable[tuple[str, object]]:
        """Checkpoint tensor `name` -> (our name, tensor or a function giving it) pairs; `tensor_fn()` reads it.
        Families with other names or fused checkpoint tensors override this; read the tensor only if kept."""
        return [(name, tensor_fn)]

    def attention_layers(self) -> list[Attention]:
        """Each layer's attention (a hybrid model's attention layers only): the layers with a KV cache."""
        return [layer.self_attn for layer in self.model.layers
                if not getattr(layer.self_attn, "is_linear_attention", False)]  # fmt: skip

    def linear_attention_layers(self) -> list[nn.Module]:
        """A hybrid model's Gated DeltaNet layers (models/layers/gated_delta_net.py): the layers with a state slot."""
        return [layer.self_attn for layer in self.model.layers
                if getattr(layer.self_attn, "is_linear_attention", False)]  # fmt: skip

    def rotary_embeddings(self) -> list[RotaryEmbedding]:
        """Every distinct rotary table (layers share them), to move with the model."""
        unique = {id(a.rotary): a.rotary for a in self.attention_layers() if a.rotary is not None}
        return list(unique.values())

    def describe(self, architecture: str) -> ModelSpec:
        """This model's ModelSpec (call on a model built with tensor_parallel_size 1, e.g. on the meta device)."""
        layers = tuple(
            AttentionLayerSpec(a.num_heads, a.num_kv_heads, a.head_dim, a.sliding_window,
                               getattr(a, "kv_shared_from", None))
            for a in self.attention_layers()
        )

        def count(module: nn.Module) -> int:
            return sum(p.numel() for p in module.parameters())

        matmul = sum(m.weight.numel() for m in self.model.layers.modules() if getattr(m, "uses_linear_method", False))
        widths = [m.output_sizes[0] for m in self.modules() if hasattr(m, "act_and_mul")]
        experts = [m for m in self.model.layers.modules() if getattr(m, "uses_expert_method", False)]
        routers = [m for m in self.model.layers.modules() if hasattr(m, "top_k")]
        moe = {}
        lora_shapes, lora_slices = lora_targets(self)
        linear = tuple(
            LinearAttentionLayerSpec(m.num_k_heads, m.num_v_heads, m.k_head_dim, m.v_head_dim, m.conv_kernel_size)
            for m in self.linear_attention_layers()
        )
        if experts:
            top_k = max(r.top_k for r in routers)
            widths.append(top_k * max(m.intermediate_size for m in experts))  # a token's rows through the experts
            moe = dict(num_moe_layers=len(experts), num_experts=max(m.num_experts for m in experts),
                       experts_per_token=top_k, expert_intermediate_size=max(m.intermediate_size for m in experts),
                       params_per_expert=max(m.w13_weight[0].numel() + m.w2_weight[0].numel() for m in experts))
        return ModelSpec(
            architecture=architecture, hidden_size=self.lm_head.weight.shape[1],
            vocab_size=self.lm_head.vocab_size, layers=layers,
            intermediate_size=max(widths),
            embedding_params=count(self.model) - count(self.model.layers) - count(self.model.norm),
            layer_params=count(self.model.layers), matmul_params=matmul,
            final_norm_params=count(self.model.norm),
            lm_head_params=0 if self.tie_word_embeddings else self.lm_head.weight.numel(),
            supports_tensor_parallel=self.supports_tensor_parallel, linear_attention_layers=linear,
            lora_shapes=lora_shapes, lora_slices=lora_slices, **moe,
        )  # fmt: skip
