"""Float32 weights that are exactly 4-bit blocks (d * q + m, float16 d and m per 32 inputs, q in 0..15: what a
GGUF Q4_1 file dequantizes to) are kept in that form too, and the panel GEMM's small steps read it: the same
float32 values multiplied in the same order, so the same bits as the float32 panels (csrc/q4_panels.h)."""

from __future__ import annotations

import pytest
import torch

from nanoinfer.cpu_ops import cpu_ops
from nanoinfer.model.cpu_gemm import gated_linear, linear, pack_weight

pytestmark = pytest.mark.skipif(cpu_ops() is None or cpu_ops().simd != "avx512",
                                reason="the GEMM expands 4-bit weights with AVX-512 only")  # fmt: skip


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


@pytest.mark.parametrize("rows", [1, 5, 12, 13, 28, 48, 49, 130])  # one register tile, chunked tiles, float32 only
@pytest.mark.parametrize("out_features, in_features", [(200, 96), (37, 32), (64, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_exact_4bit_weights_give_the_bits_of_float32_panels(rows, out_features, in_features, with_bias):
    weight = q4_exact_weight(out_features, in_features, seed=rows)
    packed = pack_weight(weight, "panels")
    assert packed.compact is not None and packed.compact.dtype == torch.uint8
    assert packed.compact.numel() < packed.data.numel() * 4 / 5  # 5 bits a value against 32
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    x = torch.randn(rows, in_features, generator=gen)
    without = packed.__class__("panels", packed.data, out_features)  # the float32 panels only
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
    without = packed.__class__("gated", packed.data, intermediate)
    assert torch.equal(gated_linear(x, packed), gated_linear(x, without))


@pytest.mark.parametrize("top", [14, 9, 1])
def test_blocks_whose_largest_q_is_not_15_are_found_too(top):
    weight = q4_exact_weight(16, 64, top=top)
    packed = pack_weight(weight, "panels")
    assert packed.compact is not None
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(top))
    without = packed.__class__("panels", packed.data, 16)
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
    a = pack_weight(q4_exact_weight(32, 64), "panels")
    b = pack_weight(q4_exact_weight(32, 96), "panels")
    with pytest.raises(RuntimeError, match="pack_q4_panels"):
        cpu_ops().packed_linear(torch.randn(2, 64), a.data, None, 32, compact=b.compact)
