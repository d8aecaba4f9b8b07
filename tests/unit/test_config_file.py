"""YAML config files: the traps PyYAML lets through are errors, and flag > YAML > default."""

from pathlib import Path

import pytest
from transformers import Qwen3Config

from nanoinfer.config import Config, field_default, settable_fields
from nanoinfer.config_file import build_config, load_config_file, make_config, merge_settings
from nanoinfer.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture
def model_dir(tmp_path):
    folder = tmp_path / "tiny-qwen3"
    Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=2048,
    ).save_pretrained(folder)
    return str(folder)


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "engine.yaml"
    path.write_text(text)
    return path


def load_problems(path) -> list:
    with pytest.raises(ConfigError) as excinfo:
        load_config_file(path)
    return excinfo.value.problems


def test_valid_file_returns_its_fields(tmp_path):
    path = write(tmp_path, "model: ./m\nmax_num_seqs: 64  # comment\ngpu_memory_utilization: 0.5\n")
    assert load_config_file(path) == {"model": "./m", "max_num_seqs": 64, "gpu_memory_utilization": 0.5}


def test_empty_file_means_all_defaults(tmp_path):
    assert load_config_file(write(tmp_path, "# nothing set\n")) == {}


def test_duplicate_key_names_the_key_and_both_lines(tmp_path):
    path = write(tmp_path, "max_num_seqs: 64\nmodel: ./m\nmax_num_seqs: 128\n")
    (problem,) = load_problems(path)
    assert problem.field == "max_num_seqs"
    assert "given twice" in problem.message and "(lines 1 and 3)" in problem.message
    assert "Keep one of them" in problem.message


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    path = write(tmp_path, "base: &b {max_num_seqs: 8}\n")  # an unknown key, but no duplicate report
    problems = load_problems(path)
    assert all("given twice" not in p.message for p in problems)


def test_unknown_key_suggests_the_right_one_and_lists_valid_keys(tmp_path):
    path = write(tmp_path, "model: ./m\ngpu_memory_utilisation: 0.5\n")
    (problem,) = load_problems(path)
    assert (
        "unknown key(s) gpu_memory_utilisation (line 2; did you mean gpu_memory_utilization?)"
        in problem.message
    )
    assert "Valid keys: model, max_num_batched_tokens, max_num_seqs" in problem.message


def test_unknown_key_without_a_close_match(tmp_path):
    (problem,) = load_problems(write(tmp_path, "zzz: 1\n"))
    assert "unknown key(s) zzz (line 1)" in problem.message and "did you mean" not in problem.message


@pytest.mark.parametrize(
    ("text", "field", "expected"),
    [
        ('max_num_seqs: "64"\n', "max_num_seqs", "got the string '64'. Remove the quotes"),
        ("max_num_seqs: yes\n", "max_num_seqs", "got a boolean (True). YAML reads yes/no/on/off/true/false"),
        ("max_num_seqs: 64.5\n", "max_num_seqs", "expected an integer, got a float (64.5)"),
        ("max_num_seqs:\n", "max_num_seqs", "got no value (null)"),
        ("enforce_eager: 1\n", "enforce_eager", "expected true or false"),
        ("device: [cpu]\n", "device", "expected a string, got a list"),
    ],
)
def test_wrong_types_name_field_value_and_expected_type(tmp_path, text, field, expected):
    (problem,) = load_problems(write(tmp_path, text))
    assert problem.field == field
    assert expected in problem.message


def test_int_is_accepted_for_float_fields(tmp_path):
    assert load_config_file(write(tmp_path, "gpu_memory_utilization: 1\n")) == {"gpu_memory_utilization": 1}


@pytest.mark.parametrize("field", ["hf_config", "eos", "notes"])
def test_placeholders_cannot_be_set_from_yaml(tmp_path, field):
    (problem,) = load_problems(write(tmp_path, f"{field}: 1\n"))
    assert problem.field == field and "cannot be set in a config file" in problem.message


def test_syntax_error_gives_line_and_column(tmp_path):
    path = write(tmp_path, "model: ./m\nmax_num_seqs: [1, 2\n")
    with pytest.raises(ConfigError) as excinfo:
        load_config_file(path)
    message = str(excinfo.value)
    assert f"{path}:3:1: YAML syntax error" in message


def test_tab_indentation_error_gives_line_and_column(tmp_path):
    path = write(tmp_path, "model: ./m\n\tmax_num_seqs: 4\n")
    with pytest.raises(ConfigError, match=r"engine.yaml:2:1: YAML syntax error"):
        load_config_file(path)


@pytest.mark.parametrize(("text", "kind"), [("- model: ./m\n", "list"), ("just a string\n", "str")])
def test_a_file_that_is_not_a_mapping_is_refused(tmp_path, text, kind):
    with pytest.raises(
        ConfigError, match=f"must be a mapping of `field: value` lines .* this one is a {kind}"
    ):
        load_config_file(write(tmp_path, text))


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot be read .*No such file"):
        load_config_file(tmp_path / "nope.yaml")


