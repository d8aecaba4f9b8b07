"""Phi-3, Phi-3.5, Phi-4 and Phi-4-mini (Phi3ForCausalLM): Llama's layers with longrope or partial rotary
(Phi-4-mini rotates the first 3/4 of each head; both live in rotary.py), an optional sliding window on every layer,
and q/k/v and gate/up stored fused in the checkpoint, split here on load. transformers' modeling_phi3.py is the spec.
"""

from __future__ import annotations

import functools

from nanoinfer.errors import ModelLoadError
from nanoinfer.models.llama import LlamaForCausalLM, head_dim_of
from nanoinfer.models.weights.gguf import float32_value


class Phi3ForCausalLM(LlamaForCausalLM):
    gguf_unpermute_qk = False  # Phi-3 rotates halves (NeoX style): llama.cpp keeps HF's row order
    # llama.cpp keeps the checkpoint's fused tensors (its ffn_up holds gate and up); sanitize splits them as usual
    gguf_tensor_names = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}

    def __init__(self, hf_config, backend, max_position: int):
        super().__init__(hf_config, backend, max_position)
        head_dim = head_dim_of(hf_config)
        q_size = hf_config.num_attention_heads * head_dim
        kv_size = hf_config.num_key_value_heads * head_dim
        inter = hf_config.intermediate_size
        # checkpoint's fused tensor -> the unfused checkpoint names (and rows) CausalLM.packed_modules shards
        self.checkpoint_fused = {
            "qkv_proj": (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)),
            "gate_up_proj": (("gate_proj", inter), ("up_proj", inter)),
        }

    def attention_options(self, hf_config, layer_idx: int) -> dict:
        # transformers masks with config.sliding_window on every layer when it is set. A window at least
        # max_position_embeddings long (Phi-3.5, Phi-4-mini: 262144) never hides a key: no window, so the layer
        # stays a global one for the KV cache plan and the fused decode path.
        window = getattr(hf_config, "sliding_window", None)
        if window is not None and window >= hf_config.max_position_embeddings:
            window = None
        return dict(super().attention_options(hf_config, layer_idx), sliding_window=window)

    @classmethod
    def gguf_config(cls, gguf) -> dict:
        """Phi-3's keys: the rotated width (Phi-4-mini rotates 3/4 of each head), the window (0 on Phi-4: none),
        the original context, and longrope's factors, which llama.cpp keeps as two tensors. The attention factor
        it also writes is the one HF computes from the two contexts."""
        head_dim = gguf.meta("embedding_length") // gguf.meta("attention.head_count")
        config = {
            **super().gguf_config(gguf),
            "partial_rotary_factor": gguf.meta("rope.dimension_count", head_dim) / head_dim,
            "sliding_window": gguf.meta("attention.sliding_window") or None,
            "original_max_position_embeddings": gguf.meta("rope.scaling.original_context_length",
                                                          gguf.meta("context_length")),
        }  # fmt: skip
        long, short = gguf.values("rope_factors_long.weight"), gguf.values("rope_factors_short.weight")
        if long is not None:
            config["rope_scaling"] = {"rope_type": "longrope", "long_factor": [float32_value(f) for f in long],
                                      "short_factor": [float32_value(f) for f in short]}  # fmt: skip
        return config

    def sanitize(self, name: str, tensor_fn):
        """Split the checkpoint's fused qkv_proj / gate_up_proj rows into the q/k/v and gate/up tensors the
        packed loaders take, so that each rank copies its own heads (a fused tensor's rows are not in rank order)."""
        for fused, parts in self.checkpoint_fused.items():
            if f".{fused}." in name:
                return _split_rows(name, fused, parts, tensor_fn)
        return [(name, tensor_fn)]


def _split_rows(name: str, fused: str, parts, tensor_fn) -> list:
    read = functools.cache(tensor_fn)  # read the fused tensor once, and only if a part is loaded
    total = sum(size for _, size in parts)

    def rows(start: int, size: int):
        def part():
            tensor = read()
            if tensor.shape[0] != total:
                raise ModelLoadError(
                    f"weight {name} has {tensor.shape[0]} rows; the config.json's head and MLP sizes give {total}. "
                    "Check that config.json belongs to these weights."
                )
            return tensor.narrow(0, start, size)

        return part

    out, start = [], 0
    for part_name, size in parts:
        out.append((name.replace(f".{fused}.", f".{part_name}."), rows(start, size)))
        start += size
    return out
