"""The KV-cache planner (memory.py): every number checked against a hand computation written out here."""

import json
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from factories import spec_of

from nanoinfer import memory
from nanoinfer.errors import ModelLoadError, NanoInferError, OutOfMemoryError
from nanoinfer.memory import (
    GiB,
    KVCachePlan,
    check_fits,
    estimate_activation_bytes,
    estimate_weights_bytes,
    kv_block_bytes,
    parse_memory_size,
    plan_cpu_kv_cache,
    plan_kv_cache,
    weights_bytes_from_checkpoint,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"

# Qwen3-0.6B: 28 layers, hidden 1024, 16 heads, 8 KV heads, head_dim 128, intermediate 3072, vocab 151936.
QWEN3_06B = json.loads((CONFIGS / "qwen3-0.6b" / "config.json").read_text())

# KV block, bf16, 256 tokens: 2 (K and V) x 28 layers x 256 tokens x 8 KV heads x 128 x 2 bytes.
QWEN3_BLOCK_BYTES = 2 * 28 * 256 * 8 * 128 * 2
assert QWEN3_BLOCK_BYTES == 29_360_128

# Parameters, tied head: embedding 151936 x 1024 = 155,582,464; per layer q 1024x2048, k and v 1024x1024
# each, o 2048x1024 (6,291,456 together), MLP 3 x 1024 x 3072 = 9,437,184, two RMSNorms 2,048 and q/k
# norms 256: 15,730,944 per layer; final norm 1024.
QWEN3_LAYER_PARAMS = (1024 * 2048 + 2 * 1024 * 1024 + 2048 * 1024) + 3 * 1024 * 3072 + 2 * 1024 + 2 * 128
assert QWEN3_LAYER_PARAMS == 15_730_944
QWEN3_PARAMS = 151936 * 1024 + 28 * QWEN3_LAYER_PARAMS + 1024
assert QWEN3_PARAMS == 596_049_920  # Qwen's model card: 0.6B in all, 0.44B without embeddings
QWEN3_WEIGHTS_BF16 = QWEN3_PARAMS * 2  # 1,192,099,840

# Activation peak at T = 16384 tokens, S = 512 sequences, bf16:
#   resident hidden + residual 2 x 16384 x 1024 x 2 = 67,108,864
#   attention q,k,v,out 16384 x (2x16 + 2x8) x 128 x 2 = 201,326,592
#   mlp gate_up + act 16384 x 3 x 3072 x 2 = 301,989,888
#   sampling logits + probs 2 x 512 x 151936 x 4 = 622,329,856   (the largest)
QWEN3_ACTIVATION = 67_108_864 + 622_329_856

H200 = 141 * 10**9  # GPU_TABLE: the vendor's 141 GB read as decimal bytes


def qwen3_h200_plan(**overrides):
    """Qwen3-0.6B, bf16, on an H200 at the Config defaults; keywords override plan_kv_cache's inputs."""
    inputs = {
        "total_bytes": H200, "utilization": 0.9, "weights_bytes": QWEN3_WEIGHTS_BF16,
        "activation_bytes": QWEN3_ACTIVATION, "other_bytes": 0, "block_bytes": QWEN3_BLOCK_BYTES,
        "block_size": 256, "max_model_len": 4096,
    }  # fmt: skip
    return plan_kv_cache(**{**inputs, **overrides})


def test_kv_block_bytes_matches_hand_computation():
    assert kv_block_bytes(spec_of(QWEN3_06B), 256, 1, "bfloat16") == 29_360_128
    assert kv_block_bytes(spec_of(QWEN3_06B), 256, 1, torch.bfloat16) == 29_360_128
    assert kv_block_bytes(spec_of(QWEN3_06B), 256, 1, torch.float32) == 2 * 29_360_128
    assert kv_block_bytes(spec_of(QWEN3_06B), 512, 2, "bf16") == 29_360_128  # twice the tokens, half the heads


def test_more_ranks_than_kv_heads_is_refused_as_the_engine_refuses_it():
    cfg = dict(QWEN3_06B, num_key_value_heads=2)
    # 8 ranks, 2 KV heads: the engine shards KV heads and does not replicate them, so planning must not offer it.
    assert memory.valid_tensor_parallel_sizes(spec_of(cfg)) == [1, 2]
    with pytest.raises(NanoInferError, match=r"tensor_parallel_size 8 does not split"):
        kv_block_bytes(spec_of(cfg), 256, 8, "bf16")


def test_tensor_parallel_size_that_does_not_split_heads_is_refused():
    qwen25 = json.loads((CONFIGS / "qwen2.5-7b" / "config.json").read_text())  # 28 heads, 4 KV heads
    assert memory.valid_tensor_parallel_sizes(spec_of(qwen25)) == [1, 2, 4]
    with pytest.raises(
        NanoInferError, match=r"tensor_parallel_size 8 does not split.*Use one of \[1, 2, 4\]"
    ):
        kv_block_bytes(spec_of(qwen25), 256, 8, "bf16")


def test_head_dim_falls_back_to_hidden_over_heads():
    llama = json.loads((CONFIGS / "llama-3-8b" / "config.json").read_text())  # no head_dim key
    assert {layer.head_dim for layer in spec_of(llama).layers} == {4096 // 32}
    assert kv_block_bytes(spec_of(llama), 256, 1, "bf16") == 2 * 32 * 256 * 8 * 128 * 2


def test_weights_estimate_from_config_only_folder():
    assert estimate_weights_bytes(spec_of(QWEN3_06B), "bfloat16") == QWEN3_WEIGHTS_BF16
    # The shipped folder has no safetensors, so the checkpoint reader falls back to the same estimate.
    assert weights_bytes_from_checkpoint(CONFIGS / "qwen3-0.6b", "bfloat16", spec_of(QWEN3_06B)) == QWEN3_WEIGHTS_BF16
    assert weights_bytes_from_checkpoint(CONFIGS / "qwen3-0.6b", torch.float32, spec_of(QWEN3_06B)) == QWEN3_PARAMS * 4


def test_weights_estimate_counts_untied_head_and_qwen2_biases():
    llama = json.loads((CONFIGS / "llama-3-8b" / "config.json").read_text())
    layer = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    assert estimate_weights_bytes(spec_of(llama), "bf16") == 2 * (2 * 128256 * 4096 + 32 * layer + 4096)  # 8.03B
    qwen25 = json.loads((CONFIGS / "qwen2.5-7b" / "config.json").read_text())
    layer = 3584 * (3584 + 2 * 512) + (3584 + 2 * 512) + 3584 * 3584 + 3 * 3584 * 18944 + 2 * 3584
    assert estimate_weights_bytes(spec_of(qwen25), "bf16") == 2 * (2 * 152064 * 3584 + 28 * layer + 3584)  # 7.62B


def write_header_only_safetensors(path: Path, tensors: dict[str, list[int]]) -> None:
    """A safetensors header with no tensor data after it: the reader must never need the data."""
    header = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors.items():
        size = 2 * int(torch.Size(shape).numel())
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def test_weights_from_safetensors_headers_only(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_06B, "tie_word_embeddings": False}))
    write_header_only_safetensors(
        tmp_path / "model-00001-of-00002.safetensors", {"embed.weight": [151936, 1024]}
    )
    write_header_only_safetensors(
        tmp_path / "model-00002-of-00002.safetensors",
        {"lm_head.weight": [151936, 1024], "norm.weight": [1024]},
    )
    # Stored as BF16, counted in the target dtype.
    untied = spec_of({**QWEN3_06B, "tie_word_embeddings": False})
    assert weights_bytes_from_checkpoint(tmp_path, "float32", untied) == (2 * 151936 * 1024 + 1024) * 4
    # A tied head shares the embedding: a stored lm_head.weight is not counted twice.
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_06B))
    assert weights_bytes_from_checkpoint(tmp_path, "bfloat16", spec_of(QWEN3_06B)) == (151936 * 1024 + 1024) * 2


