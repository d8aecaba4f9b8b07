"""The roofline (roofline.py): a step's bytes and FLOPs against a hand calculation written out here, the engine's
per-step counts they come from, the step classes, the ceilings (GPU table, flags, the CPU probe) and the sums."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from factories import make_request, spec_of

from nanoinfer import memory, roofline
from nanoinfer.engine.engine import StepStats, _count_step
from nanoinfer.errors import NanoInferError

# A small Qwen3 shape: hidden 64, 4 heads and 2 KV heads of 16, MLP 128, 2 layers, vocab 300, head not tied.
TINY = {"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 300, "tie_word_embeddings": False}  # fmt: skip
# Per layer: q 64x64, k and v 64x32 each, o 64x64 = 12,288; MLP 3 x 64 x 128 = 24,576: 36,864 matmul weights,
# plus two RMSNorms (128) and q/k norms (32): 37,024 parameters.
TINY_LAYER_MATMUL = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128
assert TINY_LAYER_MATMUL == 36_864
# Read once a step: 2 layers, the final norm (64) and the LM head 300 x 64 = 19,200 (not the embedding):
# 93,312 parameters, 2 bytes each in bfloat16.
TINY_WEIGHTS_BF16 = (2 * (TINY_LAYER_MATMUL + 128 + 32) + 64 + 300 * 64) * 2
assert TINY_WEIGHTS_BF16 == 186_624
# K and V, 2 layers, 2 KV heads of 16, 2 bytes: 256 bytes a token.
TINY_KV_PER_TOKEN = 2 * 2 * 2 * 16 * 2

QWEN3_06B = json.loads((Path(__file__).resolve().parents[2] / "configs/models/qwen3-0.6b/config.json").read_text())


def test_a_step_costs_what_the_hand_calculation_says():
    """One mixed step of three sequences:
      A  a fresh 5-token prompt, all of it (positions 0..4), sampled: its last token reaches the end
      B  a 10-token prompt with 3 tokens computed, a chunk of 4 (positions 3..6), not sampled
      C  a decode token at position 9 (6 prompt + 4 output tokens), sampled
    Tokens 5 + 4 + 1 = 10 (prefill 9, decode 1). Context read: 5 + 7 + 10 = 22 tokens. Causal (query, key)
    pairs, position + 1 summed over each new token: A 1+2+3+4+5 = 15, B 4+5+6+7 = 22, C 10: 47. Rows: 2.
    Sequences continuing from tokens computed before (a hybrid model reads their state): B and C, 2."""
    a = make_request(num_prompt_tokens=5).sequences[0]
    b = make_request(num_prompt_tokens=10).sequences[0]
    b.num_computed_tokens = 3
    c = make_request(num_prompt_tokens=6).sequences[0]
    c.token_ids += [7, 8, 9, 10]
    c.num_computed_tokens = 9
    num_prefill, counts = _count_step([(a, 5), (b, 4), (c, 1)])
    assert (num_prefill, counts) == (9, (3, 22, 47, 2, 2))
    stats = StepStats(num_prefill, 1, 0, 0.002, 0, 0, *counts)

    shape = roofline.ModelShape.from_spec(spec_of(TINY), "bfloat16", "bfloat16")
    assert (shape.weights_bytes, shape.kv_bytes_per_token, shape.matmul_params) == (
        TINY_WEIGHTS_BF16, TINY_KV_PER_TOKEN, 2 * TINY_LAYER_MATMUL)
    cost = roofline.stats_cost(shape, stats)
    assert cost.weights_bytes == 186_624
    assert cost.kv_read_bytes == 22 * 256 == 5_632
    assert cost.kv_write_bytes == 10 * 256 == 2_560
    assert cost.logits_bytes == 2 * 300 * 2 == 1_200  # two rows of 300 bfloat16 logits
    assert cost.total_bytes == 196_016
    # FLOPs: 2 per matmul weight per token, 2 x 73,728 x 10 = 1,474,560; the LM head 2 x 300 x 64 x 2 rows =
    # 76,800; attention 4 x head_dim 16 x 4 heads x 2 layers x 47 pairs = 24,064.
    assert cost.flops == 1_474_560 + 76_800 + 24_064 == 1_575_424

    # At 1 GB/s and 1 GFLOP/s the step is compute-bound: its floor is 1.575 ms of its 2 ms.
    ceilings = roofline.Ceilings("test", 1e9, 1e9, "flag", "flag")
    assert ceilings.floor_seconds(cost) == pytest.approx((196_016e-9, 1_575_424e-9))
    floor = roofline.Roofline(shape, ceilings)
    floor.add(stats)
    [(name, totals)] = floor.ordered_classes()
    assert name == "prefill" and totals.bound == "compute"
    assert totals.floor_seconds == pytest.approx(1.575424e-3) and totals.of_floor == pytest.approx(1.575424 / 2)


def test_a_speculated_sequence_samples_every_row_it_verifies():
    """A decode token plus 3 proposed ones at positions 20..23: 4 rows, each its own context (pairs 21..24)."""
    seq = make_request(num_prompt_tokens=21).sequences[0]
    seq.num_computed_tokens = 20
    seq.spec_token_ids = [5, 6, 7]
    assert _count_step([(seq, 4)]) == (0, (1, 24, 21 + 22 + 23 + 24, 4, 1))


def test_qwen3_06b_matches_the_issue_estimate():
    """The bench's CUDA model: ~1.2 GB of bfloat16 weights a step (596,049,920 parameters, the tied head read
    as the LM head: tests/unit/test_memory.py's hand count), 114,688 KV bytes a token (57,344 in fp8), and a
    full decode step of 256 sequences at ~850 tokens of context reads ~25 GB of KV: about 5.5 ms at 4.8 TB/s."""
    shape = roofline.ModelShape.from_spec(spec_of(QWEN3_06B), "bfloat16", "bfloat16")
    assert shape.weights_bytes == 596_049_920 * 2 == 1_192_099_840
    assert shape.kv_bytes_per_token == 2 * 28 * 8 * 128 * 2 == 114_688
    assert roofline.ModelShape.from_spec(spec_of(QWEN3_06B), "bfloat16", "fp8_e4m3").kv_bytes_per_token == 57_344
    step = roofline.step_cost(shape, num_tokens=256, num_context_tokens=256 * 850, num_attention_pairs=256 * 850,
                              num_logits_rows=256)  # fmt: skip
    assert step.kv_read_bytes == 256 * 850 * 114_688 == 24_956_108_800
    h200 = roofline.Ceilings("H200", 4800e9, 989e12, "table", "table")
    memory_s, compute_s = h200.floor_seconds(step)
    assert 5.4e-3 < memory_s < 5.5e-3 and compute_s < memory_s / 10  # decode is bound by the bytes


def test_tensor_parallel_ranks_together_hold_the_kv_bytes_of_one():
    shape = roofline.ModelShape.from_spec(spec_of(QWEN3_06B), "bfloat16", "bfloat16", 2)
    assert shape.kv_bytes_per_token == 114_688  # 2 ranks of 4 KV heads: the bytes of one rank of 8


@pytest.mark.parametrize(("num_seqs", "name"), [(1, "decode 1"), (2, "decode 2"), (3, "decode 3-4"), (4, "decode 3-4"),
                                                (5, "decode 5-8"), (200, "decode 129-256"), (256, "decode 129-256")])
def test_decode_steps_are_classed_by_batch_size_in_powers_of_two(num_seqs, name):
    assert roofline.step_class(SimpleNamespace(num_prefill_tokens=0, num_seqs=num_seqs)) == name
    assert roofline.step_class(SimpleNamespace(num_prefill_tokens=3, num_seqs=num_seqs)) == "prefill"


def test_each_steps_floor_is_the_longer_of_its_two_and_classes_add_up():
    """A memory-bound decode step and a compute-bound prefill: the total floor is the sum of each step's own
    max, not the max of the sums."""
    shape = roofline.ModelShape.from_spec(spec_of(TINY), "bfloat16", "bfloat16")
    ceilings = roofline.Ceilings("test", 1e9, 1e10, "flag", "flag")  # 1 GB/s, 10 GFLOP/s
    floor = roofline.Roofline(shape, ceilings)
    steps = [StepStats(40, 0, 0, 0.01, 0, 0, 1, 40, 820, 1), StepStats(0, 3, 0, 0.001, 0, 0, 3, 30, 30, 3),
             StepStats(0, 3, 0, 0.001, 0, 0, 3, 33, 33, 3)]  # fmt: skip
    for stats in steps:
        floor.add(stats)
    parts = [ceilings.floor_seconds(roofline.stats_cost(shape, s)) for s in steps]
    assert [p[0] > p[1] for p in parts] == [False, True, True]
    assert floor.all_steps.floor_seconds == pytest.approx(sum(max(p) for p in parts))
    assert [name for name, _ in floor.ordered_classes()] == ["prefill", "decode 3-4"]
    assert floor.classes["decode 3-4"].steps == 2 and floor.classes["decode 3-4"].bound == "memory"
    report = floor.to_dict(wall_seconds=0.02)
    assert report["run"]["of_floor"] == pytest.approx(floor.all_steps.floor_seconds / 0.02)
    assert report["classes"]["prefill"]["tokens"] == 40 and report["all_steps"]["steps"] == 3


# --- ceilings --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("device_name", "total", "expected"),
    [("NVIDIA H200", 143_771 * 2**20, "H200"), ("NVIDIA H100 80GB HBM3", 85 * 10**9, "H100"),
     ("NVIDIA H100 PCIe", 85 * 10**9, "H100-PCIe"), ("NVIDIA A100-SXM4-40GB", 42 * 10**9, "A100-40GB"),
     ("NVIDIA A100 80GB PCIe", 85 * 10**9, "A100-80GB"), ("NVIDIA GeForce RTX 4090", 25 * 10**9, "RTX-4090"),
     ("NVIDIA L4", 24 * 10**9, "L4"), ("NVIDIA L40S", 48 * 10**9, "L40S"), ("NVIDIA GH200 480GB", None, None)],
)  # fmt: skip
def test_a_cuda_device_name_finds_its_row_of_the_gpu_table(device_name, total, expected):
    match = memory.gpu_spec_for_device(device_name, total)
    assert (match[0] if match else None) == expected


def test_the_gpu_table_gives_the_ceilings_of_the_cards_the_issue_names():
    for name in ("H100", "H200", "A100-80GB", "L4", "RTX-4090"):
        spec = memory.GPU_TABLE[name]
        assert spec.bandwidth_gbs > 0 and spec.bf16_tflops > 0 and spec.fp32_tflops > 0, name
    assert (memory.GPU_TABLE["H200"].bandwidth_gbs, memory.GPU_TABLE["H200"].bf16_tflops) == (4800, 989)


def fake_cuda(monkeypatch, name: str, total: int):
    props = SimpleNamespace(name=name, total_memory=total)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=0: props)
    monkeypatch.setattr(roofline, "probe", lambda device, dtype: pytest.fail("probed a card in the table"))


def test_cuda_ceilings_come_from_the_table_times_the_cards_and_flags_win(monkeypatch):
    fake_cuda(monkeypatch, "NVIDIA H200", 143_771 * 2**20)
    ceilings = roofline.device_ceilings("cuda", "bfloat16")
    assert (ceilings.device, ceilings.bandwidth, ceilings.flops) == ("NVIDIA H200", 4800e9, 989e12)
    assert ceilings.bandwidth_source == "H200 datasheet"
    assert roofline.device_ceilings("cuda", "float32").flops == 67e12  # float32 models: no tensor cores
    two = roofline.device_ceilings("cuda", "bfloat16", tensor_parallel_size=2)
    assert (two.bandwidth, two.flops, two.flops_source) == (9600e9, 1978e12, "H200 datasheet x 2 cards")
    flagged = roofline.device_ceilings("cuda", "bfloat16", bandwidth_gbs=4000, tflops=700)
    assert (flagged.bandwidth, flagged.flops) == (4000e9, 700e12)
    assert (flagged.bandwidth_source, flagged.flops_source) == ("--peak-bandwidth-gbs", "--peak-tflops")


def test_a_card_outside_the_table_is_probed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=0: SimpleNamespace(name="Some GPU",
                                                                                              total_memory=10**9))
    monkeypatch.setattr(roofline, "probe", lambda device, dtype: (1e12, 5e13))
    ceilings = roofline.device_ceilings("cuda", "bfloat16", tflops=100)
    assert (ceilings.bandwidth, ceilings.bandwidth_source) == (1e12, "measured (probe)")
    assert (ceilings.flops, ceilings.flops_source) == (100e12, "--peak-tflops")


@pytest.mark.parametrize("value", [0.0, -1.0, math.inf, math.nan])
def test_a_ceiling_flag_must_be_a_positive_number(value):
    with pytest.raises(NanoInferError, match="--peak-tflops must be a positive number"):
        roofline.device_ceilings("cpu", "float32", bandwidth_gbs=10, tflops=value)


def test_the_cpu_probe_measures_both_ceilings():
    # Sanity only: a shared machine's numbers are whatever they are; never a threshold on speed here.
    ceilings = roofline.device_ceilings("cpu", "float32")
    assert ceilings.bandwidth_source == ceilings.flops_source == "measured (probe)"
    assert math.isfinite(ceilings.bandwidth) and ceilings.bandwidth > 0
    assert math.isfinite(ceilings.flops) and ceilings.flops > 0


# --- weights as a model holds them ---------------------------------------------------------------------


def test_weights_read_are_the_models_parameters_in_their_smallest_stored_form():
    import transformers

    from nanoinfer.attention.torch_backend import TorchBackend
    from nanoinfer.models import registry
    from nanoinfer.platforms.cpu.linear import PackedWeight

    hf_config = transformers.Qwen3Config(**{k: v for k, v in TINY.items() if k != "model_type"})
    model = registry.build_model(hf_config, TorchBackend(), max_position=64).to(torch.bfloat16)
    assert roofline.weights_read_bytes(model) == TINY_WEIGHTS_BF16  # the embedding table is looked up, not read
    # A weight packed with an exact 4-bit form (a GGUF Q4_1 model's, on CPU) is read in that form.
    down = model.model.layers[0].mlp.down_proj
    down.packed_weight = PackedWeight("panels", torch.empty(128 * 64, dtype=torch.bfloat16), 64,
                                      compact=torch.empty(128 * 64 // 2 + 256, dtype=torch.uint8))  # fmt: skip
    assert roofline.weights_read_bytes(model) == TINY_WEIGHTS_BF16 - 128 * 64 * 2 + 128 * 64 // 2 + 256


def test_the_workload_floor_tool_steps_the_real_scheduler_without_a_gpu():
    """benchmarks/tools/roofline_floor.py (its figures for the CUDA bench are in benchmarks/README.md) on a
    small workload: it runs, every request finishes, and the floor is set against the H200's table row."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, str(root / "benchmarks/tools/roofline_floor.py"), "--num-requests", "6",
                             "--input-len", "10", "300", "--output-len", "5", "40"], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": str(root / "src")})  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "H200: 4,800 GB/s, 989 TFLOP/s" in result.stdout and "0 preemptions" in result.stdout
    assert result.stdout.splitlines()[2].startswith("prefill") and "floor of the run:" in result.stdout


