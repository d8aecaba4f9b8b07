"""The CPU attention backend: torch_backend's step plan, run on the C++ kernels where they take the step.

Decode sequences go to csrc/paged_attention.cpp (reading the cache in place, each row's last `window` keys under
a sliding window), every prompt chunk of a step to csrc/prefill_attention.cpp in one call, the KV store to the C++
store; both kernels take sliding windows, soft caps and attention sinks. Anything the kernels do not take (a dtype, a
head size) falls to the plain-torch backend it extends.
"""

from __future__ import annotations

import torch

from nanoinfer.attention.torch_backend import TorchBackend

KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # the queries and keys the C++ kernels take
KERNEL_CACHE_DTYPES = KERNEL_DTYPES + (torch.float8_e4m3fn, torch.float8_e5m2)  # the caches they read/write


class CpuAttentionBackend(TorchBackend):
    name = "torch"

    def __init__(self, ops):
        super().__init__()
        self.ops = ops

    def store_kvcache(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        if (key.dtype in KERNEL_DTYPES and k_cache.dtype in KERNEL_CACHE_DTYPES and rows_contiguous(key)
                and rows_contiguous(value)):  # fmt: skip
            self.ops.store_kvcache(key, value, k_cache, v_cache, slot_mapping)  # converts to the cache's dtype
            return
        super().store_kvcache(key, value, k_cache, v_cache, slot_mapping)

    def _prefill_all(self, query, k_cache, v_cache, metadata, plan, mask, out) -> bool:
        if not (query.dtype in KERNEL_DTYPES and k_cache.dtype in KERNEL_CACHE_DTYPES and query.shape[-1] % 16 == 0
                and k_cache.shape[1] % 64 == 0 and rows_contiguous(query)):  # fmt: skip
            return False
        # Reads the keys this step just stored.
        self.ops.paged_prefill(query, k_cache, v_cache, *plan.prefill_args(metadata), mask.scale, out,
                               mask.sliding_window or 0, mask.soft_cap or 0.0, mask.sinks)  # fmt: skip
        return True

    def _decode_attention(self, q, k_cache, v_cache, plan, mask) -> torch.Tensor:
        if q.dtype not in KERNEL_DTYPES or k_cache.dtype not in KERNEL_CACHE_DTYPES:
            return super()._decode_attention(q, k_cache, v_cache, plan, mask)
        if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
            q = q.contiguous()  # the kernel reads each token's heads as one row (any stride between tokens)
        return self.ops.paged_decode(q, k_cache, v_cache, plan.decode_tables, plan.decode_lens, mask.scale,
                                     mask.sliding_window or 0, mask.soft_cap or 0.0, mask.sinks)  # fmt: skip


def rows_contiguous(x: torch.Tensor) -> bool:
    """[T, H, D] whose rows (H x D) are contiguous, at any row stride (views of the fused qkv output)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