def test_real_safetensors_file_is_read(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_06B))
    save_file(
        {"a": torch.zeros(3, 5), "b": torch.zeros(7, dtype=torch.bfloat16)}, tmp_path / "model.safetensors"
    )
    assert weights_bytes_from_checkpoint(tmp_path, "bfloat16", spec_of(QWEN3_06B)) == (15 + 7) * 2


def test_corrupt_safetensors_is_a_model_load_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_06B))
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(ModelLoadError, match="not a readable safetensors file"):
        weights_bytes_from_checkpoint(tmp_path, "bfloat16", spec_of(QWEN3_06B))


def test_activation_estimate_matches_hand_computation():
    assert estimate_activation_bytes(spec_of(QWEN3_06B), 16384, 512, "bfloat16", 1) == QWEN3_ACTIVATION == 689_438_720
    # Few sequences: the MLP temporaries dominate (16384 x 3 x 3072 x 2).
    assert estimate_activation_bytes(spec_of(QWEN3_06B), 16384, 1, "bfloat16", 1) == 67_108_864 + 301_989_888
    # tp=2 halves the per-rank heads and MLP; hidden states and logits stay whole.
    assert estimate_activation_bytes(spec_of(QWEN3_06B), 16384, 1, "bfloat16", 2) == 67_108_864 + 301_989_888 // 2


