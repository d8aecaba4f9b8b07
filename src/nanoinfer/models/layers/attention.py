"""The attention layer of a decoder: fused q/k/v projection, optional q/k norms, rotary, the paged KV cache through
the attention backend, output projection. Each family sets the options its checkpoints use.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoinfer.attention.backend import AttentionBackend
from nanoinfer.distributed import all_gather_last_dim, get_tp_rank, get_tp_size
from nanoinfer.models.layers.linear import QKVParallelLinear, RowParallelLinear
from nanoinfer.models.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    """Options (transformers' names where it has them):
    scale: the score scale (head_dim ** -0.5 unless the family says otherwise, e.g. Gemma's query_pre_attn_scalar);
    sliding_window: keys at most this many positions back, the query's own included (None: all);
    soft_cap: attention-logit soft-capping (Gemma 2);
    sinks: a learned logit per head added to the softmax's sum, with no value (gpt-oss's `self_attn.sinks`);
    q_norm / k_norm: a norm over each head (Qwen3, Gemma 3) or, with qk_norm_per_head=False, over the whole
    projection (OLMo 2: under tensor parallelism the norm reads every rank's part);
    rotary: None for a layer without position embedding (SmolLM3's no-rope layers);
    output_gate: the query projection also gives each head a gate, and the output is scaled by its sigmoid before
    o_proj (Qwen3-Next, Qwen3.5: q_proj's rows are each head's query then its gate)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 backend: AttentionBackend, rotary: RotaryEmbedding | None, *, qkv_bias: bool = False,
                 o_bias: bool = False, scale: float | None = None, sliding_window: int | None = None,
                 soft_cap: float | None = None, sinks: bool = False, q_norm: nn.Module | None = None,
                 k_norm: nn.Module | None = None, qk_norm_per_head: bool = True,
                 output_gate: bool = False):  # fmt: skip
        super().__init__()
        # The shard this layer holds, read once: rank 0 builds its shard under tensor parallelism, then runs it with
        # the process-wide setting back at 1.
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        tp = self.tp_size
        self.head_dim = head_dim
        self.num_heads = num_heads // tp
        self.num_kv_heads = num_kv_heads // tp
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.soft_cap = soft_cap
        # The sink logits of this rank's heads; the model's dtype after model.to() (as transformers keeps them), handed
        # to the backend in float32.
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if sinks else None
        if sinks:
            self.sinks.weight_loader = self._load_sinks
        self.output_gate = output_gate
        query_rows = 2 * num_heads if output_gate else num_heads  # a gated head's query rows, then its gate rows
        self.qkv_proj = QKVParallelLinear(hidden_size, head_dim, query_rows, num_kv_heads, qkv_bias)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, bias=o_bias)
        self.qk_norm = q_norm is not None
        if self.qk_norm:
            self.q_norm, self.k_norm = q_norm, k_norm
        self.qk_norm_per_head = qk_norm_per_head
        self.rotary = rotary
        self.backend = backend

    def forward(self, positions, hidden_states, kv_cache: tuple[torch.Tensor, torch.Tensor], metadata,
                output_rows=None):
        """Attention's output projected back to the hidden size: every row, or only output_rows (see
        DecoderModel.forward: the last layer's other rows are never read)."""
        qkv = self.qkv_proj(hidden_states)
        gate = None
        if self.output_gate:
            q_gate, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
            q_gate = q_gate.view(-1, self.num_heads, 2 * self.head_dim)
            q, gate = q_gate[..., : self.head_dim], q_gate[..., self.head_dim :].reshape(-1, self.q_size)
            q = q.reshape(-1, self.q_size)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm and not self.qk_norm_per_head:
            q, k = self._whole_norm(self.q_norm, q), self._whole_norm(self.k_norm, k)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm and self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        k_cache, v_cache = kv_cache
        self.backend.store_kvcache(k, v, k_cache, v_cache, metadata.slot_mapping)
        if output_rows is not None and output_rows.numel() == 0:  # only the keys and values were needed
            return hidden_states.new_empty(0, hidden_states.shape[-1])
        out = self.backend.forward(q, k_cache, v_cache, metadata, self.scale, new_kv=(k, v),
                                   sliding_window=self.sliding_window, soft_cap=self.soft_cap,
                                   sinks=None if self.sinks is None else self.sinks.float())  # fmt: skip
        out = out.reshape(-1, self.q_size)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out if output_rows is None else out[output_rows])

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded.narrow(0, self.tp_rank * self.num_heads, self.num_heads))

    def _whole_norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A norm over the whole projection; a rank holds a slice of it, so it norms the gathered rows."""
        if self.tp_size == 1:
            return norm(x.contiguous())
        full = norm(all_gather_last_dim(x))
        size = x.shape[-1]
        return full[..., self.tp_rank * size : (self.tp_rank + 1) * size].contiguous()


def layer_sliding_window(hf_config, layer_idx: int) -> int | None:
    """The config's sliding_window on a layer its `layer_types` marks "sliding_attention" (Gemma 2-4, OLMo 3, Qwen
    with use_sliding_window), else None: the whole context."""
    layer_types = getattr(hf_config, "layer_types", None)
    if not layer_types or layer_types[layer_idx] != "sliding_attention":
        return None
    return getattr(hf_config, "sliding_window", None)
