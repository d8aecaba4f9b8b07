"""Config validation: every rule names the field, the value and the fix; all problems come at once."""

import ast
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from factories import config_problems, only_config_problem
from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

import nanoinfer.config as config_module
from nanoinfer.config import Config
from nanoinfer.errors import ConfigError

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 2048,
}
HAS_CUDA = torch.cuda.is_available()


def make_model_dir(path: Path, config_class=Qwen3Config, **overrides) -> str:
    """A model folder with only a config.json: enough for Config, no weights."""
    config_class(**{**TINY, **overrides}).save_pretrained(path)
    return str(path)


@pytest.fixture
def model_dir(tmp_path):
    return make_model_dir(tmp_path / "tiny-qwen3")




def test_valid_config_loads_hf_config_and_fills_in_auto_values(model_dir):
    config = Config(model=model_dir, device="cpu")
    assert config.hf_config.model_type == "qwen3"
    assert config.model == str(Path(model_dir).resolve())
    assert (config.dtype, config.attention_backend) == ("float32", "torch")
    assert ("dtype", "float32", "auto for cpu") in config.notes
    assert config.eos == -1 and config.num_kvcache_blocks == -1


def test_max_model_len_is_clamped_with_a_note(model_dir):
    config = Config(model=model_dir, max_model_len=100_000, device="cpu")
    assert config.max_model_len == 2048
    assert (
        "max_model_len",
        2048,
        "clamped from 100000 to the model's max_position_embeddings",
    ) in config.notes


@pytest.mark.parametrize("config_class", [Qwen3Config, Qwen2Config, LlamaConfig, MistralConfig])
def test_supported_families_are_accepted(tmp_path, config_class):
    config = Config(model=make_model_dir(tmp_path, config_class), device="cpu")
    assert config.hf_config.model_type in ("qwen3", "qwen2", "llama", "mistral")


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    GPT2Config(n_embd=64, n_layer=1, n_head=4).save_pretrained(tmp_path)
    problem = only_config_problem(model=str(tmp_path), device="cpu")
    assert problem.field == "model"
    assert "model_type 'gpt2'" in problem.message
    assert "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM" in problem.message
    assert "Gemma2ForCausalLM" in problem.message and "Phi3ForCausalLM" in problem.message


def test_unreadable_config_json_is_a_problem_not_a_crash(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    problem = only_config_problem(model=str(tmp_path), device="cpu")
    assert problem.field == "model" and "config.json cannot be read" in problem.message


def test_missing_model_is_reported_with_the_other_problems(tmp_path):
    problems = config_problems(model=str(tmp_path / "nope"), kvcache_block_size=100, tensor_parallel_size=3)
    assert [p.field for p in problems] == ["kvcache_block_size", "model"]  # tp=3 needs the model: skipped


@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "Qwen/Qwen3-0.6B", "model.gguf"])
def test_config_reads_local_folders_only_and_never_fetches(model, tmp_path, monkeypatch):
    """Names, hub ids and .gguf files are model_source's to resolve, before Config: Config fetches nothing."""
    from nanoinfer import model_source

    def refuse(*args, **kwargs):
        raise AssertionError("Config must not resolve, download or build a model")

    for name in ("resolve_model", "ensure_default_model", "gguf_model_folder", "_download_from_hub"):
        monkeypatch.setattr(model_source, name, refuse)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    problem = only_config_problem(model=model, device="cpu")
    assert (problem.field, problem.value) == ("model", model)
    assert "Config reads a local Hugging Face model folder" in problem.message
    assert "nanoinfer.model_source.resolve_model()" in problem.message and "--model" in problem.message


