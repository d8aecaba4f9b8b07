"""`nanoinfer plan-memory`: numbers, "what fits" answers, exit codes (0 fits, 2 bad input, 3 does not fit)."""

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from nanoinfer.cli import app

runner = CliRunner()
CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"
QWEN3 = str(CONFIGS / "qwen3-0.6b")
LLAMA3_8B = str(CONFIGS / "llama-3-8b")

# Qwen3-0.6B in bf16 (hand computation, see tests/unit/test_memory.py):
WEIGHTS = 596_049_920 * 2  # parameters (tied head) x 2 bytes = 1,192,099,840
ACTIVATION = 2 * 16384 * 1024 * 2 + 2 * 512 * 151936 * 4  # hidden + residual, float32 logits + probs
BLOCK = 2 * 28 * 256 * 8 * 128 * 2  # 29,360,128 bytes per 256-token block


def plan_memory(*args):
    result = runner.invoke(app, ["plan-memory", *args])
    assert "Traceback" not in result.output
    return result


def plan_json(*args):
    result = plan_memory(*args, "--json")
    return result, json.loads(result.stdout)


def test_qwen3_on_h200_matches_hand_computation():
    result, report = plan_json("--model", QWEN3, "--gpu", "H200")
    assert result.exit_code == 0
    budget = int(141e9 * 0.9) - WEIGHTS - ACTIVATION  # 126,900,000,000 - 1,192,099,840 - 689,438,720
    assert report["total_bytes"] == 141_000_000_000
    assert report["weights_bytes"] == WEIGHTS == 1_192_099_840
    assert report["weights_source"].startswith("estimated from config.json")
    assert report["activation_bytes"] == ACTIVATION == 689_438_720
    assert report["kv_budget_bytes"] == budget == 125_018_461_440
    assert report["block_bytes"] == BLOCK == 29_360_128
    assert report["kv_bytes_per_token"] == BLOCK // 256 == 114_688
    assert report["num_blocks"] == budget // BLOCK == 4258
    assert report["num_tokens"] == 4258 * 256
    assert report["max_concurrency"] == round(4258 / 16, 2)  # 16 blocks per 4096-token sequence
    assert report["max_num_seqs_at_max_model_len"] == 266
    assert report["largest_max_model_len"] == 40960  # the model's max_position_embeddings caps it
    assert report["smallest_tensor_parallel_size"] == 1
    assert report["fits"] is True and report["verdict"].startswith("fits: 4,258 blocks hold 1,090,048 tokens")


def test_lora_slots_come_out_of_the_kv_budget():
    """Qwen3-0.6B (28 layers, hidden 1024, q 2048, k/v 1024, MLP 3072): 4 slots of rank 16 in bf16, by hand."""
    per_layer = 16 * ((1024 + 2048) + 2 * (1024 + 1024) + (2048 + 1024) + 2 * (1024 + 3072) + (3072 + 1024))
    lora = 4 * 28 * per_layer * 2
    result, report = plan_json("--model", QWEN3, "--gpu", "H200", "--enable-lora", "--max-loras", "4")
    assert result.exit_code == 0
    assert (report["max_loras"], report["max_lora_rank"], report["lora_bytes"]) == (4, 16, lora)
    scratch = 16384 * 3 * 16 * 4  # the adapters' float32 shrink results: 3 slices of rank 16 a batched token
    assert report["activation_bytes"] == ACTIVATION + scratch
    assert report["kv_budget_bytes"] == int(141e9 * 0.9) - WEIGHTS - ACTIVATION - scratch - lora
    # tensor parallelism: o_proj / down_proj shard A, the others B
    result, report = plan_json("--model", QWEN3, "--gpu", "H200", "--enable-lora", "--max-loras", "4", "--tp", "2")
    sharded = 16 * ((1024 + 1024) + 2 * (1024 + 512) + (1024 + 1024) + 2 * (1024 + 1536) + (1536 + 1024))
    assert report["lora_bytes"] == 4 * 28 * sharded * 2
    _, plain = plan_json("--model", QWEN3, "--gpu", "H200")
    assert plain["lora_bytes"] == 0 and plain["max_loras"] == 0


def test_table_output_shows_the_numbers_and_the_verdict():
    result = plan_memory("--model", QWEN3, "--gpu", "h200")
    assert result.exit_code == 0
    for text in ("KV-cache plan: qwen3-0.6b on H200", "1,192,099,840", "689,438,720", "114,688", "29,360,128",
                 "4,258", "1,090,048", "266.12", "largest max_model_len: 40,960",
                 "sequences of max_model_len 4096 at once: 266", "smallest tensor_parallel_size that fits: 1",
                 "verdict: fits"):  # fmt: skip
        assert text in result.output, text


