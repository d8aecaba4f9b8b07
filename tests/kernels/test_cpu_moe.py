"""The CPU fused expert op (csrc/moe.cpp, platforms/cpu/moe.py) against the reference, Platform.fused_moe.

Tolerances, from what each side rounds (output scale: the reference's largest magnitude):
- float32: both sum the same float32 products, in other orders (the reference's GEMM, the kernel's panels),
  each an error of a few float32 ulps of the sums: 1e-5 of the output scale leaves a wide margin over that,
  and a wrong bias, activation or expert is off by O(1).
- bfloat16: the kernel rounds twice (the hidden rows, the output); the reference rounds at every op (the gate/up
  projection, the activation's steps, the down projection, the weighting) and at each of the k additions of
  index_add_ into a bfloat16 output: up to (k + 6) half-ulps (2^-9) of the scale in the worst case.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nanoinfer.platforms.cpu.ops import cpu_ops
from nanoinfer.platforms.interface import Platform

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="the C++ extension is not built here (no compiler)")

ACTIVATIONS = ["silu", "gelu_tanh", "swigluoai"]
ALPHA, LIMIT = 1.702, 7.0


def make_layer(num_experts, hidden, intermediate, dtype, activation, bias, seed):
    """A FusedMoE's attributes: the gate/up projection scaled so that gates reach past the SwiGLU clamp (7)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    return SimpleNamespace(
        num_experts=num_experts, intermediate_size=intermediate, activation=activation, swiglu_alpha=ALPHA,
        swiglu_limit=LIMIT, w13_weight=randn(num_experts, 2 * intermediate, hidden, scale=4 / hidden**0.5),
        w2_weight=randn(num_experts, hidden, intermediate, scale=1 / intermediate**0.5),
        w13_bias=randn(num_experts, 2 * intermediate) if bias else None,
        w2_bias=randn(num_experts, hidden) if bias else None,
    )  # fmt: skip


def make_routing(num_tokens, num_experts, top_k, routing, dtype, seed):
    """(topk_weights float32 [T, k], rounded to dtype as the router rounds them; topk_ids int64 [T, k])."""
    gen = torch.Generator().manual_seed(seed + 1)
    if routing == "same":  # every token on the same k experts, the last ones (the others idle)
        ids = torch.arange(num_experts - top_k, num_experts).repeat(num_tokens, 1)
    else:
        ids = [torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]
        ids = torch.stack(ids) if ids else torch.zeros(0, top_k)
    ids = ids.reshape(num_tokens, top_k).long()
    weights = torch.rand(num_tokens, top_k, generator=gen) + 0.1
    return (weights / weights.sum(-1, keepdim=True)).to(dtype).float(), ids


def run_op(layer, x, topk_weights, topk_ids):
    from nanoinfer.platforms.cpu.moe import fused_moe, pack_experts

    layer.packed_experts = pack_experts(layer)
    assert layer.packed_experts is not None
    return fused_moe(layer, x, topk_weights, topk_ids)


def assert_matches_reference(out, ref, top_k):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if not ref.numel():
        return
    scale = ref.float().abs().max().item()
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5 * scale)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=(top_k + 6) * 2.0**-9 * scale)
        # On average a few half-ulps: the worst case needs every rounding to err the same way.
        assert (out.float() - ref.float()).abs().mean() <= 2.0**-6 * ref.float().abs().mean()


# (tokens, experts, top_k, hidden, intermediate): no tokens, one (decode), a few with every expert of 8 used,
# a prefill over 128 experts; widths that are not multiples of 16 (panels) or of 2 (bfloat16 pairs).
SHAPES = [(0, 8, 2, 32, 16), (1, 8, 2, 64, 48), (1, 128, 8, 48, 32), (7, 8, 8, 33, 45), (300, 128, 8, 40, 24),
          (300, 8, 2, 64, 40), (300, 8, 1, 17, 9)]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-E{}-k{}-H{}-I{}".format(*s))
