"""Llama (Llama 2 and 3, SmolLM2): the pre-norm decoder the other dense families vary.

A family built on it overrides the hooks below: which options each layer's attention takes, the MLP's
activation, the norm. transformers' modeling_llama.py is the spec.
"""

from __future__ import annotations

import math

import numpy as np
from torch import nn

from nanoinfer.errors import ModelLoadError
from nanoinfer.models.layers.attention import Attention
from nanoinfer.models.layers.decoder import CausalLM, DecoderModel, PreNormDecoderLayer
from nanoinfer.models.layers.mlp import GatedMLP
from nanoinfer.models.layers.norm import RMSNorm
from nanoinfer.models.layers.rotary import RotaryEmbedding


def head_dim_of(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


class LlamaForCausalLM(CausalLM):
    fused_decode_shape = "llama"  # csrc/decode_layers.cpp runs these layers (where their options allow)
    gguf_unpermute_qk = True  # llama.cpp's converter interleaves Llama's q/k rows for its rotary
    norm_class = RMSNorm

    def build_model(self, hf_config, backend, max_position: int) -> DecoderModel:
        rotary = RotaryEmbedding(hf_config, head_dim_of(hf_config), max_position)  # one table, every layer
        layers = [self.build_layer(hf_config, i, backend, rotary) for i in range(hf_config.num_hidden_layers)]
        return DecoderModel(hf_config.vocab_size, hf_config.hidden_size, layers, self.norm(hf_config))

    def build_layer(self, hf_config, layer_idx: int, backend, rotary) -> nn.Module:
        return PreNormDecoderLayer(
            self.build_attention(hf_config, layer_idx, backend, rotary), self.build_mlp(hf_config, layer_idx),
            self.norm(hf_config), self.norm(hf_config),
        )  # fmt: skip

    def build_attention(self, hf_config, layer_idx: int, backend, rotary) -> Attention:
        return Attention(
            hf_config.hidden_size, hf_config.num_attention_heads, hf_config.num_key_value_heads,
            head_dim_of(hf_config), backend, rotary, **self.attention_options(hf_config, layer_idx),
        )  # fmt: skip

    def attention_options(self, hf_config, layer_idx: int) -> dict:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return dict(qkv_bias=bias, o_bias=bias)

    def build_mlp(self, hf_config, layer_idx: int) -> nn.Module:
        return GatedMLP(hf_config.hidden_size, hf_config.intermediate_size, getattr(hf_config, "hidden_act", "silu"))

    def norm(self, hf_config, size: int | None = None) -> nn.Module:
        eps = getattr(hf_config, "rms_norm_eps", 1e-6)
        return self.norm_class(size or hf_config.hidden_size, eps)

    @classmethod
    def gguf_config(cls, gguf) -> dict:
        """config.json fields of this family's GGUF (a models/weights/gguf.GGUFModel) beyond those every
        architecture writes alike: Llama 3.x's rope scaling, which llama.cpp keeps as the `rope_freqs` tensor."""
        factors = gguf.values("rope_freqs.weight")
        if factors is None:
            return {}
        theta = gguf.meta_float("rope.freq_base", 10000.0)
        original = gguf.meta("rope.scaling.original_context_length", 8192)
        scaling = llama3_rope_scaling(factors, theta, original)
        if scaling is None:
            raise ModelLoadError(f"{gguf.path}: its rope_freqs tensor is not Llama 3's rope scaling (llama3), the one "
                                 "nanoinfer reads from a GGUF; use the model's Hugging Face folder instead.")
        return {"rope_scaling": scaling}


# Llama 3.1-3.3's published low / high frequency factors (their original context, 8192, is also what llama.cpp's
# converter uses: it reads the key from the top of config.json, where Llama 3's do not have it)
_LLAMA3_DEFAULTS = (1.0, 4.0)


def llama3_rope_scaling(factors: np.ndarray, theta: float, original: int) -> dict | None:
    """The llama3 rope parameters behind llama.cpp's `rope_freqs` (each rotary pair's frequency divisor: 1 for
    short wavelengths, `factor` for long ones, a smooth blend between), or None if no llama3 parameters give it.

    Only the ratios of the low / high frequency factors to the original context show in the divisors, so the
    original context is taken as given and the two factors found: Llama 3's (1, 4) if they fit, else solved from the
    blended pairs. HF's rope then computes its frequencies from the same parameters as from the model's folder."""
    factors = np.asarray(factors, dtype=np.float32)
    factor = float(factors.max())
    if factor <= 1.0:
        return None
    wavelen = _wavelengths(theta, 2 * len(factors))
    for low, high in (_LLAMA3_DEFAULTS, _solve_llama3(factors, wavelen, factor, original)):
        if low is not None and np.allclose(_llama3_factors(wavelen, factor, low, high, original), factors, rtol=1e-5):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": original}  # fmt: skip
    return None


def _wavelengths(theta: float, dim: int) -> np.ndarray:
    inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    return 2 * math.pi / inv_freq.astype(np.float64)


def _llama3_factors(wavelen: np.ndarray, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """llama.cpp's converter's rope_freqs for these parameters (LlamaModel.generate_extra_tensors)."""
    smooth = (original / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, blended))


def _solve_llama3(factors: np.ndarray, wavelen: np.ndarray, factor: float, original: int):
    """(low, high) from the blended pairs: each gives original / wavelength = low (1 - s) + high s, with s its
    blend weight; one pair alone takes low = 1. (None, None) without any."""
    blended = (factors > 1.0 + 1e-6) & (factors < factor * (1 - 1e-6))
    if not blended.any():
        return None, None
    s = (1 / factors[blended] - 1 / factor) / (1 - 1 / factor)
    target = original / wavelen[blended]
    if blended.sum() == 1:
        low = 1.0
        high = float((target[0] - low * (1 - s[0])) / s[0])
    else:
        (low, high), *_ = np.linalg.lstsq(np.stack([1 - s, s], axis=1), target, rcond=None)
    return float(f"{low:.6g}"), float(f"{high:.6g}")