def test_activation_estimate_counts_the_rows_speculation_samples():
    """With n-gram speculation a sequence samples 1 + num_speculative_tokens rows of logits (float32 logits and
    probabilities, 2 x rows x 151,936 x 4 bytes), never more rows than the step's tokens."""
    vocab_row = 2 * QWEN3_06B["vocab_size"] * 4
    resident = 67_108_864
    assert estimate_activation_bytes(spec_of(QWEN3_06B), 16384, 512, "bfloat16", 1, 3) == resident + 2048 * vocab_row
    assert estimate_activation_bytes(spec_of(QWEN3_06B), 1024, 512, "bfloat16", 1, 3) == (
        estimate_activation_bytes(spec_of(QWEN3_06B), 1024, 1024, "bfloat16", 1)  # capped at the step's 1,024 tokens
    )


def test_qwen3_on_h200_plan_matches_hand_computation():
    plan = qwen3_h200_plan()
    # 141e9 x 0.9 = 126,900,000,000 usable; minus weights and activations leaves the KV budget.
    budget = 126_900_000_000 - 1_192_099_840 - 689_438_720
    assert plan.budget_bytes == budget == 125_018_461_440
    assert plan.num_blocks == budget // 29_360_128 == 4258
    assert plan.num_tokens == 4258 * 256 == 1_090_048
    assert plan.kv_bytes == 4258 * 29_360_128
    assert plan.max_concurrency() == pytest.approx(4258 / 16)  # 16 blocks per 4096-token sequence
    assert plan.max_num_seqs_that_fit() == 266
    assert plan.fits_one_sequence
    assert plan.max_model_len_that_fits(40960) == 40960  # capped at max_position_embeddings
    assert plan.max_model_len_that_fits() == 1_090_048


def test_memory_used_by_others_comes_out_of_the_budget():
    plan = qwen3_h200_plan(other_bytes=10 * 29_360_128)
    assert plan.num_blocks == 4258 - 10


def test_no_budget_says_what_to_change():
    with pytest.raises(OutOfMemoryError) as e:
        qwen3_h200_plan(total_bytes=8 * 10**9, weights_bytes=16 * 10**9)
    message = str(e.value)
    assert "Not enough memory for the KV cache" in message
    assert "minus weights 14.9 GiB" in message
    assert "gpu_memory_utilization" in message and "tensor_parallel_size" in message


def test_budget_smaller_than_one_block_is_refused():
    usable = QWEN3_WEIGHTS_BF16 + QWEN3_ACTIVATION + QWEN3_BLOCK_BYTES - 1
    with pytest.raises(OutOfMemoryError, match="No room for a single KV block"):
        qwen3_h200_plan(total_bytes=usable, utilization=1.0)


def test_user_num_kvcache_blocks_is_respected():
    plan = qwen3_h200_plan(num_kvcache_blocks=100)
    assert plan.num_blocks == 100
    assert plan.budget_bytes == 125_018_461_440  # the budget is still reported


def test_user_num_kvcache_blocks_over_budget_is_refused():
    with pytest.raises(OutOfMemoryError, match=r"num_kvcache_blocks = 5000 needs .* at most 4258 blocks"):
        qwen3_h200_plan(num_kvcache_blocks=5000)
    assert qwen3_h200_plan(num_kvcache_blocks=4258).num_blocks == 4258  # exactly the budget is fine


