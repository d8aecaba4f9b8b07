"""One interface for every attention implementation, and the rule that picks one.

A backend stores the step's new keys/values into the paged cache, then attends each sequence's queries
over its cached context (see reference.py for the exact semantics every backend must match).
"""

from __future__ import annotations

import importlib.util
from typing import Protocol

import torch

from nanoinfer.attention.metadata import AttentionMetadata
from nanoinfer.errors import ConfigError, ConfigProblem


class AttentionBackend(Protocol):
    name: str

    def store_kvcache(
        self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    def forward(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
        scale: float, new_kv: tuple[torch.Tensor, torch.Tensor] | None = None, sliding_window: int | None = None,
        soft_cap: float | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention output [num_tokens, H_q, D]. sliding_window W: a query at position p sees keys p - W + 1..p
        (transformers' rule); soft_cap c: scores become c * tanh(scores / c) before the softmax (Gemma 2);
        sinks: float32 [H_q], one extra logit per head in the softmax's sum that contributes no value (gpt-oss).
        `new_kv` holds this step's keys/values (already stored
        in the cache); a backend may read them directly instead of the cache where that is faster."""
        ...


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


# flash-attn 2's kernels take heads of at most this size (Gemma 4's global layers have 512)
FLASH_ATTN_MAX_HEAD_DIM = 256


def select_backend(requested: str, device: str, dtype: str, kv_cache_dtype: str | None = None,
                   max_head_dim: int | None = None, head_dims: tuple[int, ...] = ()) -> tuple[str, str]:  # fmt: skip
    """The one rule: (backend name, why) for `attention_backend: requested` on this device and dtype.

    auto -> flash-attn (CUDA, package installed, fp16/bf16, cache in the model's dtype, every head at most 256
    wide: max_head_dim, the model's widest) > triton (CUDA, package installed, every head size in head_dims a
    power of two from 16: Phi-3-mini's 96 is not) > torch.
    A forced name that cannot run here is a ConfigError naming the fix. Config calls this while resolving,
    so the engine only ever sees a name that runs; the platform builds the backend (Platform.attention_backend)."""

    def problem(rule: str) -> ConfigError:
        return ConfigError([ConfigProblem("attention_backend", requested, rule)])

    half = dtype in ("bfloat16", "float16")
    same_cache = kv_cache_dtype in (None, "auto", dtype)  # flash-attn reads the cache in the query's dtype
    heads_fit = max_head_dim is None or max_head_dim <= FLASH_ATTN_MAX_HEAD_DIM
    odd_heads = sorted({d for d in head_dims if d < 16 or d & (d - 1)})  # what the Triton kernels cannot tile
    if requested == "auto":
        if device == "cuda" and flash_attn_available() and half and same_cache and heads_fit:
            return "flash-attn", "CUDA, flash-attn installed"
        if device == "cuda" and triton_available() and not odd_heads:
            return "triton", "CUDA" + ("" if half else f", {dtype}")
        if device == "cuda" and odd_heads:
            return "torch", f"CUDA, head size {odd_heads[0]} (the Triton kernels take powers of two)"
        return "torch", device
    if requested in ("triton", "flash-attn") and device != "cuda":
        raise problem(f"runs only on CUDA but device is {device}. Use attention_backend: torch (or auto).")
    if requested == "flash-attn" and not flash_attn_available():
        raise problem(
            "needs the flash-attn package, which is not installed. Install it with "
            "`pip install 'nanoinfer[cuda]'`, or use attention_backend: triton (or auto)."
        )
    if requested == "flash-attn" and not half:
        raise problem(
            f"supports only float16 and bfloat16, but dtype is {dtype}. Use dtype: bfloat16, or attention_backend: "
            "triton."
        )
    if requested == "flash-attn" and not same_cache:
        raise problem(
            f"reads the KV cache in the model's dtype ({dtype}), but kv_cache_dtype is {kv_cache_dtype}. Use "
            "kv_cache_dtype: auto, or attention_backend: triton."
        )
    if requested == "flash-attn" and not heads_fit:
        raise problem(
            f"takes heads of at most {FLASH_ATTN_MAX_HEAD_DIM} features, but the model's widest has {max_head_dim}. "
            "Use attention_backend: triton (or auto)."
        )
    if requested == "triton" and not triton_available():
        raise problem("needs the triton package. Install triton, or use torch (or auto).")
    if requested == "triton" and odd_heads:
        raise problem(
            f"tiles heads whose size is a power of two from 16, but this model's heads have {odd_heads[0]} features. "
            "Use attention_backend: flash-attn (bfloat16 / float16) or torch (or auto)."
        )
    return requested, "set"
