"""The AMX bfloat16 GEMM (csrc/amx_gemm.cpp) against float32 sums rounded once, and its gated form against the
separate gate_up linear and SiLU-and-mul. Runs where the CPU has AMX (Sapphire Rapids and later); elsewhere
the bfloat16 linears go to oneDNN or our widening GEMM, tested in test_cpu_gemm.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanoinfer.platforms.cpu.linear import gated_linear, linear, pack_weight, packing_kind
from nanoinfer.platforms.cpu.ops import cpu_ops

pytestmark = pytest.mark.skipif(cpu_ops() is None or not cpu_ops().amx_available(), reason="no AMX on this CPU")


def _rounded_reference(x, weight, bias=None):
    """float32 sums of the bfloat16 values, rounded to bfloat16 once: what the kernel computes, up to order."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).bfloat16()


# Rows: one tile, a full and a partial 32-row block, past 256 (a second run of blocks). Features: a multiple
# of 32 and not (the zero-padded copy); outputs: whole pairs of 32 and a partial one.
@pytest.mark.parametrize("rows", [1, 16, 17, 32, 45, 64, 300])
@pytest.mark.parametrize("in_features, out_features", [(64, 96), (100, 70), (576, 960)])
def test_amx_linear_is_the_float32_sum_rounded_once(rows, in_features, out_features):
    gen = torch.Generator().manual_seed(rows + in_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    weight = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    packed = pack_weight(weight, "amx")
    for b in (None, bias):
        out = linear(x, weight, b, packed)
        expected = _rounded_reference(x, weight, b)
        assert out.dtype == torch.bfloat16 and out.shape == expected.shape
        # Summation order differs from the reference's: a last-bit difference now and then, no more.
        torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=1e-3)
        assert (out == expected).float().mean() > 0.99


@pytest.mark.parametrize("rows", [1, 20, 64, 257])
@pytest.mark.parametrize("intermediate, in_features", [(48, 96), (13, 33), (1536, 576)])
def test_amx_gated_linear_gives_the_bits_of_linear_then_silu_and_mul(rows, intermediate, in_features):
    gen = torch.Generator().manual_seed(rows * intermediate)
    weight = (torch.randn(2 * intermediate, in_features, generator=gen) / in_features**0.5).bfloat16()  # [gate; up]
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    packed = pack_weight(weight, "amx_gated")
    assert packed.gated and packed.out_features == intermediate
    out = gated_linear(x, packed)
    # The same tile sums as the plain packing's, then the SiLU-and-mul kernel's roundings: bit for bit.
    projection = linear(x, weight, None, pack_weight(weight, "amx"))
    assert torch.equal(out, cpu_ops().silu_and_mul(projection))
    gate, up = projection.chunk(2, dim=-1)
    assert torch.equal(out, F.silu(gate) * up)  # and torch's bfloat16 ops give the same


def test_amx_linear_is_the_same_on_any_thread_count_and_checks_its_inputs():
    weight, x = torch.randn(200, 64).bfloat16(), torch.randn(70, 64).bfloat16()
    packed = pack_weight(weight, "amx")
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(linear(x, weight, None, packed))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(out, outs[0]) for out in outs)
    ops = cpu_ops()
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.amx_linear(x.float(), packed.data, None, 200)
    with pytest.raises(RuntimeError, match="another output size"):
        ops.amx_linear(x, packed.data, None, 300)
    with pytest.raises(RuntimeError, match="features"):
        ops.amx_linear(torch.randn(3, 128).bfloat16(), packed.data, None, 200)
    with pytest.raises(RuntimeError, match="bias"):
        ops.amx_linear(x, pack_weight(weight, "amx_gated").data, torch.zeros(100), 100, gated=True)
    assert linear(x[:0], weight, None, packed).shape == (0, 200)


@pytest.mark.parametrize("gated", [False, True])
def test_pairs_taken_from_other_threads_ranges_give_the_same_bits(gated):
    """A thread done with its pairs takes the rest of another's (csrc/amx_gemm.cpp, PairRange): over several
    runs of rows and more threads than cores (so some threads lag and lose pairs), every output is computed
    once, as on one thread."""
    gen = torch.Generator().manual_seed(5)
    weight = (torch.randn(2 * 700 if gated else 700, 96, generator=gen) / 10).bfloat16()
    packed = pack_weight(weight, "amx_gated" if gated else "amx")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        xs = [torch.randn(rows, 96, generator=gen).bfloat16() for rows in (40, 600)]  # 1 and 3 runs of rows
        one = [gated_linear(x, packed) if gated else linear(x, weight, None, packed) for x in xs]
        for n in (2, 3, 4, 2, 3, 4):
            torch.set_num_threads(n)
            for x, expected in zip(xs, one):
                out = gated_linear(x, packed) if gated else linear(x, weight, None, packed)
                assert torch.equal(out, expected), n
    finally:
        torch.set_num_threads(threads)


def test_bfloat16_linears_use_amx_where_the_cpu_has_it():
    assert packing_kind(torch.bfloat16) == "amx"
    assert packing_kind(torch.float32) != "amx"