def small_plan(num_blocks=10, max_model_len=4096):
    return KVCachePlan(
        num_blocks=num_blocks, block_bytes=QWEN3_BLOCK_BYTES, block_size=256, budget_bytes=0,
        weights_bytes=0, activation_bytes=0, other_bytes=0, total_bytes=0, max_model_len=max_model_len,
    )  # fmt: skip


def test_largest_max_model_len_that_fits():
    plan = small_plan(num_blocks=10)
    assert plan.max_model_len_that_fits() == 2560
    assert plan.max_model_len_that_fits(model_max_len=2048) == 2048
    # ceil(2560 / 256) = 10 blocks fits; 2561 tokens would need an 11th block.
    assert plan.blocks_per_sequence(2560) == 10 and plan.blocks_per_sequence(2561) == 11
    assert not plan.fits_one_sequence  # 4096 tokens need 16 blocks
    assert small_plan(num_blocks=16).fits_one_sequence


def test_concurrency_counts_whole_blocks_per_sequence():
    plan = small_plan(num_blocks=10, max_model_len=1000)  # 1000 tokens take 4 blocks
    assert plan.max_concurrency() == 2.5
    assert plan.max_num_seqs_that_fit() == 2
    assert plan.max_num_seqs_that_fit(256) == 10


def test_summary_line():
    plan = small_plan(num_blocks=123, max_model_len=4096)
    # 123 x 29,360,128 bytes = 3,611,295,744 = 3.36 GiB; 123 blocks / 16 per sequence = 7.69.
    assert plan.summary_line() == (
        "KV cache: 123 blocks x 256 tokens = 31,488 tokens, max concurrency 7.7 at max_model_len 4096, 3.4 GiB"
    )


def test_check_fits_uses_vllm_wording_and_names_the_estimate():
    check_fits(small_plan(num_blocks=16), 4096)  # exactly one sequence: no error
    with pytest.raises(OutOfMemoryError) as e:
        check_fits(small_plan(num_blocks=10), 4096)
    assert str(e.value).startswith(
        "The model's max seq len (4096) is larger than the maximum number of tokens that can be stored in "
        "KV cache (2560). Try increasing `gpu_memory_utilization` (or `cpu_kvcache_space_gib` on CPU) or "
        "decreasing `max_model_len`"
    )
    assert "the estimated maximum model length is 2560." in str(e.value)


def cpu_config(cpu_kvcache_space_gib=1.0, num_kvcache_blocks=-1):
    return SimpleNamespace(
        cpu_kvcache_space_gib=cpu_kvcache_space_gib, num_kvcache_blocks=num_kvcache_blocks,
        kvcache_block_size=256, max_model_len=4096,
    )  # fmt: skip


def test_cpu_plan_divides_the_configured_space(monkeypatch):
    monkeypatch.setattr(memory, "available_ram_bytes", lambda: 16 * GiB)
    plan = plan_cpu_kv_cache(cpu_config(), block_bytes=1 << 20)
    assert plan.num_blocks == 1024 and plan.budget_bytes == GiB and plan.max_model_len == 4096
    assert plan_cpu_kv_cache(cpu_config(num_kvcache_blocks=10), block_bytes=1 << 20).num_blocks == 10


def test_cpu_plan_refuses_user_blocks_over_the_space(monkeypatch):
    monkeypatch.setattr(memory, "available_ram_bytes", lambda: 16 * GiB)
    with pytest.raises(OutOfMemoryError, match=r"num_kvcache_blocks = 2000 .* allows 1024 blocks"):
        plan_cpu_kv_cache(cpu_config(num_kvcache_blocks=2000), block_bytes=1 << 20)


def test_cpu_plan_refuses_more_than_90_percent_of_available_ram(monkeypatch):
    monkeypatch.setattr(memory, "available_ram_bytes", lambda: 4 * GiB)
    with pytest.raises(OutOfMemoryError) as e:
        plan_cpu_kv_cache(cpu_config(cpu_kvcache_space_gib=4.0), block_bytes=1 << 20)
    assert "asks for 4.0 GiB of KV cache but only 4.0 GiB of RAM is available" in str(e.value)
    assert "Lower cpu_kvcache_space_gib to 3.6 or less" in str(e.value)


