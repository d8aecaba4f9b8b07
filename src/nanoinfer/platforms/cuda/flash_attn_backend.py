"""FlashAttnBackend: flash-attn 2.x kernels over the paged cache, when the package is installed.

Pure-decode steps call flash_attn_with_kvcache (paged via block_table); other steps call
flash_attn_varlen_func, over the paged cache (block_table) when any sequence has a cached prefix, else over
this step's keys directly. flash-attn is imported on first use; the KV-cache store is our Triton kernel.
flash-attn 2.x needs float16/bfloat16 and a block size that is a multiple of 256 (Config checks both).
It has no attention sinks: a layer with them (gpt-oss) runs on our Triton kernels, over the same cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoinfer.attention.metadata import AttentionMetadata


class FlashAttnBackend:
    name = "flash-attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache
        self._sinks_backend = None  # a TritonBackend, built for the first layer with sinks

    def store_kvcache(
        self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        from nanoinfer.platforms.cuda.kernels.store_kvcache import store_kvcache

        store_kvcache(key, value, k_cache, v_cache, slot_mapping)

    def forward(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
        scale: float, new_kv: tuple[torch.Tensor, torch.Tensor] | None = None, sliding_window: int | None = None,
        soft_cap: float | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if sinks is not None:
            return self._without_flash_attn().forward(query, k_cache, v_cache, metadata, scale, new_kv,
                                                      sliding_window, soft_cap, sinks)  # fmt: skip
        if k_cache.shape[1] % 256 or query.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"flash-attn needs float16/bfloat16 and a block size that is a multiple of 256, got "
                f"{query.dtype} and {k_cache.shape[1]}; Config should have rejected this"
            )
        # flash-attn's window counts the keys left of the query besides itself; its softcap 0 means none.
        window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        mask = dict(window_size=window, softcap=soft_cap or 0.0)
        if metadata.max_query_len == 1:
            out = self._with_kvcache(
                query.unsqueeze(1), k_cache, v_cache,  # [num_seqs, 1, H_q, D]
                cache_seqlens=metadata.seq_lens, block_table=metadata.block_tables,
                softmax_scale=scale, causal=True, **mask,
            )
            return out.squeeze(1)
        if new_kv is not None and _has_no_cached_prefix(metadata):
            # Every sequence starts here: attend over this step's keys, no block-table indirection.
            return self._varlen(
                query, new_kv[0], new_kv[1],
                cu_seqlens_q=metadata.query_start_loc, cu_seqlens_k=metadata.query_start_loc,
                max_seqlen_q=metadata.max_query_len, max_seqlen_k=metadata.max_query_len,
                softmax_scale=scale, causal=True, **mask,
            )
        # flash-attn aligns the causal mask bottom-right: query j of q_len sees keys 0..seq_len - q_len + j.
        cu_seqlens_k = F.pad(torch.cumsum(metadata.seq_lens, dim=0, dtype=torch.int32), (1, 0))
        return self._varlen(
            query, k_cache, v_cache,
            cu_seqlens_q=metadata.query_start_loc, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=metadata.max_query_len, max_seqlen_k=metadata.max_seq_len,
            softmax_scale=scale, causal=True, block_table=metadata.block_tables, **mask,
        )


    def _without_flash_attn(self):
        if self._sinks_backend is None:
            from nanoinfer.platforms.cuda.triton_backend import TritonBackend

            self._sinks_backend = TritonBackend()
        return self._sinks_backend


def _has_no_cached_prefix(metadata: AttentionMetadata) -> bool:
    # Host-side lists only: reading the device tensors here would sync every step.
    if metadata.query_lens_cpu is None or metadata.seq_lens_cpu is None:
        return False
    return metadata.query_lens_cpu == metadata.seq_lens_cpu
