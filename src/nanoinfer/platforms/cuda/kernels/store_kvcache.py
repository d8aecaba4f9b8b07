"""Triton kernel that writes a step's new keys/values into the paged KV cache (oracle:
attention/reference.py store_kvcache_reference). One program per token; slot -1 (padding) is skipped.

An fp8 cache (kv_cache_dtype fp8_e4m3 / fp8_e5m2) has scale 1, as vLLM's without calibrated scales: values
are rounded once from float32 to nearest even, saturating at the format's largest finite value (448 / 57344),
bit for bit as attention/torch_backend.py to_cache_dtype does on CPU. The rounding is done in float32 bit
arithmetic, so the cast that follows is exact: compiled or in Triton's interpreter (whose own fp8 cast drops a
carry into the exponent, turning 1.96 into 1.0), every platform stores torch's bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # the fp8 caches (kv_cache_dtype fp8_e4m3, fp8_e5m2)


@triton.jit
def _round_to_fp8(x, MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr, SUBNORMAL_STEP: tl.constexpr):
    """float32 x (within the format's range) rounded to nearest even on an fp8 format's grid, as float32."""
    drop: tl.constexpr = 23 - MANTISSA_BITS
    bits = x.to(tl.int32, bitcast=True)
    # Round the magnitude's low `drop` bits away, half to even; a carry moves into the exponent, as it should.
    rounded = (bits + ((1 << (drop - 1)) - 1) + ((bits >> drop) & 1)) & -(1 << drop)
    normal = rounded.to(tl.float32, bitcast=True)
    # Below the smallest normal the grid is even steps of SUBNORMAL_STEP: adding and taking away 1.5 x 2^23
    # rounds the step count to an integer, half to even (float32 addition rounds so). On the magnitude, with
    # the sign put back after, so that what rounds to zero keeps its sign, as torch's cast does.
    steps = tl.abs(x) * (1.0 / SUBNORMAL_STEP)
    subnormal = ((steps + 12582912.0) - 12582912.0) * SUBNORMAL_STEP
    subnormal = tl.where(bits < 0, -subnormal, subnormal)
    return tl.where(tl.abs(x) < MIN_NORMAL, subnormal, normal)


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
    FP8_MAX: tl.constexpr,  # an fp8 cache's largest finite value, else 0.0
    FP8_MANTISSA_BITS: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr, FP8_SUBNORMAL_STEP: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < NUM_ELEMS
    key = tl.load(key_ptr + token * stride_key_token + offs, mask=mask)
    value = tl.load(value_ptr + token * stride_value_token + offs, mask=mask)
    if FP8_MAX > 0:
        # From float32 (bfloat16 and float16 widen exactly), so the fp8 value is rounded once; saturated first.
        key = tl.minimum(tl.maximum(key.to(tl.float32), -FP8_MAX), FP8_MAX)
        value = tl.minimum(tl.maximum(value.to(tl.float32), -FP8_MAX), FP8_MAX)
        key = _round_to_fp8(key, FP8_MANTISSA_BITS, FP8_MIN_NORMAL, FP8_SUBNORMAL_STEP)
        value = _round_to_fp8(value, FP8_MANTISSA_BITS, FP8_MIN_NORMAL, FP8_SUBNORMAL_STEP)
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
        v_cache.dtype == k_cache.dtype and k_cache.dtype in floats + FP8_DTYPES,
        f"k_cache/v_cache dtypes {k_cache.dtype}/{v_cache.dtype} must be one float or fp8 dtype (keys are "
        "converted to it)",
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
        **_fp8_format(k_cache.dtype),
    )


def _fp8_format(dtype: torch.dtype) -> dict:
    """The store kernel's fp8 constants for a cache of `dtype` (FP8_MAX 0.0: not fp8, nothing to round)."""
    if dtype not in FP8_DTYPES:
        return {"FP8_MAX": 0.0, "FP8_MANTISSA_BITS": 0, "FP8_MIN_NORMAL": 0.0, "FP8_SUBNORMAL_STEP": 0.0}
    info = torch.finfo(dtype)
    mantissa_bits = 3 if dtype == torch.float8_e4m3fn else 2
    return {"FP8_MAX": float(info.max), "FP8_MANTISSA_BITS": mantissa_bits,
            "FP8_MIN_NORMAL": float(info.smallest_normal),
            "FP8_SUBNORMAL_STEP": float(info.smallest_normal) * 2.0**-mantissa_bits}  # fmt: skip


def _require(condition: bool, message: str) -> None:
    # A failed check is a bug in the caller (model runner), not a user error: plain exception, never caught.
    if not condition:
        raise ValueError(f"store_kvcache: {message}")
