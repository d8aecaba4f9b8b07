"""The CPU batched multi-LoRA op (csrc/lora.cpp, CpuKernelPlatform.add_lora) against the reference, Platform.add_lora.

Tolerances, per element, from what each side rounds. M[t, c] = sum_r sum_k |x[t, k]| |A[r, k]| |B[r, c]|, the size
of the delta's terms (the reference run on |x|, |A|, |B|):
- float32: both sum the same float32 products in other orders (K products into h, R into the delta), each addition
  off by at most half an ulp (2^-24) of a partial sum, itself at most M: on average a few 1e-7 of M, at worst
  (K + R) 2^-24 M; 1e-5 M is far above the first and a wrong row, slot or slice is off by a good share of M. The
  sums y + delta then round once on each side (an ulp of the result, 2^-23 |y|).
- bfloat16: h is rounded to bfloat16 on both sides from float32 sums that may differ in their last bits, so an h can
  land one bfloat16 ulp (at most 2^-7 |h|) away: at most 2^-7 M in the delta; the result rounds once on each side
  (one ulp of it, at most 2^-7 of its magnitude), plus the float32 sums' 1e-5 M.
Rows without an adapter must come back bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from nanoinfer.platforms.cpu.ops import cpu_ops
from nanoinfer.platforms.interface import Platform

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="the C++ extension is not built here (no compiler)")

NUM_SLOTS = 8


def offsets_of(widths: tuple[int, ...]) -> list[int]:
    return [sum(widths[:i]) for i in range(len(widths) + 1)]


def make_inputs(num_rows, in_features, widths, rank, dtype, slots, seed):
    """x [T, K], y [T, N], lora_a [L, S R, K], lora_b [L, R, N], scaled so that h and the delta are O(1)."""
    gen = torch.Generator().manual_seed(seed)
    num_slices, out_features = len(widths), sum(widths)
    x = torch.randn(num_rows, in_features, generator=gen).to(dtype)
    y = torch.randn(num_rows, out_features, generator=gen).to(dtype)
    lora_a = (torch.randn(NUM_SLOTS, num_slices * rank, in_features, generator=gen) / in_features**0.5).to(dtype)
    lora_b = (torch.randn(NUM_SLOTS, rank, out_features, generator=gen) / rank**0.5).to(dtype)
    return x, y, lora_a, lora_b, make_slots(num_rows, slots, gen)


def make_slots(num_rows, pattern, gen):
    """int32 [T]: "interleaved" (decode: each row any slot or -1), "segments" (a prefill: runs of 3 slots, one -1),
    "one" (every row the last slot), "none" (every row -1)."""
    if pattern == "interleaved":
        slots = torch.randint(-1, NUM_SLOTS, (num_rows,), generator=gen)
    elif pattern == "segments":
        slots = torch.tensor([5, -1, 0, 2])[torch.arange(num_rows) * 4 // max(num_rows, 1)]
    elif pattern == "one":
        slots = torch.full((num_rows,), NUM_SLOTS - 1)
    else:
        slots = torch.full((num_rows,), -1)
    return slots.to(torch.int32)


def assert_matches_reference(x, y, lora_a, lora_b, row_slots, offsets):
    ref = y.clone()
    Platform().add_lora(ref, x, lora_a, lora_b, row_slots, tuple(offsets))
    out = y.clone()
    cpu_ops().add_lora(out, x, lora_a, lora_b, row_slots, offsets)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    untouched = row_slots < 0
    assert torch.equal(out[untouched], y[untouched])
    if not ref.numel():
        return
    magnitude = torch.zeros(y.shape, dtype=torch.float32)
    Platform().add_lora(magnitude, x.float().abs(), lora_a.float().abs(), lora_b.float().abs(), row_slots,
                        tuple(offsets))  # fmt: skip
    out, ref = out.float(), ref.float()
    if y.dtype == torch.float32:
        tolerance = 1e-5 * magnitude + 2.0**-23 * ref.abs()
    else:
        tolerance = (2.0**-7 + 1e-5) * magnitude + 2.0**-7 * torch.maximum(out.abs(), ref.abs())
    excess = (out - ref).abs() - tolerance
    assert excess.max() <= 0, f"off by {(out - ref).abs().max():.3g} where the tolerance is {tolerance.max():.3g}"


# (in_features, slice widths): one slice, two and three of uneven widths; widths not multiples of 16 (a vector) or
# of 32 (an expand block), and K not a multiple of 16 or 32 (a vector of float32 / bfloat16 pairs).
SHAPES = [(200, (961,)), (961, (200, 17)), (64, (576, 40, 33))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"K{s[0]}-N{'+'.join(map(str, s[1]))}")
@pytest.mark.parametrize("rank", [8, 16, 64])
@pytest.mark.parametrize("num_rows", [0, 1, 7, 64, 1000])
@pytest.mark.parametrize("slots", ["interleaved", "segments", "one", "none"])
def test_add_lora_matches_reference(dtype, shape, rank, num_rows, slots):
    in_features, widths = shape
    seed = in_features + rank + num_rows + len(widths)
    x, y, lora_a, lora_b, row_slots = make_inputs(num_rows, in_features, widths, rank, dtype, slots, seed)
    assert_matches_reference(x, y, lora_a, lora_b, row_slots, offsets_of(widths))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_rank_not_a_multiple_of_the_tile(dtype):
    """A rank of 5 (4-rank-row shrink tiles: a last group of 1 in each slice) on K = 33 and 3 slices."""
    x, y, lora_a, lora_b, row_slots = make_inputs(37, 33, (20, 7, 45), 5, dtype, "interleaved", seed=1)
    assert_matches_reference(x, y, lora_a, lora_b, row_slots, offsets_of((20, 7, 45)))


def test_rows_with_a_stride():
    """x and y may be views whose rows are contiguous but spaced (a slice of a wider activation)."""
    x, y, lora_a, lora_b, row_slots = make_inputs(50, 96, (80,), 16, torch.float32, "interleaved", seed=2)
    wide_x = torch.randn(50, 128, generator=torch.Generator().manual_seed(3))
    wide_x[:, 16:112] = x
    wide_y = torch.zeros(50, 100)
    wide_y[:, 10:90] = y
    ref = y.clone()
    Platform().add_lora(ref, x, lora_a, lora_b, row_slots, (0, 80))
    cpu_ops().add_lora(wide_y[:, 10:90], wide_x[:, 16:112], lora_a, lora_b, row_slots, [0, 80])
    torch.testing.assert_close(wide_y[:, 10:90], ref, rtol=1e-5, atol=1e-5)
    assert not wide_y[:, :10].any() and not wide_y[:, 90:].any()


def test_slot_out_of_range_is_an_error():
    x, y, lora_a, lora_b, _ = make_inputs(3, 32, (16,), 8, torch.float32, "none", seed=4)
    with pytest.raises(RuntimeError, match="slot 8 of 8 adapters"):
        cpu_ops().add_lora(y, x, lora_a, lora_b, torch.tensor([0, 8, -1], dtype=torch.int32), [0, 16])


def test_slices_must_cover_the_output():
    x, y, lora_a, lora_b, row_slots = make_inputs(3, 32, (16,), 8, torch.float32, "one", seed=5)
    with pytest.raises(RuntimeError, match="cover"):
        cpu_ops().add_lora(y, x, lora_a, lora_b, row_slots, [0, 12])


def test_platform_runs_the_kernel_and_falls_back_for_other_dtypes():
    """CpuKernelPlatform.add_lora gives the kernel's bits in float32 and the reference's in float16 (no kernel)."""
    from nanoinfer.platforms.cpu import CpuKernelPlatform

    platform = CpuKernelPlatform(cpu_ops())
    x, y, lora_a, lora_b, row_slots = make_inputs(20, 48, (32, 16), 8, torch.float32, "interleaved", seed=6)
    kernel, through_platform = y.clone(), y.clone()
    cpu_ops().add_lora(kernel, x, lora_a, lora_b, row_slots, [0, 32, 48])
    platform.add_lora(through_platform, x, lora_a, lora_b, row_slots, (0, 32, 48))
    assert torch.equal(through_platform, kernel)
    half = [t.half() for t in (x, y, lora_a, lora_b)]
    ref, out = half[1].clone(), half[1].clone()
    Platform().add_lora(ref, half[0], half[2], half[3], row_slots, (0, 32, 48))
    platform.add_lora(out, half[0], half[2], half[3], row_slots, (0, 32, 48))
    assert torch.equal(out, ref)
