"""TritonBackend: our own Triton kernels (nanoinfer.platforms.cuda.kernels), the CUDA backend when flash-attn is absent.

Pure-decode steps (every sequence has one query token) take the split-K decode kernel; any other step,
including mixed decode + chunked-prefill batches, takes the paged prefill kernel.
"""

from __future__ import annotations

import torch

from nanoinfer.attention.metadata import AttentionMetadata
from nanoinfer.platforms.cuda.kernels import paged_decode_attention, paged_prefill_attention, store_kvcache


class TritonBackend:
    name = "triton"

    def store_kvcache(
        self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        store_kvcache(key, value, k_cache, v_cache, slot_mapping)

    def forward(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
        scale: float, new_kv: tuple[torch.Tensor, torch.Tensor] | None = None, sliding_window: int | None = None,
        soft_cap: float | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # new_kv (this step's keys/values) is unused: store_kvcache already put them in the cache.
        mask = dict(sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
        if metadata.max_query_len == 1:
            return paged_decode_attention(
                query, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, metadata.max_seq_len, scale, **mask
            )
        return paged_prefill_attention(
            query, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
            metadata.max_query_len, scale, **mask,
        )