@pytest.mark.parametrize(
    "name, total", [("A100-80GB", 80 * 10**9), ("rtx 4090", 24 * 10**9), ("NVIDIA L40S", 48 * 10**9)]
)
def test_gpu_table(name, total):
    result, report = plan_json("--model", QWEN3, "--gpu", name)
    assert result.exit_code == 0
    assert report["total_bytes"] == total


def test_unknown_gpu_is_a_usage_error_with_suggestions():
    result = plan_memory("--model", QWEN3, "--gpu", "H2000")
    assert result.exit_code == 2
    assert "unknown GPU 'H2000'. Did you mean H200" in result.output
    assert "--gpu-memory" in result.output


@pytest.mark.parametrize(
    "size, total", [("80GiB", 80 * 2**30), ("80GB", 80 * 10**9), ("143771MiB", 143771 * 2**20)]
)
def test_gpu_memory_is_parsed(size, total):
    result, report = plan_json("--model", QWEN3, "--gpu-memory", size)
    assert result.exit_code == 0
    assert report["total_bytes"] == total


def test_bad_gpu_memory_is_a_usage_error():
    result = plan_memory("--model", QWEN3, "--gpu-memory", "80 gigs")
    assert result.exit_code == 2
    assert "cannot read memory size '80 gigs'" in result.output


def test_gpu_and_gpu_memory_together_are_refused():
    result = plan_memory("--model", QWEN3, "--gpu", "H200", "--gpu-memory", "80GiB")
    assert result.exit_code == 2
    assert "either --gpu or --gpu-memory" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the device is measured instead")
def test_no_gpu_here_and_none_named_says_how_to_name_one():
    result = plan_memory("--model", QWEN3)
    assert result.exit_code == 2
    assert "no CUDA device here" in result.output and "--gpu" in result.output


# A card with room for exactly 10 blocks after weights and activations (at utilization 1.0).
TEN_BLOCKS = str(WEIGHTS + ACTIVATION + 10 * BLOCK)


def test_largest_max_model_len_that_fits():
    args = ("--model", QWEN3, "--gpu-memory", TEN_BLOCKS, "--gpu-memory-utilization", "1.0")
    result, report = plan_json(*args, "--max-model-len", "4096")
    assert result.exit_code == 3
    assert report["num_blocks"] == 10 and report["num_tokens"] == 2560
    assert report["largest_max_model_len"] == 2560  # 10 blocks x 256 tokens
    assert report["max_num_seqs_at_max_model_len"] == 0
    assert "does not fit at max_model_len 4096" in report["verdict"]
    assert "Largest max_model_len that fits: 2560." in report["verdict"]
    # At tp=2 each rank holds half the weights and half the KV heads: 60 blocks of 14,680,064 bytes,
    # ((2,175,139,840 - 596,049,920 - 689,438,720) // 14,680,064), enough for 4096 tokens.
    assert report["smallest_tensor_parallel_size"] == 2
    assert "Smallest tensor_parallel_size that fits: 2." in report["verdict"]

    result, report = plan_json(*args, "--max-model-len", "2560")
    assert result.exit_code == 0 and report["max_num_seqs_at_max_model_len"] == 1
    result, report = plan_json(*args, "--max-model-len", "2561")  # needs an 11th block
    assert result.exit_code == 3


def test_model_that_needs_tensor_parallelism():
    # Llama-3-8B, bf16, on an 8 GB laptop card (7.2e9 usable): 16.06e9 bytes of weights do not fit on one
    # rank, 8.03e9 do not fit on two, and on four ranks 4.02e9 + 0.79e9 activations leave 285 blocks.
    result, report = plan_json("--model", LLAMA3_8B, "--gpu", "RTX 4070 Laptop")
    assert result.exit_code == 3
    assert report["weights_bytes"] == 16_060_522_496
    assert report["num_blocks"] == 0 and report["smallest_tensor_parallel_size"] == 4
    assert report["verdict"].startswith("does not fit: Not enough memory for the KV cache")
    result, report = plan_json("--model", LLAMA3_8B, "--gpu", "RTX 4070 Laptop", "--tp", "4")
    assert result.exit_code == 0 and report["num_blocks"] == 285


@pytest.fixture
def llama_70b_dir(tmp_path):
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
        "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_model_too_big_for_the_card_exits_3_with_a_verdict(llama_70b_dir):
    result = plan_memory("--model", llama_70b_dir, "--gpu", "RTX-4070-Laptop")
    assert result.exit_code == 3
    assert "verdict: does not fit: Not enough memory for the KV cache" in result.output
    assert "No tensor_parallel_size up to 8 fits on this card." in result.output
    result, report = plan_json("--model", llama_70b_dir, "--gpu", "RTX-4070-Laptop")
    assert result.exit_code == 3
    assert report["fits"] is False and report["smallest_tensor_parallel_size"] is None


