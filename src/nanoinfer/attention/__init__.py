"""Attention on the paged KV cache: metadata, backends (torch reference, CPU fast path, Triton, flash-attn)."""
