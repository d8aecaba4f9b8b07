"""Rotary position embedding: cos/sin tables indexed by position, from transformers' own rope initialisers, so
every rope_type it knows (default, llama3, linear, yarn, longrope, ...) matches it exactly.

Partial rotary (Phi-3's partial_rotary_factor) rotates the first rotary_dim features of each head and passes the
rest through; proportional rope (Gemma 4's global layers) instead rotates the first pairs of each half of the head.
Per-layer-type rope (Gemma 3's local base for sliding layers) is chosen with `layer_type`.

longrope switches from the short to the long factors at original_max_position_embeddings (O). nanoinfer picks them
per position (long from position O on), so a token's rotation never depends on what it is batched with (chunked
prefill, preemption, prefix caching). transformers' forward picks one set per pass (long when the pass's highest
position is O or more, modeling_rope_utils.longrope_frequency_update) and keeps the cached keys: the same for every
decoded token and for prompts of at most O tokens; a longer prompt's first O positions get the short factors here,
the long ones there. (transformers' Phi-3 generate() also drops its cache when the sequence first passes O and
re-encodes it all with the long factors; vLLM picks one set for the whole engine: long iff max_model_len > O.)
"""

from __future__ import annotations

import torch
from torch import nn

from nanoinfer.platforms import current_platform


def rope_parameters(hf_config, layer_type: str | None = None) -> dict:
    """The rope parameters of a layer type (transformers 5 nests them by layer type for Gemma 3 and 4)."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    return params


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config, head_dim: int, max_position: int, layer_type: str | None = None):
        super().__init__()
        params = rope_parameters(hf_config, layer_type)
        factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None) or 1.0)
        if params.get("rope_type") == "proportional":
            # Gemma 4's: transformers' frequencies span the whole head, the pairs past the factor's at 0 (turned by
            # angle 0, i.e. passed through exactly), so the whole head is rotated.
            factor = 1.0
        self.rotary_dim = int(head_dim * factor)
        positions = torch.arange(max_position, dtype=torch.float32, device="cpu")  # never the meta device
        inv_freq, scaling = _rope_inv_freq(hf_config, params, self.rotary_dim, layer_type)
        freqs = torch.outer(positions, inv_freq)  # [max_position, rotary_dim / 2]
        if params.get("rope_type") == "longrope":
            original = params["original_max_position_embeddings"]
            long_inv_freq, _ = _rope_inv_freq(hf_config, params, self.rotary_dim, layer_type, seq_len=original + 1)
            freqs[original:] = torch.outer(positions[original:], long_inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # Plain attributes, not buffers: model.to(bfloat16) must not round the tables (HF keeps them float32).
        self.cos = emb.cos() * scaling
        self.sin = emb.sin() * scaling
        self.partial = self.rotary_dim < head_dim
        self.platform = current_platform()

    def to_device(self, device: torch.device) -> None:
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, H, D], k [T, H_kv, D] -> rotated (the platform's op may rotate them in place)."""
        if not self.partial:
            return self.platform.rotary_embedding(positions, q, k, self.cos, self.sin)
        d = self.rotary_dim
        q_rot, k_rot = self.platform.rotary_embedding(
            positions, q[..., :d].contiguous(), k[..., :d].contiguous(), self.cos, self.sin
        )
        return torch.cat((q_rot, q[..., d:]), dim=-1), torch.cat((k_rot, k[..., d:]), dim=-1)


def _rope_inv_freq(hf_config, params: dict, dim: int, layer_type: str | None,
                   seq_len: int | None = None) -> tuple[torch.Tensor, float]:  # fmt: skip
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # scaled rotary: transformers' formulas

    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    with torch.device("cpu"):  # some initialisers (YaRN) make tensors without a device: not on the meta device
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), seq_len=seq_len, **kwargs)
    return inv_freq.float(), float(scaling)
