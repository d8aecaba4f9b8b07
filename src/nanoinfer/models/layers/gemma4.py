"""Gemma 4's blocks (models/gemma4.py builds them; transformers' modeling_gemma4.py is the spec):

    Gemma4Attention     q/k/v head norms, values equal to keys on some layers, or no keys and values of its own
                        (it reads an earlier layer's cache: KV sharing)
    Gemma4DecoderLayer  Gemma 3's sandwich norms, then the layer's per-layer input gated in, the whole stream
                        scaled by layer_scalar
    Gemma4Model         the per-layer inputs, computed once a step from the token ids and their embeddings

Because layer_scalar scales the whole stream, layers pass the stream itself (no separate residual).
"""

from __future__ import annotations

import torch
from torch import nn

from nanoinfer.models.layers.decoder import DecoderModel
from nanoinfer.models.layers.embedding import VocabParallelEmbedding
from nanoinfer.models.layers.linear import GATED_ACTIVATIONS, ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanoinfer.models.layers.moe import select_experts
from nanoinfer.models.layers.norm import UnscaledRMSNorm
from nanoinfer.platforms import current_platform


class Gemma4Attention(nn.Module):
    """Attention under the names the runner and ModelSpec read off every attention layer (num_heads, num_kv_heads,
    head_dim, sliding_window, rotary, and kv_shared_from: the layer whose cache this one reads, or None). One rank.

    k_eq_v: no value projection; the values are the key projection (before the key's norm and rotary), normed.
    kv_shared_from: no key or value projection; the layer attends over that layer's cache, which it is handed as
    its own and never writes (the source layer, earlier in the stack, has stored this step's keys already)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, backend, rotary, *,
                 bias: bool, sliding_window: int | None, k_eq_v: bool, kv_shared_from: int | None,
                 q_norm: nn.Module, k_norm: nn.Module | None, v_norm: nn.Module | None):  # fmt: skip
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size = num_heads * head_dim
        self.scale = 1.0  # q and k are normed: transformers' Gemma 4 scales scores by 1
        self.sliding_window = sliding_window
        self.kv_shared_from = kv_shared_from
        shards = ("q",) if kv_shared_from is not None else ("q", "k") if k_eq_v else ("q", "k", "v")
        self.qkv_proj = QKVParallelLinear(hidden_size, head_dim, num_heads, num_kv_heads, bias, shards)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm = q_norm
        if kv_shared_from is None:
            self.k_norm, self.v_norm = k_norm, v_norm
        self.rotary = rotary
        self.backend = backend

    def forward(self, positions, hidden_states, kv_cache: tuple[torch.Tensor, torch.Tensor], metadata,
                output_rows=None):  # fmt: skip
        """As Attention.forward: the output of every row, or of output_rows only."""
        parts = self.qkv_proj(hidden_states).split(self.qkv_proj.output_sizes, dim=-1)
        q = self.q_norm(parts[0].view(-1, self.num_heads, self.head_dim))
        k_cache, v_cache = kv_cache
        new_kv = None  # a sharing layer reads this step's keys from the cache, where its source layer put them
        if self.kv_shared_from is None:
            k = parts[1].view(-1, self.num_kv_heads, self.head_dim)
            v = self.v_norm(parts[2].view(-1, self.num_kv_heads, self.head_dim) if len(parts) == 3 else k)
            q, k = self.rotary(positions, q, self.k_norm(k))
            self.backend.store_kvcache(k, v, k_cache, v_cache, metadata.slot_mapping)
            new_kv = (k, v)
        else:
            q, _ = self.rotary(positions, q, q.new_empty(q.shape[0], 0, self.head_dim))  # q alone: no key heads
        if output_rows is not None and output_rows.numel() == 0:  # only the keys and values were needed
            return hidden_states.new_empty(0, hidden_states.shape[-1])
        out = self.backend.forward(q, k_cache, v_cache, metadata, self.scale, new_kv=new_kv,
                                   sliding_window=self.sliding_window)  # fmt: skip
        out = out.reshape(-1, self.q_size)
        return self.o_proj(out if output_rows is None else out[output_rows])


class Gemma4Router(nn.Module):
    """Gemma 4's router: the stream normed without weight, scaled by `scale` and 1 / sqrt(hidden_size), projected to
    expert scores; the top k of their softmax, renormalized, each times its expert's `per_expert_scale`."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, eps: float):
        super().__init__()
        self.norm = UnscaledRMSNorm(eps)
        self.proj = nn.Linear(hidden_size, num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts))
        self.top_k, self.root_size = top_k, hidden_size**-0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.proj(self.norm(x) * self.scale * self.root_size)
        weights, ids = select_experts(scores, self.top_k, "softmax", renormalize=True)
        return weights * self.per_expert_scale[ids].float(), ids


