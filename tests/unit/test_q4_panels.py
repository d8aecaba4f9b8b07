"""Float32 weights that are exactly 4-bit blocks (d * q + m, float16 d and m per 32 inputs, q in 0..15: what a
GGUF Q4_1 file dequantizes to) are kept in that form too. The panel GEMM's small steps read it: the same float32
values multiplied in the same order, so the same bits as the float32 panels (csrc/q4_panels.h). Steps of more
rows run on AMX: exact products, float32 sums in another order (csrc/q4_amx_gemm.cpp)."""

from __future__ import annotations

import pytest
import torch

from nanoinfer.platforms.cpu.linear import PackedWeight, gated_linear, linear, pack_weight
from nanoinfer.platforms.cpu.ops import cpu_ops

pytestmark = pytest.mark.skipif(cpu_ops() is None or cpu_ops().simd != "avx512",
                                reason="the GEMM expands 4-bit weights with AVX-512 only")  # fmt: skip
needs_amx = pytest.mark.skipif(cpu_ops() is None or not cpu_ops().amx_available(), reason="no AMX on this CPU")


def panels_only(weight: torch.Tensor, kind: str = "panels") -> PackedWeight:
    """The weight packed as float32 panels alone, as a weight that is not exact 4-bit blocks is."""
    gated = kind == "gated"
    data = cpu_ops().pack_gated_weight(weight) if gated else cpu_ops().pack_linear_weight(weight)
    return PackedWeight(kind, data, weight.shape[0] // (2 if gated else 1))


def q4_exact_weight(rows: int, cols: int, seed: int = 0, top: int = 15) -> torch.Tensor:
    """Random [rows, cols] float32 values of Q4_1 blocks, as the GGUF dequantizer computes them: each block's
    smallest value has q = 0 (its m, as the quantizer makes it), its largest q = `top` (15 from the quantizer)."""
    gen = torch.Generator().manual_seed(seed)
    d = (torch.rand(rows, cols // 32, 1, generator=gen) * 0.02).half().float()
    m = (-torch.rand(rows, cols // 32, 1, generator=gen) * 0.15).half().float()
    q = torch.randint(0, top + 1, (rows, cols // 32, 32), generator=gen)
    ends = torch.rand(rows, cols // 32, 32, generator=gen).argsort(-1)[..., :2]  # two places a block
    q.scatter_(-1, ends, torch.tensor([0, top]).expand(rows, cols // 32, 2).contiguous())
    return (d * q.float() + m).reshape(rows, cols)  # d * q is exact, so this is fma(q, d, m)


@pytest.mark.parametrize("rows", [1, 5, 12, 13, 28, 48])  # one register tile; chunked tiles (more: AMX, below)
@pytest.mark.parametrize("out_features, in_features", [(200, 96), (37, 32), (64, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_exact_4bit_weights_give_the_bits_of_float32_panels(rows, out_features, in_features, with_bias):
    weight = q4_exact_weight(out_features, in_features, seed=rows)
    packed = pack_weight(weight, "panels")
    assert packed.compact is not None and packed.compact.dtype == torch.uint8
    assert packed.compact.numel() * 6 <= -(-out_features // 16) * 16 * in_features * 4  # 5 bits a value, not 32
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    x = torch.randn(rows, in_features, generator=gen)
    without = panels_only(weight)
    assert torch.equal(linear(x, weight, bias, packed), linear(x, weight, bias, without))
    torch.testing.assert_close(linear(x, weight, bias, packed), x @ weight.T + (0 if bias is None else bias),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("rows", [1, 12, 30, 48])
@pytest.mark.parametrize("intermediate", [48, 13])  # 8 gate and 8 up columns a panel; a partial panel
def test_exact_4bit_gated_weights_give_the_bits_of_float32_panels(rows, intermediate):
    weight = q4_exact_weight(2 * intermediate, 64, seed=intermediate)
    packed = pack_weight(weight, "gated")
    assert packed.compact is not None
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    without = panels_only(weight, "gated")
    assert torch.equal(gated_linear(x, packed), gated_linear(x, without))


@pytest.mark.parametrize("top", [14, 9, 1])
def test_blocks_whose_largest_q_is_not_15_are_found_too(top):
    weight = q4_exact_weight(16, 64, top=top)
    packed = pack_weight(weight, "panels")
    assert packed.compact is not None
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(top))
    without = panels_only(weight)
    assert torch.equal(linear(x, weight, None, packed), linear(x, weight, None, without))


def test_weights_that_are_not_exact_4bit_blocks_keep_float32_panels_only():
    exact = q4_exact_weight(32, 64)
    assert pack_weight(exact, "panels").compact is not None
    nudged = exact.clone()
    nudged[5, 7] = torch.nextafter(nudged[5, 7], torch.tensor(1.0))  # one value a float32 step off its block
    assert pack_weight(nudged, "panels").compact is None
    assert pack_weight(torch.randn(32, 64), "panels").compact is None  # an ordinary float32 weight
    with_nan = exact.clone()
    with_nan[0, 0] = float("nan")
    assert pack_weight(with_nan, "panels").compact is None
    assert pack_weight(q4_exact_weight(32, 64)[:, :48].contiguous(), "panels").compact is None  # K not a multiple of 32
    assert pack_weight(exact.bfloat16(), "panels").compact is None  # bfloat16 models keep their own kernels


def test_a_compact_form_that_does_not_fit_the_weight_is_refused():
    a = panels_only(q4_exact_weight(32, 64))
    b = pack_weight(q4_exact_weight(32, 96), "panels")
    with pytest.raises(RuntimeError, match="pack_q4_panels"):
        cpu_ops().packed_linear(torch.randn(2, 64), a.data, None, 32, compact=b.compact)


@needs_amx
def test_weights_with_both_4bit_forms_leave_the_float32_panels_out():
    """No step reads them then: up to 48 rows the 4-bit panels run, above AMX."""
    weight = q4_exact_weight(40, 64)
    packed = pack_weight(weight, "panels")
    assert packed.data.numel() == 0 and packed.compact is not None and packed.compact_amx is not None
    assert pack_weight(weight, "panels", keep_panels=True).data.shape == (3, 64, 16)
    for rows in (1, 48, 49, 300):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(linear(x, weight, None, packed), x @ weight.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="not both 4-bit forms"):
        cpu_ops().packed_linear(torch.randn(2, 64), packed.data, None, 40, compact=packed.compact)


def _reference(x, weight, bias=None, gated=False):
    y = x.double() @ weight.double().T
    if gated:
        gate, up = y.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    return y if bias is None else y + bias.double()


@needs_amx
@pytest.mark.parametrize("rows", [49, 64, 100, 256, 300, 1000])  # from kQ4MaxRows + 1; threads split columns, rows
@pytest.mark.parametrize("out_features, in_features", [(200, 96), (37, 32), (64, 1536)])  # 37: a pair of one panel
@pytest.mark.parametrize("with_bias", [False, True])
def test_many_rows_run_on_amx_as_accurately_as_float32_panels(rows, out_features, in_features, with_bias):
    """x . q on AMX with x in three exact bfloat16 parts: every product exact, the sums float32, so as close to
    the float64 product as the float32 panels are (here 2-4x closer: blocks of 32 sum apart)."""
    weight = q4_exact_weight(out_features, in_features, seed=rows + out_features)
    packed = pack_weight(weight, "panels")
    assert packed.compact_amx is not None
    gen = torch.Generator().manual_seed(rows)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    x = torch.randn(rows, in_features, generator=gen)
    expected = _reference(x, weight, bias)
    amx_error = (linear(x, weight, bias, packed).double() - expected).abs().max().item()
    panels_error = (linear(x, weight, bias, panels_only(weight)).double() - expected).abs().max().item()
    assert amx_error <= 2 * panels_error + 1e-6


@needs_amx
@pytest.mark.parametrize("rows", [49, 300])
@pytest.mark.parametrize("intermediate", [48, 13])
def test_gated_many_rows_run_on_amx_as_accurately_as_float32_panels(rows, intermediate):
    weight = q4_exact_weight(2 * intermediate, 64, seed=intermediate)
    packed = pack_weight(weight, "gated")
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    expected = _reference(x, weight, gated=True)
    amx_error = (gated_linear(x, packed).double() - expected).abs().max().item()
    panels_error = (gated_linear(x, panels_only(weight, "gated")).double() - expected).abs().max().item()
    assert amx_error <= 2 * panels_error + 1e-6


@needs_amx
@pytest.mark.parametrize("rows", [100, 300])  # 2 threads split the columns / the rows; 1 thread the rows
def test_amx_rows_have_the_same_bits_on_any_thread_count(rows):
    weight = q4_exact_weight(96, 128, seed=3)
    packed = pack_weight(weight, "panels")
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear(x, weight, None, packed)
        torch.set_num_threads(2)
        two = linear(x, weight, None, packed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("out_features, in_features", [(48, 64), (37, 32), (200, 96), (16, 1536)])
def test_blocks_from_a_gguf_pack_to_the_bytes_the_packer_finds(gated, out_features, in_features):
    """compact_from_blocks (a GGUF's Q4_0 / Q4_1 blocks, no float32 detection) writes pack_q4_panels' layout
    byte for byte, in pieces at any row offsets (q, k and v; gate and up), padded columns included."""
    from nanoinfer.platforms.cpu.linear import compact_from_blocks

    rows = 2 * out_features if gated else out_features
    gen = torch.Generator().manual_seed(rows + in_features)
    d = (torch.rand(rows, in_features // 32, generator=gen) * 0.02 + 1e-3).half()
    m = (-torch.rand(rows, in_features // 32, generator=gen) * 0.15).half()
    q = torch.randint(0, 16, (rows, in_features), generator=gen, dtype=torch.uint8)
    q.view(rows, -1, 32)[..., :2] = torch.tensor([0, 15], dtype=torch.uint8)  # the fitter's canonical blocks
    weight = (q.view(rows, -1, 32).float() * d.float().unsqueeze(-1) + m.float().unsqueeze(-1)).view(rows, -1)
    cut = rows // 3
    pieces = {0: (d[:cut], m[:cut], q[:cut]), cut: (d[cut:], m[cut:], q[cut:])}
    expected = cpu_ops().pack_q4_panels(weight, gated)
    assert expected.numel() and torch.equal(compact_from_blocks(pieces, rows, gated), expected)
    assert compact_from_blocks({0: pieces[0]}, rows, gated) is None  # rows missing: no 4-bit form