# (kwargs, field, value, text of the rule or fix the message must contain)
RULES = [
    ({"kvcache_block_size": 100}, "kvcache_block_size", 100, "Use 256, 512"),
    ({"kvcache_block_size": 0}, "kvcache_block_size", 0, "positive multiple of 256"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size", 0, "between 1 and 8"),
    ({"tensor_parallel_size": 9}, "tensor_parallel_size", 9, "between 1 and 8"),
    ({"tensor_parallel_size": 3}, "tensor_parallel_size", 3, "Use one of 1, 2."),
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization", 0, "must be in (0, 1]. Use e.g. 0.9"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization", 1.5, "must be in (0, 1]"),
    ({"gpu_memory_utilization": float("nan")}, "gpu_memory_utilization", None, "must be in (0, 1]"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens", 0, "positive integer"),
    ({"max_num_seqs": -1}, "max_num_seqs", -1, "positive integer. Use at least 1"),
    ({"max_model_len": 0}, "max_model_len", 0, "positive integer"),
    ({"num_kvcache_blocks": 0}, "num_kvcache_blocks", 0, "must be -1 (size the cache from free memory)"),
    ({"num_kvcache_blocks": -2}, "num_kvcache_blocks", -2, "or a positive block count"),
    (
        {"max_num_batched_tokens": 8, "max_num_seqs": 16},
        "max_num_batched_tokens",
        8,
        "must be >= max_num_seqs (16)",
    ),
    (
        {"num_kvcache_blocks": 3, "max_model_len": 1024},
        "num_kvcache_blocks",
        3,
        "holds 768 tokens (3 x 256), fewer than one max_model_len sequence (1024). Use at least 4 blocks",
    ),
    ({"device": "tpu"}, "device", "tpu", "must be one of auto, cpu, cuda"),
    ({"dtype": "float64"}, "dtype", "float64", "must be one of auto, float32, bfloat16, float16"),
    ({"dtype": "float16", "device": "cpu"}, "dtype", "float16", "Use bfloat16 or float32"),
    ({"kv_cache_dtype": "int8"}, "kv_cache_dtype", "int8", "must be one of auto, float32, bfloat16, float16, fp8,"),
    ({"kv_cache_dtype": "fp8_e4m3fnuz"}, "kv_cache_dtype", "fp8_e4m3fnuz", "fp8, fp8_e4m3, fp8_e5m2. Pick one"),
    ({"kv_cache_dtype": "float16"}, "kv_cache_dtype", "float16", "Use bfloat16 for a half-size cache, or auto"),
    ({"attention_backend": "xformers"}, "attention_backend", "xformers", "auto, torch, triton, flash-attn"),
    ({"attention_backend": "triton", "device": "cpu"}, "attention_backend", "triton", "runs only on CUDA"),
    (
        {"attention_backend": "flash-attn", "device": "cpu"},
        "attention_backend",
        "flash-attn",
        "attention_backend: torch",
    ),
    ({"cpu_kvcache_space_gib": 0}, "cpu_kvcache_space_gib", 0, "must be positive. Use e.g. 4"),
    ({"num_threads": -1}, "num_threads", -1, "must be 0 (one thread per physical core)"),
    ({"model": ""}, "model", "", "is empty"),
    ({"cpu_kernels": "fast"}, "cpu_kernels", "fast", "must be one of auto, wait, off"),
]


@pytest.mark.parametrize(
    ("kwargs", "field", "value", "text"), RULES, ids=[r[1] + str(i) for i, r in enumerate(RULES)]
)
def test_each_rule_names_field_value_and_fix(model_dir, kwargs, field, value, text):
    problem = only_config_problem(**{"model": model_dir, "device": "cpu", **kwargs})
    assert problem.field == field
    if value is not None:
        assert problem.value == value
    assert text in problem.message


def test_the_kvcache_minimum_uses_the_clamped_max_model_len(model_dir):
    problem = only_config_problem(model=model_dir, device="cpu", num_kvcache_blocks=1, max_model_len=10_000)
    assert "one max_model_len sequence (2048). Use at least 8 blocks" in problem.message


@pytest.mark.skipif(HAS_CUDA, reason="checks the message for a machine without CUDA")
def test_cuda_requested_without_cuda(model_dir):
    problem = only_config_problem(model=model_dir, device="cuda")
    assert (problem.field, problem.value) == ("device", "cuda")
    assert "CUDA is not available" in problem.message and "Use device: cpu" in problem.message


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_flash_attn_needs_half_precision_on_cuda(model_dir):
    problems = config_problems(model=model_dir, device="cuda", dtype="float32", attention_backend="flash-attn")
    assert problems[0].field == "attention_backend"


def test_kv_cache_dtype_auto_is_the_model_dtype_and_a_set_one_is_kept(model_dir):
    assert Config(model=model_dir, device="cpu").kv_cache_dtype == "float32"
    assert Config(model=model_dir, device="cpu", dtype="bfloat16").kv_cache_dtype == "bfloat16"
    assert Config(model=model_dir, device="cpu", kv_cache_dtype="bfloat16").kv_cache_dtype == "bfloat16"
    assert Config(model=model_dir, device="cpu", dtype="bfloat16", kv_cache_dtype="float32").kv_cache_dtype == "float32"


def test_fp8_kv_cache_is_e4m3_and_on_cuda_needs_compute_capability_8_9_for_triton(model_dir, monkeypatch):
    """The Triton kernels read and write e4m3 (Triton's fp8e4nv compiles for sm_89 and newer only); e5m2, and
    e4m3 through the torch backend, run on older GPUs too."""
    from nanoinfer.attention import backend

    config = Config(model=model_dir, device="cpu", kv_cache_dtype="fp8")
    assert config.kv_cache_dtype == "fp8_e4m3"
    assert ("kv_cache_dtype", "fp8_e4m3", "fp8 = fp8_e4m3 (as in vLLM)") in config.notes
    assert Config(model=model_dir, device="cpu", kv_cache_dtype="fp8_e5m2").kv_cache_dtype == "fp8_e5m2"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the rule itself, without a GPU here
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(backend, "flash_attn_available", lambda: True)  # auto passes it over: the cache differs
    monkeypatch.setattr(backend, "triton_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    hopper = Config(model=model_dir, device="cuda", dtype="float16", kv_cache_dtype="fp8")
    assert (hopper.kv_cache_dtype, hopper.attention_backend) == ("fp8_e4m3", "triton")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    problem = only_config_problem(model=model_dir, device="cuda", dtype="float16", kv_cache_dtype="fp8")
    assert (problem.field, problem.value) == ("kv_cache_dtype", "fp8_e4m3")
    assert "compute capability 8.9 or newer" in problem.message and "this one is 8.0" in problem.message
    assert "Use fp8_e5m2 or bfloat16, or attention_backend: torch" in problem.message
    e5m2 = Config(model=model_dir, device="cuda", dtype="float16", kv_cache_dtype="fp8_e5m2")
    assert e5m2.kv_cache_dtype == "fp8_e5m2"
    forced = Config(model=model_dir, device="cuda", dtype="float16", kv_cache_dtype="fp8", attention_backend="torch")
    assert forced.kv_cache_dtype == "fp8_e4m3"


def test_flash_attn_refuses_a_cache_in_another_dtype_and_auto_passes_it_over(monkeypatch):
    """flash_attn_with_kvcache reads the cache in the query's dtype: a forced flash-attn names the fix, and
    auto picks triton instead (the rule itself, so it runs without CUDA or flash-attn here)."""
    from nanoinfer.attention import backend
    from nanoinfer.errors import ConfigError

    monkeypatch.setattr(backend, "flash_attn_available", lambda: True)
    monkeypatch.setattr(backend, "triton_available", lambda: True)
    assert backend.select_backend("auto", "cuda", "bfloat16", "bfloat16")[0] == "flash-attn"
    assert backend.select_backend("auto", "cuda", "bfloat16", "float32")[0] == "triton"
    with pytest.raises(ConfigError, match="kv_cache_dtype is float32. Use kv_cache_dtype: auto"):
        backend.select_backend("flash-attn", "cuda", "bfloat16", "float32")


# Values a YAML file or Python code can sneak in: bool is not an int, "64" is not an int.
TYPES = [
    ("max_num_seqs", True, "expected an integer, got a boolean (True). YAML reads yes/no"),
    ("max_num_seqs", "64", "expected an integer, got the string '64'. Remove the quotes: `max_num_seqs: 64`"),
    ("max_num_seqs", 64.0, "got a float (64.0). Write it without the decimal point: `max_num_seqs: 64`"),
    ("max_num_seqs", 64.5, "expected an integer, got a float (64.5). Write it like `max_num_seqs: 512`"),
    (
        "max_num_seqs",
        None,
        "got no value (null). Give a value, or remove `max_num_seqs` to use the default (512)",
    ),
    ("gpu_memory_utilization", "0.9", "expected a number, got the string '0.9'. Remove the quotes"),
    ("gpu_memory_utilization", False, "expected a number, got a boolean (False)"),
    (
        "enforce_eager",
        "yes",
        "expected true or false, got the string 'yes'. Write it like `enforce_eager: false`",
    ),
    ("enforce_eager", 1, "expected true or false, got an integer (1)"),
    ("device", 1, "expected a string, got an integer (1)"),
    ("seed", "1", "expected an integer, got the string '1'"),
    ("model", 5, "expected a string, got an integer (5)"),
    ("eos", "2", "expected an integer"),
]


@pytest.mark.parametrize(("field", "value", "text"), TYPES)
def test_wrong_types_are_refused(model_dir, field, value, text):
    problem = only_config_problem(**{"model": model_dir, "device": "cpu", field: value})
    assert (problem.field, problem.value) == (field, value)
    assert text in problem.message


def test_int_is_accepted_for_float_fields(model_dir):
    config = Config(model=model_dir, device="cpu", gpu_memory_utilization=1, cpu_kvcache_space_gib=2)
    assert config.gpu_memory_utilization == 1.0 and isinstance(config.gpu_memory_utilization, float)
    assert isinstance(config.cpu_kvcache_space_gib, float)


def test_path_objects_are_accepted_for_model(model_dir):
    assert Config(model=Path(model_dir), device="cpu").model == str(Path(model_dir).resolve())


def test_all_problems_are_reported_at_once(model_dir):
    problems = config_problems(
        model=model_dir,
        device="cpu",
        max_num_seqs=True,
        kvcache_block_size=100,
        gpu_memory_utilization=2.0,
        dtype="float16",
        tensor_parallel_size=3,
        num_threads=-1,
    )
    fields = sorted(p.field for p in problems)
    assert fields == sorted(
        [
            "max_num_seqs",
            "kvcache_block_size",
            "gpu_memory_utilization",
            "dtype",
            "tensor_parallel_size",
            "num_threads",
        ]
    )
    message = str(ConfigError(problems))
    assert message.startswith("6 problem(s) in the configuration:")


def test_a_wrongly_typed_field_skips_the_rules_that_read_it(model_dir):
    # max_num_seqs="64" must not also trip max_num_batched_tokens >= max_num_seqs (or crash comparing str/int).
    problem = only_config_problem(model=model_dir, device="cpu", max_num_seqs="64", max_num_batched_tokens=8)
    assert problem.field == "max_num_seqs"


def test_trust_remote_code_is_off_unless_asked(model_dir, tmp_path, monkeypatch):
    import json
    import shutil

    from transformers import AutoConfig

    from nanoinfer.models.config import HFConfig

    calls = []
    original = AutoConfig.from_pretrained

    def spy(*args, **kwargs):
        calls.append(kwargs.get("trust_remote_code"))
        return original(*args, **kwargs)

    monkeypatch.setattr(AutoConfig, "from_pretrained", spy)
    assert isinstance(Config(model=model_dir, device="cpu").hf_config, HFConfig)  # read directly: no code runs
    Config(model=model_dir, device="cpu", trust_remote_code=True)
    scaled = shutil.copytree(model_dir, tmp_path / "scaled")  # scaled rotary: only AutoConfig reads it right
    raw = json.loads((scaled / "config.json").read_text())
    raw["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    (scaled / "config.json").write_text(json.dumps(raw))
    Config(model=scaled, device="cpu")
    assert calls == [True, False]


def test_replace_revalidates_and_starts_fresh_notes(model_dir):
    config = Config(model=model_dir, device="cpu")
    smaller = dataclasses.replace(config, max_num_seqs=8, max_num_batched_tokens=64)
    assert smaller.max_num_seqs == 8 and smaller.hf_config is not None
    with pytest.raises(ConfigError):
        dataclasses.replace(config, kvcache_block_size=100)


def test_validation_never_uses_assert():
    for module in ("config.py", "config_file.py"):
        source = (Path(config_module.__file__).parent / module).read_text()
        asserts = [n.lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Assert)]
        assert asserts == [], f"{module} uses assert on lines {asserts}"


def test_same_problems_under_python_dash_O(model_dir):
    script = f"""
import json
from nanoinfer.config import Config
from nanoinfer.errors import ConfigError
try:
    Config(model={model_dir!r}, device="cpu", kvcache_block_size=100, tensor_parallel_size=9, max_num_seqs="64")
except ConfigError as e:
    print(json.dumps([p.to_dict() for p in e.problems]))
else:
    print("no error")
"""
    outputs = []
    for flags in ([], ["-O"]):
        run = subprocess.run(
            [sys.executable, *flags, "-c", script], check=False, capture_output=True, text=True, timeout=300
        )
        assert run.returncode == 0, run.stderr
        outputs.append(json.loads(run.stdout.strip().splitlines()[-1]))
    assert outputs[0] == outputs[1]
    assert [p["field"] for p in outputs[1]] == ["max_num_seqs", "kvcache_block_size", "tensor_parallel_size"]
