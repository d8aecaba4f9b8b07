"""The Triton fused-MoE path (kernels/fused_moe.py) against the plain-torch expert method (Platform.fused_moe),
under the interpreter on CPU (see conftest.py): the align step exactly, then whole layers for each activation,
with and without biases, for decode- and prefill-sized batches over widths that are not multiples of a tile.

Under the interpreter Triton truncates float32 -> bfloat16 where compiled code rounds to nearest even (float16
converts correctly), so bfloat16's tolerance there allows a whole bfloat16 step per rounding instead of half.
"""

import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: pip install -e '.[dev]'")

from nanoinfer.models.layers.moe import FusedMoE, select_experts
from nanoinfer.platforms import Platform, plain_platform
from nanoinfer.platforms.cuda.kernels import fused_moe as moe_kernels
from nanoinfer.platforms.cuda.kernels.fused_moe import (
    DECODE_CONFIG,
    PREFILL_CONFIG,
    fused_moe,
    fused_moe_layer,
    moe_align,
)

HIDDEN, INTERMEDIATE = 100, 72  # neither a multiple of the 64-wide tiles: masked tails in N and K of both GEMMs
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def make_experts(num_experts: int, activation: str, bias: bool, dtype: torch.dtype, seed: int = 0) -> FusedMoE:
    """Random experts scaled so activations are O(1); swigluoai's limit is 1 so both of its clamps engage."""
    with plain_platform():
        layer = FusedMoE(num_experts, HIDDEN, INTERMEDIATE, activation=activation, bias=bias, swiglu_limit=1.0)
    gen = torch.Generator().manual_seed(seed)
    layer.w13_weight.data = torch.randn(layer.w13_weight.shape, generator=gen) * HIDDEN**-0.5
    layer.w2_weight.data = torch.randn(layer.w2_weight.shape, generator=gen) * INTERMEDIATE**-0.5
    if bias:
        layer.w13_bias.data = torch.randn(layer.w13_bias.shape, generator=gen) * 0.5
        layer.w2_bias.data = torch.randn(layer.w2_bias.shape, generator=gen) * 0.5
    return layer.to(dtype).requires_grad_(False)


def make_batch(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype, seed: int = 0):
    """x [T, H] and its routing: expert 0 favoured (so it fills several 16-row blocks), the last expert never
    chosen (an expert without tokens, whatever T)."""
    gen = torch.Generator().manual_seed(seed + 1)
    x = (torch.randn(num_tokens, HIDDEN, generator=gen) * 2).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    logits[:, 0] += 1.5
    logits[:, -1] = -torch.inf
    topk_weights, topk_ids = select_experts(logits, top_k)
    return x, topk_weights, topk_ids


