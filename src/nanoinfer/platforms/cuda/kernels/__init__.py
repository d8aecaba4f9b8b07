"""Triton kernels for the paged KV cache. Importing this package imports triton; backends import it lazily.

Each kernel's exact semantics live in attention/reference.py, which the tests compare against.
"""

from nanoinfer.platforms.cuda.kernels.paged_attention import paged_decode_attention, paged_prefill_attention
from nanoinfer.platforms.cuda.kernels.store_kvcache import store_kvcache

__all__ = ["paged_decode_attention", "paged_prefill_attention", "store_kvcache"]
