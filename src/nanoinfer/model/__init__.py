"""Decoder-only architectures (Qwen3, Qwen2, Llama) built from shared layers, and their weight loader."""