@pytest.mark.parametrize("routing", ["random", "same"])
def test_fused_moe_matches_reference(dtype, activation, bias, shape, routing):
    num_tokens, num_experts, top_k, hidden, intermediate = shape
    seed = sum(shape) + ACTIVATIONS.index(activation)
    layer = make_layer(num_experts, hidden, intermediate, dtype, activation, bias, seed)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(seed + 2)).to(dtype)
    topk_weights, topk_ids = make_routing(num_tokens, num_experts, top_k, routing, dtype, seed)
    ref = Platform().fused_moe(layer, x, topk_weights, topk_ids)
    assert_matches_reference(run_op(layer, x, topk_weights, topk_ids), ref, top_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_many_tokens_go_in_chunks_and_passes(dtype):
    """2100 tokens x 8 experts of hidden 2048: each expert's rows split into chunks (1 MiB of packed rows each) and
    the tokens into two passes (128 MiB of per-pair buffers each), all on the same few experts."""
    layer = make_layer(8, 2048, 16, dtype, "silu", True, seed=3)
    x = torch.randn(2100, 2048, generator=torch.Generator().manual_seed(4)).to(dtype)
    topk_weights, topk_ids = make_routing(2100, 8, 8, "random", dtype, seed=5)
    ref = Platform().fused_moe(layer, x, topk_weights, topk_ids)
    assert_matches_reference(run_op(layer, x, topk_weights, topk_ids), ref, 8)


def test_float32_panels_are_the_dense_gemms_per_expert():
    """Each expert's float32 panels are what pack_gated_weight / pack_linear_weight make of it (csrc/gemm.cpp)."""
    ops = cpu_ops()
    layer = make_layer(3, 40, 20, torch.float32, "silu", False, seed=6)
    w13, w2 = ops.pack_moe_weights(layer.w13_weight, True), ops.pack_moe_weights(layer.w2_weight, False)
    for e in range(3):
        assert torch.equal(w13[e], ops.pack_gated_weight(layer.w13_weight[e]))
        assert torch.equal(w2[e], ops.pack_linear_weight(layer.w2_weight[e]))


def test_bfloat16_panels_hold_k_steps_in_pairs():
    """bfloat16: the same columns, each column's inputs k and k + 1 side by side (an odd width padded with 0)."""
    weight = torch.randn(2, 20, 7).bfloat16()
    packed = cpu_ops().pack_moe_weights(weight, False)  # [E, ceil(20 / 16), ceil(7 / 2), 32]
    assert packed.shape == (2, 2, 4, 32)
    padded = torch.cat([weight, weight.new_zeros(2, 20, 1)], dim=2)  # [E, N, 8]
    for e, p, s, column in [(0, 0, 0, 0), (1, 0, 3, 15), (1, 1, 2, 3), (0, 1, 1, 2)]:
        pair = packed[e, p, s, 2 * column : 2 * column + 2]
        assert torch.equal(pair, padded[e, 16 * p + column, 2 * s : 2 * s + 2])


def test_expert_id_out_of_range_is_an_error():
    layer = make_layer(4, 32, 16, torch.float32, "silu", False, seed=7)
    x = torch.randn(2, 32)
    with pytest.raises(RuntimeError, match="out of range"):
        run_op(layer, x, torch.ones(2, 1), torch.tensor([[1], [4]]))


def test_platform_packs_a_layer_and_releases_its_weights():
    """CpuKernelPlatform.prepare_model packs a FusedMoE (packed_experts, original weights released, expert_bytes
    counting the packed copy) and its fused_moe then matches the reference run before packing; a float16 layer
    keeps its weights and runs the reference."""
    from torch import nn

    from nanoinfer.models.layers.moe import FusedMoE
    from nanoinfer.platforms.cpu import CpuKernelPlatform
    from nanoinfer.roofline import expert_bytes

    platform = CpuKernelPlatform(cpu_ops())
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(5, 48, generator=gen)
    topk_weights, topk_ids = make_routing(5, 8, 2, "random", torch.float32, seed=9)
    for dtype in (torch.float32, torch.float16):
        layer = FusedMoE(8, 48, 40, "silu", bias=True).to(dtype)
        for param in layer.parameters():
            param.data.copy_(torch.randn(param.shape, generator=gen) / 8)
        ref = Platform().fused_moe(layer, x.to(dtype), topk_weights, topk_ids)
        platform.prepare_model(nn.Sequential(layer))
        out = platform.fused_moe(layer, x.to(dtype), topk_weights, topk_ids)
        if dtype == torch.float16:
            assert layer.packed_experts is None and layer.w13_weight.numel() == 8 * 80 * 48
            assert torch.equal(out, ref)
            continue
        assert layer.w13_weight.numel() == 0 and layer.w2_weight.numel() == 0
        assert expert_bytes(nn.Sequential(layer)) == sum(t.numel() * t.element_size()
                                                         for t in layer.packed_experts.tensors())  # fmt: skip
        assert_matches_reference(out, ref, 2)
