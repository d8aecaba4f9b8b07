"""Read a model folder's config.json without importing transformers.

Importing transformers' config and tokenizer machinery costs about 4 s, nearly half of the default
model's startup. For the families nanoinfer runs, with plain rotary embeddings, the fields the engine
reads come straight from config.json, with transformers' defaults for the ones it leaves out. Anything
else (another family, scaled rotary such as llama3 or yarn, trust_remote_code) goes through
transformers' AutoConfig as before. tests/unit/test_hf_config.py checks every field against AutoConfig,
so a default that changes in transformers fails CI, not a model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# transformers' defaults (its config classes' constructors) for the fields a config.json may leave out.
_DEFAULTS = {
    "llama": dict(vocab_size=32000, max_position_embeddings=2048, num_key_value_heads=None, head_dim=None),
    "qwen2": dict(vocab_size=151936, max_position_embeddings=32768, num_key_value_heads=32, head_dim=None),
    "qwen3": dict(vocab_size=151936, max_position_embeddings=32768, num_key_value_heads=32, head_dim=128),
}
# No family default is worth trusting for the sizes: a config.json without them goes to AutoConfig.
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True)
class HFConfig:
    """The fields of a transformers PretrainedConfig that nanoinfer reads, under the same names."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    hidden_act: str
    rope_parameters: dict = field(default_factory=dict)
    architectures: tuple[str, ...] = ()


def load_hf_config(model_dir: str | Path, trust_remote_code: bool = False) -> Any:
    """The model's config: an HFConfig when config.json can be read directly, else AutoConfig's.

    Raises what AutoConfig raises for an unreadable folder (OSError, ValueError, KeyError, TypeError).
    """
    fast = None if trust_remote_code else read_config_json(model_dir)
    if fast is not None:
        return fast
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)


def read_config_json(model_dir: str | Path) -> HFConfig | None:
    """HFConfig from config.json, or None when only transformers can read this config faithfully."""
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # AutoConfig raises its own, clearer error
    if not isinstance(raw, dict):
        return None
    model_type = raw.get("model_type")
    if model_type not in _DEFAULTS or any(not _is_int(raw.get(key)) for key in _REQUIRED):
        return None
    if raw.get("use_sliding_window") or any(kind != "full_attention" for kind in raw.get("layer_types") or []):
        return None  # per-layer windows: transformers derives layer_types (Qwen2 / Qwen3 with use_sliding_window)
    rope_theta = _plain_rope_theta(raw)
    if rope_theta is None:
        return None
    defaults = _DEFAULTS[model_type]
    heads = raw["num_attention_heads"]
    values = {key: raw.get(key, default) for key, default in defaults.items()}
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = heads
    if values["head_dim"] is None:
        values["head_dim"] = raw["hidden_size"] // heads
    if not all(_is_int(values[key]) for key in defaults):
        return None
    try:
        return HFConfig(
            model_type=model_type,
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            hidden_act=str(raw.get("hidden_act", "silu")),
            rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
            architectures=tuple(raw.get("architectures") or ()),
            **values,
        )
    except (TypeError, ValueError):
        return None


def _plain_rope_theta(raw: dict) -> float | None:
    """rope_theta when the rotary embedding is the default one, else None (scaled: AutoConfig's job)."""
    spellings = [raw.get(key) or {} for key in ("rope_parameters", "rope_scaling")]  # new and legacy names
    if not all(isinstance(p, dict) and p.get("rope_type", p.get("type", "default")) == "default" for p in spellings):
        return None
    theta = spellings[0].get("rope_theta", spellings[1].get("rope_theta", raw.get("rope_theta", 10000.0)))
    return float(theta) if isinstance(theta, (int, float)) and not isinstance(theta, bool) else None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
