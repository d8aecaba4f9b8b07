"""Vocabulary-parallel embedding and LM head: each rank holds a shard of the vocabulary's rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.distributed import all_gather_last_dim, all_reduce, get_tp_rank, get_tp_size
from nanoinfer.platforms import current_platform


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; each rank embeds its ids and the results are summed."""

    is_embedding = True  # a step looks up its rows, never reads the whole table (roofline.weights_read_bytes)

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
    widening copy of every row would cost each step a pass over all the logits.

    final_logit_softcapping (Gemma 2-4): logits = cap * tanh(logits / cap), as transformers applies it."""

    is_embedding = False
    uses_linear_method = True  # the platform's linear method multiplies (and may pack) this layer's weight
    is_lm_head = True  # a linear method may keep a form of the weight for greedy_token_ids (prepare_model)

    def __init__(self, vocab_size: int, hidden_size: int, soft_cap: float | None = None):
        super().__init__(vocab_size, hidden_size)
        self.platform = current_platform()
        self.soft_cap = soft_cap

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.platform.linear(self, hidden_states, None)
        if self.tp_size > 1:
            logits = all_gather_last_dim(logits)[..., : self.vocab_size]
        if self.soft_cap is not None:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        return logits

    @property
    def has_greedy_kernel(self) -> bool:
        """Does greedy_token_ids skip writing the logits here? Never with a soft cap: tanh can round two
        different logits to one value, and the argmax's tie rule must see the capped ones."""
        return self.soft_cap is None and self.platform.has_greedy_lm_head(self)

    def greedy_token_ids(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The argmax of forward(hidden_states) a row (the first index on a tie), without the logits where the
        platform's kernel allows."""
        token_ids = self.platform.greedy_token_ids(self, hidden_states) if self.soft_cap is None else None
        return token_ids if token_ids is not None else torch.argmax(self(hidden_states), dim=-1)