def assert_close_to_reference(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    dtype = got.dtype
    error = (got.float() - expected.float()).abs()
    scale = float(expected.float().abs().max())
    if dtype == torch.float32:  # tl.dot in ieee precision: the same products, summed in another order
        assert float(error.max()) <= 1e-5 * scale, float(error.max())
        return
    # Each side rounds about eight times on the way (gate/up, activation, h, y, routing weight, y * weight, the
    # sum over k), each off by at most u of the largest magnitude: half a step, a whole one when truncated.
    step = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    u = step if INTERPRETED and dtype == torch.bfloat16 else step / 2
    assert float(error.max()) <= 8 * u * scale, (float(error.max()), scale)
    assert float(error.mean()) <= 2 * u * scale, (float(error.mean()), scale)  # no drift across the output


def run_both(layer: FusedMoE, x, topk_weights, topk_ids, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kernel's output, back on CPU; the reference's, on CPU)."""
    layer.to(device)  # in place
    got = fused_moe_layer(layer, x.to(device), topk_weights.to(device), topk_ids.to(device)).cpu()
    return got, Platform().fused_moe(layer.cpu(), x, topk_weights, topk_ids)


# --- align ------------------------------------------------------------------------------------------


def test_align_groups_pairs_by_expert_in_token_order_and_pads_each_run_to_the_block(device):
    # 6 tokens, k = 2, 5 experts, blocks of 4: expert 0 has 5 pairs (two blocks), expert 1 has 3, expert 2 none,
    # expert 3 has 4 (one full block), expert 4 none.
    topk_ids = torch.tensor([[0, 3], [1, 0], [3, 0], [0, 1], [3, 0], [1, 3]], device=device)
    sorted_pairs, block_expert = moe_align(topk_ids, num_experts=5, block_m=4)
    pad = 12  # T * k marks padding
    # pair index = token * k + slot; within one expert, pairs stay in token order
    assert sorted_pairs.tolist() == [0, 3, 5, 6, 9, pad, pad, pad, 2, 7, 10, pad, 1, 4, 8, 11] + [pad] * 11
    assert sorted_pairs.numel() == 12 + 5 * 3  # the static bound T * k + E * (block_m - 1), whatever the routing
    assert block_expert.tolist() == [0, 0, 1, 3, -1, -1, -1]  # blocks past the last run: -1, skipped


# --- whole layers against the reference --------------------------------------------------------------

# (activation, bias, (T, k, E)): each activation with and without biases; T = 1 and 5 take the decode tiles,
# (40, 2, 4) the prefill ones; (40, 1, 4) puts 20-odd pairs on expert 0 (several blocks) and skips the sum.
CASES = [
    ("silu", False, (1, 1, 4)),
    ("silu", True, (40, 4, 16)),
    ("gelu_tanh", False, (5, 2, 16)),
    ("gelu_tanh", True, (40, 2, 4)),
    ("swigluoai", False, (1, 4, 16)),
    ("swigluoai", True, (40, 1, 4)),
]
CASE_IDS = [f"{act}-{'bias' if bias else 'nobias'}-T{t}k{k}E{e}" for act, bias, (t, k, e) in CASES]


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize(("activation", "bias", "shape"), CASES, ids=CASE_IDS)
def test_fused_moe_matches_the_reference(device, dtype, activation, bias, shape):
    num_tokens, top_k, num_experts = shape
    layer = make_experts(num_experts, activation, bias, dtype)
    x, topk_weights, topk_ids = make_batch(num_tokens, top_k, num_experts, dtype)
    assert_close_to_reference(*run_both(layer, x, topk_weights, topk_ids, device))


@pytest.mark.parametrize(("activation", "bias", "shape"), [CASES[1], CASES[4]], ids=[CASE_IDS[1], CASE_IDS[4]])
def test_fused_moe_matches_the_reference_in_float16(device, activation, bias, shape):
    num_tokens, top_k, num_experts = shape
    layer = make_experts(num_experts, activation, bias, torch.float16)
    x, topk_weights, topk_ids = make_batch(num_tokens, top_k, num_experts, torch.float16)
    assert_close_to_reference(*run_both(layer, x, topk_weights, topk_ids, device))


@pytest.mark.parametrize("config", [DECODE_CONFIG, PREFILL_CONFIG], ids=["decode", "prefill"])
def test_either_tile_config_gives_the_reference(device, config):
    layer = make_experts(16, "silu", True, torch.float32, seed=3)
    x, topk_weights, topk_ids = make_batch(40, 2, 16, torch.float32, seed=3)
    got = fused_moe(x.to(device), layer.w13_weight.to(device), layer.w2_weight.to(device), topk_weights.to(device),
                    topk_ids.to(device), w13_bias=layer.w13_bias.to(device), w2_bias=layer.w2_bias.to(device),
                    config=config)  # fmt: skip
    assert_close_to_reference(got.cpu(), Platform().fused_moe(layer, x, topk_weights, topk_ids))


# --- graph safety and wiring ----------------------------------------------------------------------


def test_the_launcher_reads_no_values_so_a_cuda_graph_can_capture_it(no_launch):
    """On the meta device a tensor has a shape and no values, so any read back to the host (.item(), .tolist(),
    bincount or nonzero sizing their results from the data) raises: the path sizes everything from T, k and E."""
    stand_ins = no_launch(moe_kernels, ("_moe_align_kernel", "_moe_gemm_kernel", "_moe_sum_kernel"))
    meta = dict(device="meta", dtype=torch.bfloat16)
    out = fused_moe(torch.empty(7, HIDDEN, **meta), torch.empty(16, 2 * INTERMEDIATE, HIDDEN, **meta),
                    torch.empty(16, HIDDEN, INTERMEDIATE, **meta), torch.empty(7, 4, device="meta"),
                    torch.empty(7, 4, dtype=torch.long, device="meta"), activation="swigluoai",
                    w13_bias=torch.empty(16, 2 * INTERMEDIATE, **meta), w2_bias=torch.empty(16, HIDDEN, **meta))
    assert out.shape == (7, HIDDEN) and out.device.type == "meta"
    assert [stand_ins[n].launches for n in ("_moe_align_kernel", "_moe_gemm_kernel", "_moe_sum_kernel")] == [1, 2, 1]


def test_cuda_platform_keeps_the_reference_for_tensors_off_the_gpu():
    from nanoinfer.platforms.cuda import CudaPlatform

    layer = make_experts(4, "silu", False, torch.float32)
    x, topk_weights, topk_ids = make_batch(3, 2, 4, torch.float32)
    expected = Platform().fused_moe(layer, x, topk_weights, topk_ids)
    assert torch.equal(CudaPlatform("float32").fused_moe(layer, x, topk_weights, topk_ids), expected)


def test_weights_of_the_wrong_shape_are_refused(device):
    layer = make_experts(4, "silu", False, torch.float32)
    x, topk_weights, topk_ids = make_batch(3, 2, 4, torch.float32)
    with pytest.raises(ValueError, match=r"w13 \(4, 144, 100\) and w2 \(4, 99, 72\)"):
        fused_moe(x.to(device), layer.w13_weight.to(device), layer.w2_weight[:, :99].to(device),
                  topk_weights.to(device), topk_ids.to(device))  # fmt: skip


def test_the_start_up_check_runs_the_kernel_and_a_failure_keeps_the_reference_without_graphs(monkeypatch):
    """A mixture of experts runs the fused-MoE kernel once at load; where it fails (a Triton or driver this code was
    not tried with) the experts take the reference, and decode runs eager: the reference reads counts back."""
    from types import SimpleNamespace

    from nanoinfer.platforms.cuda import CudaPlatform, check_fused_moe

    layer = make_experts(4, "silu", False, torch.float32)
    assert check_fused_moe(layer) is None

    def broken(*args, **kwargs):
        raise RuntimeError("PassManager::run failed\nlong compiler log")

    monkeypatch.setattr(moe_kernels, "fused_moe_layer", broken)
    assert check_fused_moe(layer) == "RuntimeError: PassManager::run failed"
    platform = CudaPlatform("float32")
    config = SimpleNamespace(enforce_eager=False, tensor_parallel_size=1)
    assert platform.uses_cuda_graphs(config, "triton")
    platform.prepare_model(torch.nn.ModuleList([layer]))
    assert platform.triton_moe is False and not platform.uses_cuda_graphs(config, "triton")
