"""Config's LoRA fields: each ConfigError names the field, the value and the fix; max_loras, max_cpu_loras and
enable_lora are filled in (with a note) from the adapters `loras` names; --lora NAME=PATH flags parse or say why not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from factories import config_problems, only_config_problem
from safetensors.torch import save_file
from transformers import LlamaConfig

from nanoinfer.cli.engine_options import parse_lora_flags
from nanoinfer.config import Config
from nanoinfer.errors import ConfigError

TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=2048)  # fmt: skip


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    """A tiny llama folder with only its config.json: enough for Config."""
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(**TINY_LLAMA).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> str:
    """A valid rank-4 adapter of the tiny llama (layer 0's q_proj), written by hand."""
    path = tmp_path_factory.mktemp("adapter")
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    generator = torch.Generator().manual_seed(0)
    module = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{module}.lora_A.weight": torch.randn(4, 64, generator=generator),
               f"{module}.lora_B.weight": torch.randn(64, 4, generator=generator)},
              str(path / "adapter_model.safetensors"))  # fmt: skip
    return str(path)


def problems_of(**kwargs) -> list:
    return config_problems(device="cpu", **kwargs)


def only_problem(**kwargs):
    return only_config_problem(device="cpu", **kwargs)


def test_max_cpu_loras_under_max_loras_is_refused(llama_dir):
    problem = only_problem(model=llama_dir, enable_lora=True, max_loras=4, max_cpu_loras=2)
    assert (problem.field, problem.value) == ("max_cpu_loras", 2)
    assert "must be at least max_loras (4)" in problem.message and "leave it 0" in problem.message


@pytest.mark.parametrize("loras", [["./adapter"], "support=./adapter", 3])
def test_loras_that_are_not_a_mapping_are_refused(llama_dir, loras):
    problem = only_problem(model=llama_dir, loras=loras)
    assert (problem.field, problem.value) == ("loras", loras)
    assert "must map adapter names to PEFT folders" in problem.message
    assert "--lora support=./adapters/support" in problem.message  # the fix, both ways of giving it


@pytest.mark.parametrize("name", ["", "   ", 7])
def test_an_adapter_name_that_is_empty_or_no_string_is_refused(llama_dir, adapter_dir, name):
    problem = only_problem(model=llama_dir, loras={name: adapter_dir})
    assert (problem.field, problem.value) == ("loras", {name: adapter_dir})
    assert "each entry is a name (a non-empty string)" in problem.message


def test_an_adapter_path_that_is_no_path_is_refused(llama_dir):
    problem = only_problem(model=llama_dir, loras={"support": 3})
    assert problem.field == "loras" and "the adapter's folder (a path string)" in problem.message


@pytest.mark.parametrize("rank", [0, 513])
def test_max_lora_rank_outside_1_to_512_is_refused(llama_dir, rank):
    problem = only_problem(model=llama_dir, enable_lora=True, max_lora_rank=rank)
    assert (problem.field, problem.value, problem.message) == ("max_lora_rank", rank, "must be between 1 and 512.")


@pytest.mark.parametrize("rank", [1, 512])
def test_max_lora_rank_bounds_are_accepted(llama_dir, rank):
    assert Config(model=llama_dir, device="cpu", enable_lora=True, max_lora_rank=rank).max_lora_rank == rank


@pytest.mark.parametrize("num_loras, expected", [(3, 3), (8, 8), (10, 8)])
def test_max_loras_zero_is_one_slot_an_adapter_up_to_8(llama_dir, adapter_dir, num_loras, expected):
    loras = {f"adapter{i}": adapter_dir for i in range(num_loras)}
    config = Config(model=llama_dir, device="cpu", loras=loras)
    assert config.max_loras == expected
    assert config.max_cpu_loras == num_loras  # every named adapter kept read (at least max_loras)
    assert ("max_loras", expected, "one slot an adapter `loras` names (at most 8)") in config.notes


def test_max_loras_zero_without_loras_is_one(llama_dir):
    config = Config(model=llama_dir, device="cpu", enable_lora=True)
    assert (config.max_loras, config.max_cpu_loras) == (1, 1)
    assert ("max_loras", 1, "one slot an adapter `loras` names (at most 8)") in config.notes
    off = Config(model=llama_dir, device="cpu")  # LoRA off: resolved alike, but nothing to note
    assert off.max_loras == 1 and not off.enable_lora
    assert not [note for note in off.notes if note[0] in ("max_loras", "enable_lora")]


def test_a_max_loras_given_is_kept(llama_dir, adapter_dir):
    config = Config(model=llama_dir, device="cpu", loras={"a": adapter_dir, "b": adapter_dir}, max_loras=1)
    assert (config.max_loras, config.max_cpu_loras) == (1, 2)
    assert not [note for note in config.notes if note[0] == "max_loras"]


def test_loras_turn_enable_lora_on_with_a_note(llama_dir, adapter_dir):
    config = Config(model=llama_dir, device="cpu", loras={"support": adapter_dir, "legal": adapter_dir})
    assert config.enable_lora is True
    assert ("enable_lora", True, "`loras` names 2 adapter(s)") in config.notes
    assert config.loras == {"support": str(Path(adapter_dir).resolve()), "legal": str(Path(adapter_dir).resolve())}


def test_an_adapter_that_cannot_run_is_a_problem_naming_it(llama_dir, adapter_dir, tmp_path):
    # malformed contents (alpha_pattern a list) are a problem of that adapter, never a traceback
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "alpha_pattern": ["q_proj"]}))
    (bad / "adapter_model.safetensors").write_bytes((Path(adapter_dir) / "adapter_model.safetensors").read_bytes())
    problem = only_problem(model=llama_dir, loras={"good": adapter_dir, "bad": str(bad)})
    assert (problem.field, problem.value) == ("loras", {"bad": str(bad)})
    assert problem.message.startswith("alpha_pattern is ['q_proj']: expected a mapping")


# ---- --lora NAME=PATH ---------------------------------------------------------------------------------------------


def test_lora_flags_parse_to_a_mapping():
    assert parse_lora_flags([" support = ./a ", "legal=./b=c"]) == {"support": "./a", "legal": "./b=c"}
    assert parse_lora_flags([]) is None and parse_lora_flags(None) is None


@pytest.mark.parametrize("flag", ["support", "=./adapters/support", "  =./a", "support=", "support=  "])
def test_a_lora_flag_without_name_and_path_is_refused(flag):
    with pytest.raises(ConfigError) as info:
        parse_lora_flags(["ok=./ok", flag])
    (problem,) = info.value.problems
    assert (problem.field, problem.value) == ("loras", flag)
    assert "--lora takes NAME=PATH, e.g. --lora support=./adapters/support" in problem.message


def test_a_lora_name_given_twice_is_refused():
    with pytest.raises(ConfigError) as info:
        parse_lora_flags(["support=./a", "legal=./b", "support =./c", "=", "legal=./d"])
    messages = [(p.value, p.message) for p in info.value.problems]
    assert len(messages) == 3  # every malformed flag at once
    assert messages[0] == ("support =./c", "names 'support' twice: give each adapter its own name.")
    assert messages[2] == ("legal=./d", "names 'legal' twice: give each adapter its own name.")
