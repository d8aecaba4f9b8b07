"""`nanoinfer check-config` through Typer's CliRunner: exit codes, what is shown, what must not be."""

import json

import pytest
from transformers import Qwen3Config
from typer.testing import CliRunner

from nanoinfer.cli import app

runner = CliRunner()
WIDE = {"COLUMNS": "200"}  # rich wraps table cells at 80 columns otherwise


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


def write(tmp_path, text: str) -> str:
    path = tmp_path / "engine.yaml"
    path.write_text(text)
    return str(path)


def check(*args: str):
    return runner.invoke(app, ["check-config", *args], env=WIDE)


def test_valid_config_exits_0_and_shows_resolved_values_and_sources(tmp_path, model_dir):
    path = write(tmp_path, f"model: {model_dir}\nmax_num_seqs: 64\n")
    result = check(path, "--device", "cpu", "--max-model-len", "9000")
    assert result.exit_code == 0, result.output
    lines = {line.split("│")[1].strip(): line for line in result.output.splitlines() if line.count("│") >= 4}
    assert "64" in lines["max_num_seqs"] and "yaml" in lines["max_num_seqs"]
    assert "2048" in lines["max_model_len"] and "flag" in lines["max_model_len"]
    assert "clamped from 9000 to the model's max_position_embeddings" in lines["max_model_len"]
    assert "filled-in" in lines["attention_backend"] and "default" in lines["seed"]
    assert "the configuration is valid" in result.output
    assert "Traceback" not in result.output


def test_five_mistakes_are_all_reported_and_exit_2(tmp_path, model_dir):
    path = write(
        tmp_path,
        f"model: {model_dir}\n"
        'max_num_seqs: "64"\n'  # 1. a quoted number
        "gpu_memory_utilisation: 0.5\n"  # 2. a misspelt key
        "kvcache_block_size: 100\n"  # 3. not a multiple of 256
        "device: cpu\n"
        "dtype: float16\n"  # 4. float16 on the CPU
        "max_model_len: 1024\n"
        "max_model_len: 2048\n",  # 5. a duplicate key
    )
    result = check(path)
    assert result.exit_code == 2, result.output
    assert "5 problem(s) in the configuration" in result.output
    assert "max_num_seqs = '64': expected an integer, got the string '64'. Remove the quotes" in result.output
    assert (
        "unknown key(s) gpu_memory_utilisation (line 3; did you mean gpu_memory_utilization?)"
        in result.output
    )
    assert "kvcache_block_size = 100: must be a positive multiple of 256" in result.output
    assert (
        "dtype = 'float16': is not usable on the CPU" in result.output
        and "Use bfloat16 or float32" in result.output
    )
    assert "max_model_len = 2048: is given twice" in result.output and "(lines 7 and 8)" in result.output
    assert "Traceback" not in result.output


def test_flags_override_the_file_and_can_fix_it(tmp_path, model_dir):
    path = write(tmp_path, f"model: {model_dir}\nkvcache_block_size: 100\n")
    assert check(path, "--device", "cpu").exit_code == 2
    result = check(path, "--device", "cpu", "--kvcache-block-size", "512")
    assert result.exit_code == 0, result.output


def test_json_for_a_valid_config(tmp_path, model_dir):
    result = check(
        write(tmp_path, f"model: {model_dir}\n"), "--json", "--max-num-seqs", "8", "--device", "cpu"
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["ok"] is True and report["problems"] == []
    assert report["config"]["max_num_seqs"] == 8 and report["sources"]["max_num_seqs"] == "flag"
    assert report["sources"]["model"] == "yaml"
    assert {
        "field": "max_model_len",
        "value": 2048,
        "reason": "clamped from 4096 to the model's max_position_embeddings",
    } in report["notes"]


def test_json_for_an_invalid_config(tmp_path, model_dir):
    result = check(
        write(tmp_path, f"model: {model_dir}\nmax_num_seqs: yes\n"), "--json", "--tensor-parallel-size", "9"
    )
    assert result.exit_code == 2
    report = json.loads(result.output)
    assert report["ok"] is False
    assert [(p["field"], p["value"]) for p in report["problems"]] == [
        ("max_num_seqs", True),
        ("tensor_parallel_size", 9),
    ]
    assert (
        report["config"]["max_num_seqs"] is True and report["config"]["seed"] == 0
    )  # as given, defaults filled


def test_yaml_syntax_error_is_reported_with_line_and_column(tmp_path):
    path = write(tmp_path, "model: ./m\nmax_num_seqs: [1\n")
    result = check(path)
    assert result.exit_code == 2
    assert f"{path}:3:1: YAML syntax error" in result.output
    assert "Traceback" not in result.output


def test_missing_model_is_a_clear_error(tmp_path):
    result = check("--model", str(tmp_path / "nope"), "--device", "cpu")
    assert result.exit_code == 2
    assert "model = " in result.output and "Traceback" not in result.output


def test_bad_flag_value_is_a_usage_error():
    result = check("--max-num-seqs", "many")
    assert result.exit_code == 2 and "Traceback" not in result.output


def test_help_describes_the_command():
    result = runner.invoke(app, ["check-config", "--help"], env=WIDE)
    assert result.exit_code == 0
    assert "Check a config before a long job" in result.output and "--max-model-len" in result.output


def test_json_reports_an_unresolvable_model_argument_with_the_other_problems(tmp_path):
    result = check("--json", "--model", str(tmp_path / "nope"), "--kvcache-block-size", "100", "--device", "cpu")
    assert result.exit_code == 2 and "Traceback" not in result.output
    problems = json.loads(result.output)["problems"]
    assert [p["field"] for p in problems] == ["kvcache_block_size", "model"]
    assert "does not exist" in problems[1]["message"] and "smollm2-135m-instruct" in problems[1]["message"]
