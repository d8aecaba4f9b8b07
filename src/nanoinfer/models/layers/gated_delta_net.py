"""Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5: one fused input projection (q, k, v, the
output gate z, the update rate b and the decay a), a short causal convolution over q, k and v, the gated delta rule,
a gated RMSNorm and the output projection. Its memory is a fixed-size state per sequence (the convolution's last
inputs and the rule's matrix), held in the engine's state cache (attention/gated_delta.py), not in the KV cache.

Tensor parallelism splits the heads: each rank holds its share of the key heads and the value heads they serve, the
matching convolution channels and decays, and the output projection's columns (one all-reduce).
transformers' Qwen3NextGatedDeltaNet and Qwen3_5GatedDeltaNet are the spec.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.distributed import get_tp_rank, get_tp_size
from nanoinfer.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from nanoinfer.platforms import current_platform


class RMSNormGated(nn.Module):
    """norm(x) * w * silu(gate) over each value head, as transformers' RMSNormGated: normalised in float32, rounded
    to the model's dtype, scaled by w (rounded again only by the multiply's promotion), times silu(gate) in float32,
    rounded once."""

    def __init__(self, head_dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h.to(dtype) * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """Called as an attention layer is (decoder layers take either): forward(positions, hidden, cache, metadata,
    output_rows) with cache = this layer's (conv_state, ssm_state)."""

    is_linear_attention = True

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, k_head_dim: int, v_head_dim: int,
                 conv_kernel_size: int, eps: float):  # fmt: skip
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        tp = self.tp_size
        self.num_k_heads, self.num_v_heads = num_k_heads // tp, num_v_heads // tp
        self.k_head_dim, self.v_head_dim = k_head_dim, v_head_dim
        self.key_size, self.value_size = self.num_k_heads * k_head_dim, self.num_v_heads * v_head_dim
        self.conv_kernel_size = conv_kernel_size
        key_dim, value_dim = num_k_heads * k_head_dim, num_v_heads * v_head_dim
        self.in_proj = ColumnParallelLinear(hidden_size, [key_dim, key_dim, value_dim, value_dim, num_v_heads,
                                                          num_v_heads])  # fmt: skip
        # [q | k | v] channels of this rank, K taps each (the checkpoint's [C, 1, K] with the middle dim dropped)
        self.conv_dim = 2 * self.key_size + self.value_size
        self.conv1d_weight = nn.Parameter(torch.empty(self.conv_dim, conv_kernel_size))
        self.conv1d_weight.weight_loader = self._load_conv
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        for param in (self.A_log, self.dt_bias):
            param.weight_loader = self._load_per_head
        self.norm = RMSNormGated(v_head_dim, eps)
        self.out_proj = RowParallelLinear(value_dim, hidden_size)
        self.platform = current_platform()

    def state_shapes(self, num_slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv_state, ssm_state) shapes of this rank's state cache for num_slots sequences."""
        return ((num_slots, self.conv_dim, self.conv_kernel_size - 1),
                (num_slots, self.num_v_heads, self.k_head_dim, self.v_head_dim))  # fmt: skip

    def forward(self, positions, hidden_states, cache: tuple[torch.Tensor, torch.Tensor], metadata,
                output_rows=None):  # fmt: skip
        conv_state, ssm_state = cache
        num_tokens = hidden_states.shape[0]
        projected = self.in_proj(hidden_states)
        mixed_qkv, z, b, a = projected.split([self.conv_dim, self.value_size, self.num_v_heads, self.num_v_heads],
                                             dim=-1)  # fmt: skip
        mixed_qkv = self.platform.causal_conv1d(mixed_qkv, self.conv1d_weight, conv_state, metadata)
        q, k, v = mixed_qkv.split([self.key_size, self.key_size, self.value_size], dim=-1)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        core = self.platform.gated_delta_rule(
            q.reshape(num_tokens, self.num_k_heads, self.k_head_dim),
            k.reshape(num_tokens, self.num_k_heads, self.k_head_dim),
            v.reshape(num_tokens, self.num_v_heads, self.v_head_dim), g, beta, ssm_state, metadata,
        )  # fmt: skip
        if output_rows is not None:
            if output_rows.numel() == 0:  # only the state was needed
                return hidden_states.new_empty(0, hidden_states.shape[-1])
            core, z = core[output_rows], z[output_rows]
        core = self.norm(core.reshape(-1, self.v_head_dim), z.reshape(-1, self.v_head_dim))
        return self.out_proj(core.reshape(-1, self.value_size))

    def _load_conv(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """This rank's q, k and v channels of the checkpoint's [C, 1, K] convolution."""
        loaded = loaded.reshape(loaded.shape[0], -1)
        tp, rank = self.tp_size, self.tp_rank
        starts = (0, self.key_size * tp, 2 * self.key_size * tp)  # where the checkpoint's q, k and v channels begin
        offset = 0
        for start, size in zip(starts, (self.key_size, self.key_size, self.value_size)):
            param.data[offset : offset + size].copy_(loaded[start + rank * size : start + (rank + 1) * size])
            offset += size

    def _load_per_head(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded.narrow(0, self.tp_rank * self.num_v_heads, self.num_v_heads))
