"""AttentionMetadata: what every attention backend needs to read and write the paged KV cache.

Built once per step by the model runner and passed down as an argument (never a global). Sequences are
laid out back to back in the token dimension; sequence i owns tokens query_start_loc[i]:query_start_loc[i+1].
There is no prefill/decode mode: a sequence's new tokens are the last query_len of its seq_len tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nanoinfer.lora_request import LoRARequest


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot (block_id * block_size + offset), -1 = skip
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32: tokens in context after this step (cached + new)
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32, padded with 0 past a sequence's blocks
    max_query_len: int
    max_seq_len: int
    # CPU copies of the lengths, so the host-side paths need no device sync. Metadata that carries them is
    # built for one step and never changed afterwards (the torch backend reuses its per-step plan by
    # identity); a CUDA graph's metadata, updated in place between replays, leaves them None.
    query_lens_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    # Models with linear-attention layers (attention/gated_delta.py): each sequence's slot in the state cache
    # ([num_seqs] int32; -1 reads and writes nothing). None for the others.
    state_slots: torch.Tensor | None = None
    # Rows of partly filled blocks shared through the prefix cache, copied into the cache before the step runs:
    # (source block, destination block, rows) on the host (BlockManager.pending_copies). None when there are none.
    kv_block_copies: list[tuple[int, int, int]] | None = None
    # With LoRA enabled: each row's adapter (a LoRARequest, None for the base model), which the runner gives the
    # layers' slots before the forward pass (lora/manager.py). None when no row has one.
    lora_rows: list[LoRARequest | None] | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1