def test_user_num_kvcache_blocks_is_respected_or_refused():
    result, report = plan_json("--model", QWEN3, "--gpu", "H200", "--num-kvcache-blocks", "100")
    assert result.exit_code == 0 and report["num_blocks"] == 100
    result, report = plan_json("--model", QWEN3, "--gpu", "H200", "--num-kvcache-blocks", "5000")
    assert result.exit_code == 3
    assert (
        "num_kvcache_blocks = 5000 needs" in report["verdict"] and "at most 4258 blocks" in report["verdict"]
    )


def test_kv_cache_dtype_sizes_the_blocks_and_fp8_halves_a_bfloat16_block():
    result, report = plan_json("--model", QWEN3, "--gpu", "H200", "--dtype", "bfloat16", "--kv-cache-dtype", "float32")
    assert result.exit_code == 0 and report["kv_cache_dtype"] == "float32" and report["block_bytes"] == 2 * BLOCK
    result, report = plan_json("--model", QWEN3, "--gpu", "H200", "--kv-cache-dtype", "fp8")
    assert result.exit_code == 0 and report["kv_cache_dtype"] == "fp8_e4m3" and report["block_bytes"] * 2 == BLOCK
    result = plan_memory("--model", QWEN3, "--gpu", "H200", "--kv-cache-dtype", "int8")
    assert result.exit_code == 2 and "must be one of auto, float32, bfloat16, float16, fp8" in result.output


def test_tensor_parallel_size_must_split_the_heads():
    result = plan_memory("--model", str(CONFIGS / "qwen2.5-7b"), "--gpu", "H200", "--tp", "8")
    assert result.exit_code == 2
    assert "tensor_parallel_size = 8: does not split this model's attention heads; use one of [1, 2, 4]" in (
        result.output
    )


def test_yaml_config_values_and_flag_precedence(tmp_path):
    (tmp_path / "engine.yaml").write_text(f"model: {QWEN3}\nmax_model_len: 2048\nmax_num_seqs: 8\n")
    result, report = plan_json("--config", str(tmp_path / "engine.yaml"), "--gpu", "H200")
    assert result.exit_code == 0
    assert report["max_model_len"] == 2048 and report["max_num_seqs"] == 8
    result, report = plan_json(
        "--config", str(tmp_path / "engine.yaml"), "--gpu", "H200", "--max-model-len", "1024"
    )
    assert report["max_model_len"] == 1024


def test_unknown_yaml_key_is_a_usage_error(tmp_path):
    (tmp_path / "engine.yaml").write_text(f"model: {QWEN3}\ngpu_memory_utilisation: 0.5\n")
    result = plan_memory("--config", str(tmp_path / "engine.yaml"), "--gpu", "H200")
    assert result.exit_code == 2
    assert "unknown key(s) gpu_memory_utilisation" in result.output


def test_max_model_len_is_clamped_to_the_model():
    result, report = plan_json("--model", LLAMA3_8B, "--gpu", "H200", "--max-model-len", "100000")
    assert result.exit_code == 0
    assert report["max_model_len"] == 8192
    assert "max_model_len clamped from 100000 to max_position_embeddings 8192" in report["notes"]


def test_weights_come_from_safetensors_headers_when_present(tmp_path):
    import struct

    (tmp_path / "config.json").write_text((CONFIGS / "qwen3-0.6b" / "config.json").read_text())
    # A header that promises 1,000 x 1,000 BF16 values with no data after it: only the header is read.
    header = json.dumps(
        {"w": {"dtype": "BF16", "shape": [1000, 1000], "data_offsets": [0, 2_000_000]}}
    ).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    result, report = plan_json("--model", str(tmp_path), "--gpu", "H200", "--dtype", "float32")
    assert result.exit_code == 0
    assert report["weights_bytes"] == 4_000_000 and report["weights_source"] == "safetensors headers"


def test_missing_model_folder_is_a_usage_error(tmp_path):
    result = plan_memory("--model", str(tmp_path / "nope"), "--gpu", "H200")
    assert result.exit_code == 2
    assert "model" in result.output


@pytest.mark.parametrize("family", ["gemma2", "olmo3"])
def test_kv_bytes_per_token_are_reported_per_kind_of_layer(tmp_path, family):
    """Sliding-window and global layers (Gemma 2, OLMo 3 alternate them) are listed apart, and their per-layer
    bytes add up to the plan's KV bytes per token."""
    from nanoinfer.testing.tiny_models import build_tiny_model

    folder = build_tiny_model(family, tmp_path / family, num_layers=4)
    _, report = plan_json("--model", str(folder), "--gpu", "H100", "--dtype", "bfloat16")
    groups = {g["attention"]: g for g in report["kv_layer_groups"]}
    assert "global" in groups and any(kind.startswith("sliding window") for kind in groups)
    assert sum(g["num_layers"] for g in groups.values()) == 4
    assert sum(g["num_layers"] * g["kv_bytes_per_token_per_layer"] for g in groups.values()) == report[
        "kv_bytes_per_token"
    ]