def test_a_hybrid_step_reads_the_state_of_continuing_sequences_and_writes_every_one():
    """Qwen3.5-0.8B's shape: a step of 3 sequences, 2 continuing: the state (18 layers x (16 x 128 x 128 float32 +
    6,144 conv channels x 3 bfloat16 inputs) = 19,537,920 bytes a sequence) read twice and written three times;
    the delta rule's 6 x 16 x 128 x 128 FLOPs a token a layer."""
    from nanoinfer.models.config import load_hf_config
    from nanoinfer.models.registry import model_spec

    spec = model_spec(load_hf_config(Path(__file__).resolve().parents[2] / "configs/models/qwen3.5-0.8b"))
    shape = roofline.ModelShape.from_spec(spec, "bfloat16", "bfloat16")
    per_sequence = 18 * (16 * 128 * 128 * 4 + 6_144 * 3 * 2)
    assert shape.state_bytes_per_sequence == per_sequence == 19_537_920
    plain = roofline.step_cost(shape, 10, 22, 47, 2)
    hybrid = roofline.step_cost(shape, 10, 22, 47, 2, num_seqs=3, num_seqs_with_context=2)
    assert (hybrid.state_read_bytes, hybrid.state_write_bytes) == (2 * per_sequence, 3 * per_sequence)
    assert hybrid.total_bytes == plain.total_bytes + 5 * per_sequence
    assert shape.delta_rule_flops_per_token == 18 * 6 * 16 * 128 * 128
