"""config.json read without transformers (nanoinfer.models.config) must agree with AutoConfig on every
field the engine reads, for each supported family, with fields given and with transformers' defaults."""

import json
from pathlib import Path

import pytest
import torch

from nanoinfer.config import Config
from nanoinfer.models.config import HFConfig, load_hf_config, read_config_json
from nanoinfer.models.layers.rotary import _rope_inv_freq, rope_parameters
from nanoinfer.models.llama import head_dim_of

REPO = Path(__file__).resolve().parents[2]
FIELDS = [
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "hidden_act",
]  # fmt: skip
MINIMAL = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4}
FULL = {
    **MINIMAL, "vocab_size": 1000, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "attention_bias": True, "rope_theta": 500000.0,
}  # fmt: skip


def auto_config(folder):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder))


def assert_same_as_transformers(folder):
    ours, theirs = read_config_json(folder), auto_config(folder)
    assert isinstance(ours, HFConfig)
    for name in FIELDS:
        assert getattr(ours, name) == getattr(theirs, name), name
    assert head_dim_of(ours) == head_dim_of(theirs)
    assert ours.attention_bias == bool(getattr(theirs, "attention_bias", False))
    ours_freq, ours_scale = _rope_inv_freq(ours, rope_parameters(ours), head_dim_of(ours), None)
    theirs_freq, theirs_scale = _rope_inv_freq(theirs, rope_parameters(theirs), head_dim_of(theirs), None)
    torch.testing.assert_close(ours_freq, theirs_freq, rtol=0, atol=0)
    assert ours_scale == theirs_scale


def write_config(folder: Path, values: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(values))
    return folder


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("fields", [MINIMAL, FULL], ids=["defaults", "given"])
def test_fields_match_autoconfig(tmp_path, family, fields):
    assert_same_as_transformers(write_config(tmp_path / family, {"model_type": family, **fields}))


def test_families_with_options_beyond_the_fast_fields_go_to_autoconfig(tmp_path):
    """Mistral's sliding_window (transformers' default 4096) is not among the fast fields: AutoConfig reads it."""
    folder = write_config(tmp_path / "mistral", {"model_type": "mistral", **MINIMAL})
    assert read_config_json(folder) is None
    assert load_hf_config(folder).sliding_window == auto_config(folder).sliding_window == 4096


@pytest.mark.parametrize("rope", [{"rope_scaling": None, "rope_theta": 1e6},
                                  {"rope_parameters": {"rope_type": "default", "rope_theta": 1234.0}},
                                  {"rope_scaling": {"type": "default"}}])  # fmt: skip
def test_plain_rope_spellings_match_autoconfig(tmp_path, rope):
    assert_same_as_transformers(write_config(tmp_path, {"model_type": "llama", **MINIMAL, **rope}))


def test_shipped_and_tiny_model_configs_match_autoconfig(tmp_path, default_model_dir):
    from nanoinfer.testing.tiny_models import build_tiny_model

    assert_same_as_transformers(default_model_dir)
    assert_same_as_transformers(REPO / "configs" / "models" / "qwen3-0.6b")
    for family in ("qwen3", "qwen2", "llama"):
        assert_same_as_transformers(build_tiny_model(family, tmp_path / family))


@pytest.mark.parametrize("values", [
    {"model_type": "llama", **MINIMAL, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
     "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    {"model_type": "qwen2", **MINIMAL, "rope_scaling": {"type": "yarn", "factor": 4.0}},
    {"model_type": "llama", **MINIMAL, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
     "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    {"model_type": "gpt2", "n_embd": 64},
    {"model_type": "llama", "hidden_size": 128},
    {"model_type": "llama", **MINIMAL, "num_hidden_layers": "2"},
])  # fmt: skip
def test_configs_only_transformers_reads_faithfully_go_to_autoconfig(tmp_path, values):
    folder = write_config(tmp_path, values)
    assert read_config_json(folder) is None
    if values["model_type"] != "gpt2" and "rope_scaling" in values:
        loaded = load_hf_config(folder)
        assert not isinstance(loaded, HFConfig)
        assert loaded.rope_parameters["rope_type"] != "default"


def test_unreadable_config_json_gives_the_config_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    assert read_config_json(tmp_path) is None
    with pytest.raises((OSError, ValueError)):
        load_hf_config(tmp_path)


def test_trust_remote_code_always_uses_autoconfig(tmp_path):
    folder = write_config(tmp_path, {"model_type": "llama", **MINIMAL})
    assert not isinstance(load_hf_config(folder, trust_remote_code=True), HFConfig)
    assert isinstance(load_hf_config(folder), HFConfig)


def test_config_loads_the_default_model_without_transformers(default_model_dir):
    import subprocess
    import sys

    code = (
        "import sys; from nanoinfer.config import Config; from nanoinfer.llm import load_tokenizer\n"
        f"c = Config({str(default_model_dir)!r}, device='cpu'); t = load_tokenizer(c.model)\n"
        "print(type(c.hf_config).__name__, type(t).__name__, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["HFConfig", "FastTokenizer", "False"]
    assert isinstance(Config(str(default_model_dir), device="cpu").hf_config, HFConfig)
