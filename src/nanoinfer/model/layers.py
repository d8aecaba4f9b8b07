"""Shared building blocks: RMSNorm, rotary embedding, vocab-parallel embedding/head; each asks the platform
(platforms/) for its op when it is built.

Numerics follow Hugging Face's implementations (norm in float32, rotary tables from transformers' own
rope initialisers) so greedy output matches token for token in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.distributed import all_gather_last_dim, all_reduce, get_tp_rank, get_tp_size
from nanoinfer.platforms import current_platform


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.platform = current_platform()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x) or, with a residual, (norm(x + residual), x + residual): the fused pre-norm step. The
        platform's op may overwrite both inputs: the decoder layer owns them and reads neither afterwards."""
        return self.platform.rms_norm(x, self.weight, self.eps, residual)


class RotaryEmbedding(nn.Module):
    """cos/sin tables indexed by position; the inverse frequencies come from transformers' rope initialisers
    so every rope_type it knows (default, llama3, linear, yarn, ...) matches it exactly."""

    def __init__(self, hf_config, head_dim: int, max_position: int):
        super().__init__()
        inv_freq, scaling = _rope_inv_freq(hf_config, head_dim)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_position, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        # Plain attributes, not buffers: model.to(bfloat16) must not round the tables (HF keeps them float32).
        self.cos = emb.cos() * scaling
        self.sin = emb.sin() * scaling
        self.platform = current_platform()

    def to_device(self, device: torch.device) -> None:
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, H, D], k [T, H_kv, D] -> rotated (the platform's op may rotate them in place)."""
        return self.platform.rotary_embedding(positions, q, k, self.cos, self.sin)


def _rope_inv_freq(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # scaled rotary: transformers' formulas

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; each rank embeds its ids and the results are summed."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // self.tp_size)
        self.start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.zeros(self.shard_size, hidden_size))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None):
        rows = loaded[self.start : self.start + self.shard_size]
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        in_shard = (local >= 0) & (local < self.shard_size)
        out = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * in_shard.unsqueeze(-1)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> logits over the full vocabulary, in the model's dtype (each rank computes its
    vocabulary shard). Not widened to float32 here: greedy rows take their argmax from the bfloat16 logits
    as they are (the widening is exact and order-preserving), and the sampler widens the rest itself: a
    widening copy of every row would cost each step a pass over all the logits."""

    is_lm_head = True  # a linear method may keep a form of the weight for greedy_token_ids (prepare_model)

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__(vocab_size, hidden_size)
        self.platform = current_platform()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.platform.linear(self, hidden_states, None)
        if self.tp_size > 1:
            logits = all_gather_last_dim(logits)[..., : self.vocab_size]
        return logits

    @property
    def has_greedy_kernel(self) -> bool:
        """Does greedy_token_ids skip writing the logits here?"""
        return self.platform.has_greedy_lm_head(self)

    def greedy_token_ids(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The argmax of forward(hidden_states) a row (the first index on a tie), without the logits where the
        platform's kernel allows."""
        token_ids = self.platform.greedy_token_ids(self, hidden_states)
        return token_ids if token_ids is not None else torch.argmax(self(hidden_states), dim=-1)