def test_cpu_plan_space_smaller_than_one_block(monkeypatch):
    monkeypatch.setattr(memory, "available_ram_bytes", lambda: 16 * GiB)
    with pytest.raises(OutOfMemoryError, match="smaller than one KV block"):
        plan_cpu_kv_cache(cpu_config(cpu_kvcache_space_gib=0.01), block_bytes=QWEN3_BLOCK_BYTES)


def test_available_ram_is_read_on_this_machine():
    available = memory.available_ram_bytes()
    assert available is None or available > 0


@pytest.mark.parametrize(
    "text, expected",
    [
        ("80GiB", 80 * 2**30),
        ("80gib", 80 * 2**30),
        ("80 G", 80 * 2**30),
        ("80Gi", 80 * 2**30),
        ("80GB", 80 * 10**9),
        ("141e9", 141 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5 TiB", 3 * 2**39),
        ("143771MiB", 143771 * 2**20),
        ("1024", 1024),
    ],
)
def test_parse_memory_size(text, expected):
    assert parse_memory_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "80XB", "eighty GB", "-5GB", "0", "80 GiB GiB"])
def test_parse_memory_size_errors_say_how_to_write_it(text):
    with pytest.raises(NanoInferError, match="memory size"):
        parse_memory_size(text)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("H200", ("H200", 141 * 10**9)),
        ("nvidia h200", ("H200", 141 * 10**9)),
        ("RTX 4070 Laptop", ("RTX-4070-Laptop", 8 * 10**9)),
        ("GeForce RTX 4090", ("RTX-4090", 24 * 10**9)),
        ("a100_80gb", ("A100-80GB", 80 * 10**9)),
    ],
)
def test_gpu_lookup_ignores_case_spaces_and_vendor_prefix(name, expected):
    assert memory.lookup_gpu(name) == expected


def test_unknown_gpu_suggests_close_names():
    with pytest.raises(NanoInferError) as e:
        memory.gpu_memory_bytes("A100")
    assert "unknown GPU 'A100'. Did you mean" in str(e.value)
    assert "A100-80GB" in str(e.value) and "--gpu-memory" in str(e.value)


def test_dtype_bytes():
    assert memory.dtype_bytes(torch.float16) == 2
    assert memory.dtype_bytes("torch.float32") == 4
    with pytest.raises(NanoInferError, match="unknown dtype 'int4'"):
        memory.dtype_bytes("int4")


def test_state_slots_take_at_most_half_the_budget_on_either_device_and_never_exceed_max_num_seqs():
    """plan_kv_cache (CUDA, plan-memory) and plan_cpu_kv_cache split one budget alike: slots first, up to
    max_num_seqs within STATE_SHARE of it (or what a user's num_kvcache_blocks leaves), blocks from the rest."""
    block, slot, budget = 1000, 300, 10_000
    cpu = memory.plan_cpu_kv_cache(SimpleNamespace(
        cpu_kvcache_space_gib=budget / memory.GiB, kvcache_block_size=16, num_kvcache_blocks=-1, max_num_seqs=64,
        max_model_len=16), block, slot)  # fmt: skip
    gpu = memory.plan_kv_cache(total_bytes=budget, utilization=1.0, weights_bytes=0, activation_bytes=0, other_bytes=0,
                               block_bytes=block, block_size=16, max_model_len=16, state_slot_bytes=slot,
                               max_num_seqs=64)  # fmt: skip
    for plan in (cpu, gpu):
        assert (plan.num_state_slots, plan.num_blocks) == (16, 5)  # 5,000 // 300 slots, then 5,200 // 1,000 blocks
        assert plan.max_concurrency() == 5  # a 16-token sequence takes one block
    assert memory.plan_state_slots(budget, slot, max_num_seqs=4, block_bytes=block) == 4
    assert memory.plan_state_slots(budget, slot, max_num_seqs=64, block_bytes=block, num_kvcache_blocks=9) == 3
    assert memory.plan_state_slots(budget, 0, max_num_seqs=64, block_bytes=block) == 0
    with pytest.raises(OutOfMemoryError, match="No room for one sequence's linear-attention state"):
        memory.plan_state_slots(budget, slot, max_num_seqs=64, block_bytes=block, num_kvcache_blocks=10)
