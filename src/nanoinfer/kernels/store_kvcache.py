"""Triton kernel that writes a step's new keys/values into the paged KV cache (oracle:
attention/reference.py store_kvcache_reference). One program per token; slot -1 (padding) is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_value_token,
    NUM_ELEMS: tl.constexpr,  # num_kv_heads * head_dim: one cache slot
    BLOCK: tl.constexpr,  # NUM_ELEMS rounded up to a power of two
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < NUM_ELEMS
    key = tl.load(key_ptr + token * stride_key_token + offs, mask=mask)
    value = tl.load(value_ptr + token * stride_value_token + offs, mask=mask)
    # Into the cache's dtype (kv_cache_dtype may be narrower than the model's): rounded once, here.
    tl.store(k_cache_ptr + slot * NUM_ELEMS + offs, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * NUM_ELEMS + offs, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write key/value [num_tokens, H_kv, D] into k_cache/v_cache [num_blocks, block_size, H_kv, D] in place.

    key/value may be strided views along the token dimension (e.g. slices of a fused QKV output), but each
    token's [H_kv, D] must be contiguous; the caches must be contiguous.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    _require(value.shape == key.shape, f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    _require(
        k_cache.dim() == 4 and k_cache.shape[2:] == (num_kv_heads, head_dim),
        f"k_cache shape {tuple(k_cache.shape)} does not end in (H_kv={num_kv_heads}, D={head_dim})",
    )
    _require(v_cache.shape == k_cache.shape, f"v_cache {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    _require(k_cache.is_contiguous() and v_cache.is_contiguous(), "k_cache and v_cache must be contiguous")
    for name, t in (("key", key), ("value", value)):
        _require(
            t.stride(2) == 1 and t.stride(1) == head_dim,
            f"{name} strides {t.stride()}: each token's [H_kv, D] must be contiguous",
        )
    floats = (torch.float32, torch.float16, torch.bfloat16)
    _require(
        key.dtype == value.dtype and key.dtype in floats,
        f"key/value dtypes {key.dtype}/{value.dtype} must be one float dtype",
    )
    _require(
        v_cache.dtype == k_cache.dtype and k_cache.dtype in floats,
        f"k_cache/v_cache dtypes {k_cache.dtype}/{v_cache.dtype} must be one float dtype (keys are converted to it)",
    )
    _require(
        slot_mapping.shape == (num_tokens,) and slot_mapping.dtype in (torch.int32, torch.int64),
        f"slot_mapping must be int32/int64 [{num_tokens}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}",
    )
    devices = {t.device for t in (key, value, k_cache, v_cache, slot_mapping)}
    _require(len(devices) == 1, f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if num_tokens == 0:
        return
    num_elems = num_kv_heads * head_dim
    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, key.stride(0), value.stride(0),
        NUM_ELEMS=num_elems, BLOCK=triton.next_power_of_2(num_elems),
    )


def _require(condition: bool, message: str) -> None:
    # A failed check is a bug in the caller (model runner), not a user error: plain exception, never caught.
    if not condition:
        raise ValueError(f"store_kvcache: {message}")