def test_every_file_problem_at_once(tmp_path):
    text = 'max_num_seqs: "64"\nmax_num_seqs: 1\ngpu_memory_utilisation: 0.5\neos: 2\nseed: 1.5\n'
    problems = load_problems(write(tmp_path, text))
    assert len(problems) == 4  # duplicate, unknown, eos not settable, seed type ("64" was replaced by 1)


def test_precedence_flag_over_yaml_over_default(tmp_path, model_dir):
    path = write(tmp_path, f"model: {model_dir}\nmax_num_seqs: 64\nmax_model_len: 1024\n")
    config = build_config(path, {"max_num_seqs": 8, "max_model_len": None})
    assert config.max_num_seqs == 8  # flag
    assert config.max_model_len == 1024  # YAML (the flag was not given)
    assert config.max_num_batched_tokens == 16384  # default
    _, sources, _ = merge_settings(path, {"max_num_seqs": 8, "max_model_len": None})
    assert (sources["max_num_seqs"], sources["max_model_len"], sources["seed"]) == ("flag", "yaml", "default")


def test_build_config_without_a_file(model_dir):
    config = build_config(None, {"model": model_dir, "device": "cpu"})
    assert isinstance(config, Config) and config.device == "cpu"


def test_build_config_reports_file_and_value_problems_together(tmp_path, model_dir):
    path = write(
        tmp_path, f"model: {model_dir}\nmax_num_seqs: yes\nkvcache_block_size: 100\nfoo: 1\nfoo: 2\n"
    )
    with pytest.raises(ConfigError) as excinfo:
        build_config(path, {"device": "cpu"})
    fields = [p.field for p in excinfo.value.problems]
    assert fields == ["foo", "", "max_num_seqs", "kvcache_block_size"]  # duplicate, unknown, type, rule


def test_wrong_override_name_is_a_bug_in_the_command():
    with pytest.raises(TypeError, match="not Config fields"):
        merge_settings(None, {"max_num_seq": 8})


def test_relative_model_path_resolves_against_the_working_directory(tmp_path, model_dir, monkeypatch):
    elsewhere = tmp_path / "conf"
    elsewhere.mkdir()
    path = elsewhere / "engine.yaml"
    path.write_text("model: ./tiny-qwen3\n")
    monkeypatch.chdir(tmp_path)
    assert build_config(path, {"device": "cpu"}).model == str(Path(model_dir).resolve())


@pytest.mark.parametrize("name", ["default.yaml", "qwen3.yaml", "qwen2.yaml", "llama.yaml"])
def test_shipped_configs_load_and_build(name, model_dir):
    values = load_config_file(CONFIGS / name)
    assert "model" in values
    config = build_config(CONFIGS / name, {"model": model_dir, "device": "cpu"})
    assert config.hf_config.model_type == "qwen3"


def test_default_yaml_spells_out_every_default():
    values = load_config_file(CONFIGS / "default.yaml")
    assert set(values) == set(settable_fields())
    assert values == {name: field_default(name) for name in settable_fields()}


def test_make_config_resolves_the_model_argument_first_and_notes_what_was_given(model_dir, monkeypatch):
    from nanoinfer import model_source

    asked = []
    monkeypatch.setattr(model_source, "resolve_model", lambda model: asked.append(model) or Path(model_dir))
    config = make_config({"model": "my-alias", "device": "cpu"})
    assert asked == ["my-alias"] and config.model == model_dir
    assert config.notes[0] == ("model", model_dir, "resolved from 'my-alias'")
    make_config({"device": "cpu"})
    assert asked[-1] == "smollm2-135m-instruct"  # no model: the built-in default


def test_an_unresolvable_model_is_reported_once_with_the_other_problems(tmp_path):
    missing = str(tmp_path / "nope")
    path = write(tmp_path, "foo: 1\nkvcache_block_size: 100\n")
    with pytest.raises(ConfigError) as excinfo:
        build_config(path, {"model": missing, "device": "cpu"})
    problems = excinfo.value.problems
    assert [p.field for p in problems] == ["", "kvcache_block_size", "model"]
    assert "does not exist" in problems[2].message  # model_source's message, not Config's "not a folder"


def test_a_command_default_yields_to_the_file_and_the_flag(tmp_path, model_dir):
    wait = {"cpu_kernels": "wait"}  # bench's and a large generate job's own default
    assert build_config(None, {"model": model_dir, "device": "cpu"}, wait).cpu_kernels == "wait"
    assert build_config(None, {"model": model_dir, "device": "cpu"}).cpu_kernels == "auto"  # Config's default
    path = write(tmp_path, f"model: {model_dir}\ncpu_kernels: auto\n")
    assert build_config(path, {"device": "cpu"}, wait).cpu_kernels == "auto"
    assert build_config(path, {"device": "cpu", "cpu_kernels": "off"}, wait).cpu_kernels == "off"
    _, sources, _ = merge_settings(None, {}, wait)
    assert sources["cpu_kernels"] == "default"
