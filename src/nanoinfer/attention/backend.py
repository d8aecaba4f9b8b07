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
        scale: float, new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Attention output [num_tokens, H_q, D]. `new_kv` holds this step's keys/values (already stored
        in the cache); a backend may read them directly instead of the cache where that is faster."""
        ...


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend_name(requested: str, device: str) -> str:
    """auto -> flash-attn (CUDA, package present) > triton (CUDA) > torch. Forced names are checked."""
    if requested == "auto":
        if device == "cuda":
            if flash_attn_available():
                return "flash-attn"
            if triton_available():
                return "triton"
        return "torch"
    if requested in ("triton", "flash-attn") and device != "cuda":
        raise ConfigError([ConfigProblem(
            "attention_backend", requested, f"needs a CUDA device, but device is {device}. Use 'auto' or 'torch'.")])
    if requested == "flash-attn" and not flash_attn_available():
        raise ConfigError([ConfigProblem(
            "attention_backend", requested,
            "the flash_attn package is not installed. `pip install nanoinfer[cuda]` or use 'auto'/'triton'.")])
    return requested


def get_backend(requested: str, device: str) -> AttentionBackend:
    name = resolve_backend_name(requested, device)
    if name == "flash-attn":
        from nanoinfer.attention.flash_attn_backend import FlashAttnBackend

        return FlashAttnBackend()
    if name == "triton":
        from nanoinfer.attention.triton_backend import TritonBackend

        return TritonBackend()
    from nanoinfer.attention.torch_backend import TorchBackend

    return TorchBackend()