class Gemma4DecoderLayer(nn.Module):
    """norm -> attention -> norm -> add, norm -> MLP -> norm -> add, then (with per-layer inputs)
    gate(stream) -> act -> * the layer's input -> projection -> norm -> add; the stream scaled by layer_scalar."""

    def __init__(self, self_attn: Gemma4Attention, mlp: nn.Module, input_layernorm: nn.Module,
                 post_attention_layernorm: nn.Module, pre_feedforward_layernorm: nn.Module,
                 post_feedforward_layernorm: nn.Module, *, hidden_act: str, per_layer_input_size: int | None = None,
                 post_per_layer_input_norm: nn.Module | None = None):  # fmt: skip
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm
        self.pre_feedforward_layernorm = pre_feedforward_layernorm
        self.post_feedforward_layernorm = post_feedforward_layernorm
        hidden_size = input_layernorm.weight.shape[0]
        self.layer_scalar = nn.Parameter(torch.ones(1))  # a buffer in transformers, saved in checkpoints
        self.per_layer_input_gate = None
        if per_layer_input_size:
            if hidden_act not in GATED_ACTIVATIONS:
                raise ValueError(f"unsupported hidden_activation {hidden_act!r}")
            self.activation = GATED_ACTIVATIONS[hidden_act]
            self.platform = current_platform()
            self.per_layer_input_gate = ColumnParallelLinear(hidden_size, [per_layer_input_size])
            self.per_layer_projection = RowParallelLinear(per_layer_input_size, hidden_size)
            self.post_per_layer_input_norm = post_per_layer_input_norm

    def add_experts(self, router: Gemma4Router, experts: nn.Module, post_feedforward_layernorm_1: nn.Module,
                    pre_feedforward_layernorm_2: nn.Module, post_feedforward_layernorm_2: nn.Module) -> None:
        """The MoE variant (enable_moe_block): experts beside the dense MLP, both fed the stream after attention
        (the MLP through pre_feedforward_layernorm, the experts through pre_feedforward_layernorm_2, the router
        through its own norm), each output normed, summed, then normed as the dense MLP's alone is."""
        self.router, self.experts = router, experts
        self.post_feedforward_layernorm_1 = post_feedforward_layernorm_1
        self.pre_feedforward_layernorm_2 = pre_feedforward_layernorm_2
        self.post_feedforward_layernorm_2 = post_feedforward_layernorm_2

    def feed_forward(self, hidden_states, stream):
        """The MLP's output (and the experts', with them) on its way into the stream."""
        out = self.mlp(hidden_states)
        if getattr(self, "experts", None) is None:
            return out
        topk_weights, topk_ids = self.router(stream)
        experts = self.experts(self.pre_feedforward_layernorm_2(stream), topk_weights, topk_ids)
        return self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(experts)

    def forward(self, positions, stream, per_layer_input, kv_cache, metadata, output_rows=None):
        """The next layer's stream: of every row, or of output_rows only (their attention still sees every row)."""
        hidden_states = self.self_attn(positions, self.input_layernorm(stream), kv_cache, metadata, output_rows)
        if output_rows is not None:
            stream = stream[output_rows]
            per_layer_input = None if per_layer_input is None else per_layer_input[output_rows]
            if output_rows.numel() == 0:
                return hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        # stream + attention, and its norm, in one op (which may reuse both inputs: neither is read again)
        hidden_states, stream = self.pre_feedforward_layernorm(hidden_states, stream)
        stream = stream + self.post_feedforward_layernorm(self.feed_forward(hidden_states, stream))
        if self.per_layer_input_gate is not None:
            gated = self._gated(stream, per_layer_input)
            stream = stream + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return stream * self.layer_scalar

    def _gated(self, stream, per_layer_input):
        """act(gate(stream)) * the layer's input, as the MLP's gated activation: the platform's op on [gate, input]
        rows. Not torch's activation on the [rows, size] gate itself: that vectorizes across rows, so a row's bits
        would depend on how many rows run with it (the last layer runs only the sampled ones)."""
        both = torch.cat((self.per_layer_input_gate(stream), per_layer_input), dim=-1)
        if self.activation == "silu":
            return self.platform.silu_and_mul(both)
        return self.platform.gelu_tanh_and_mul(both)


class Gemma4Model(DecoderModel):
    """DecoderModel with Gemma 4's per-layer inputs (per_layer_input_size > 0): each layer's is
    (norm(proj(embeddings) / sqrt(hidden_size)) + embed_per_layer(ids) * sqrt(size)) / sqrt(2), where proj and
    embed_per_layer give every layer's at once ([tokens, layers x size])."""

    def __init__(self, vocab_size: int, hidden_size: int, layers, norm: nn.Module, embed_scale: float, *,
                 per_layer_input_size: int | None = None, per_layer_vocab_size: int | None = None,
                 per_layer_norm: nn.Module | None = None):  # fmt: skip
        super().__init__(vocab_size, hidden_size, layers, norm, embed_scale=embed_scale)
        self.per_layer_input_size = per_layer_input_size or None
        if self.per_layer_input_size:
            width = len(self.layers) * per_layer_input_size
            self.embed_tokens_per_layer = VocabParallelEmbedding(per_layer_vocab_size, width)
            self.per_layer_model_projection = ColumnParallelLinear(hidden_size, [width])
            self.per_layer_projection_norm = per_layer_norm
            self.hidden_size = hidden_size

    def per_layer_inputs(self, input_ids: torch.Tensor, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """[tokens, layers, size], in transformers' order of operations."""
        shape = (input_ids.shape[0], len(self.layers), self.per_layer_input_size)
        scale = torch.tensor(self.per_layer_input_size**0.5, dtype=inputs_embeds.dtype)
        tokens = (self.embed_tokens_per_layer(input_ids) * scale).view(shape)
        projected = self.per_layer_model_projection(inputs_embeds) * self.hidden_size**-0.5
        projected = self.per_layer_projection_norm(projected.view(shape))
        return (projected + tokens) * 2.0**-0.5

    def forward(self, input_ids, positions, kv_caches, metadata, logits_indices=None):
        """As DecoderModel.forward (the last layer runs its rows in logits_indices alone)."""
        hidden_states = self.embed(input_ids)
        per_layer = self.per_layer_inputs(input_ids, hidden_states) if self.per_layer_input_size else None
        if logits_indices is not None and logits_indices.numel() == input_ids.numel():
            logits_indices = None
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            rows = logits_indices if i == last else None
            layer_input = None if per_layer is None else per_layer[:, i]
            hidden_states = layer(positions, hidden_states, layer_input, kv_cache, metadata, rows)
        if hidden_states.shape[0] == 0:
            return hidden_states
        return self.norm(hidden_states)
