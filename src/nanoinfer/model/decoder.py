"""One decoder-only transformer for the Llama family: Llama (SmolLM2, Llama 3, Mistral), Qwen2 and Qwen3.

They differ in three switches read from the HF config: biases on q/k/v (Qwen2), per-head q/k RMSNorm
(Qwen3), and the rope type. Inputs are flat token batches [num_tokens] with AttentionMetadata; no padding.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoinfer.attention.backend import AttentionBackend
from nanoinfer.attention.metadata import AttentionMetadata
from nanoinfer.distributed import get_tp_size
from nanoinfer.model.layers import (
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    VocabParallelEmbedding,
)
from nanoinfer.model.linear import GateUpParallelLinear, QKVParallelLinear, RowParallelLinear
from nanoinfer.platforms import current_platform


def head_dim_of(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


class Attention(nn.Module):
    def __init__(self, hf_config, backend: AttentionBackend, rotary: RotaryEmbedding):
        super().__init__()
        tp = get_tp_size()
        self.head_dim = head_dim_of(hf_config)
        self.num_heads = hf_config.num_attention_heads // tp
        self.num_kv_heads = hf_config.num_key_value_heads // tp
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        model_type = hf_config.model_type
        qkv_bias = model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            hf_config.hidden_size, self.head_dim, hf_config.num_attention_heads, hf_config.num_key_value_heads, qkv_bias
        )
        self.o_proj = RowParallelLinear(
            hf_config.num_attention_heads * self.head_dim, hf_config.hidden_size,
            bias=bool(getattr(hf_config, "attention_bias", False)) and model_type != "qwen2",
        )
        self.qk_norm = model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps)
        self.rotary = rotary
        self.backend = backend

    def forward(self, positions, hidden_states, kv_cache: tuple[torch.Tensor, torch.Tensor], metadata,
                output_rows=None):
        """Attention's output projected back to the hidden size: every row, or only output_rows (see
        DecoderModel.forward: the last layer's other rows are never read)."""
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        k_cache, v_cache = kv_cache
        self.backend.store_kvcache(k, v, k_cache, v_cache, metadata.slot_mapping)
        if output_rows is not None and output_rows.numel() == 0:  # only the keys and values were needed
            return hidden_states.new_empty(0, hidden_states.shape[-1])
        out = self.backend.forward(q, k_cache, v_cache, metadata, self.scale, new_kv=(k, v)).reshape(-1, self.q_size)
        return self.o_proj(out if output_rows is None else out[output_rows])


class MLP(nn.Module):
    def __init__(self, hf_config):
        super().__init__()
        inter = hf_config.intermediate_size
        self.gate_up_proj = GateUpParallelLinear(hf_config.hidden_size, inter)
        self.down_proj = RowParallelLinear(inter, hf_config.hidden_size, bias=False)
        self.hidden_size = hf_config.hidden_size
        self.chunk_bytes = current_platform().mlp_chunk_bytes

    def forward(self, x):
        """The MLP of every row, chunks of rows at a time where the platform bounds the activations (at least 64
        rows a chunk; rows are independent, so the same result)."""
        rows = x.shape[0]
        if self.chunk_bytes is None:
            return self._forward(x)
        chunk = max(64, self.chunk_bytes // (sum(self.gate_up_proj.output_sizes) * x.element_size()))
        if rows <= chunk:
            return self._forward(x)
        out = x.new_empty(rows, self.hidden_size)
        for start in range(0, rows, chunk):
            out[start : start + chunk] = self._forward(x[start : start + chunk])
        return out

    def _forward(self, x):
        return self.down_proj(self.gate_up_proj.silu_and_mul(x))


class DecoderLayer(nn.Module):
    def __init__(self, hf_config, backend, rotary):
        super().__init__()
        self.self_attn = Attention(hf_config, backend, rotary)
        self.mlp = MLP(hf_config)
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

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
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class DecoderModel(nn.Module):
    def __init__(self, hf_config, backend, max_position: int):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        rotary = RotaryEmbedding(hf_config, head_dim_of(hf_config), max_position)
        self.layers = nn.ModuleList(
            DecoderLayer(hf_config, backend, rotary) for _ in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches, metadata, logits_indices=None):
        """The final hidden states of every row, or of the rows in logits_indices (in that order).

        Why logits_indices: only the rows a step samples are read after the model, and the last layer's
        keys and values come from its input, so its o_proj, MLP and norms run for those rows alone (a prompt's
        step samples one row a prompt). Each kept row's
        arithmetic, and so its bits, are the same as when every row runs (the kernels' row sums do not
        depend on how many rows there are)."""
        hidden_states, residual = self.embed_tokens(input_ids), None
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
    """Weights named as in HF checkpoints, with q/k/v and gate/up fused (see `packed_modules`)."""

    # checkpoint name fragment -> (our fused parameter fragment, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, hf_config, backend: AttentionBackend, max_position: int):
        super().__init__()
        self.model = DecoderModel(hf_config, backend, max_position)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, kv_caches, metadata: AttentionMetadata, logits_indices=None):
        return self.model(input_ids, positions, kv_caches, metadata, logits_indices)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)
