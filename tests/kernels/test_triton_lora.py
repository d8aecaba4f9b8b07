"""The Triton batched multi-LoRA kernels (platforms/cuda/kernels/lora.py) against the plain-torch Platform.add_lora,
under the interpreter on CPU (see conftest.py): one to three uneven slices at ranks 8 and 16, over K and N that are
not multiples of a tile, with rows interleaving adapters and the base model (slot -1) inside one row tile, and runs
of one adapter across tiles, as a prefill's rows come. Every case keeps a slot that no row uses full of NaN (it
must not be read) and NaN in the x rows without an adapter (they must not reach another row); rows with slot -1
must come back bit for bit.

Tolerances. Both sides add float32 products (exact for 16-bit inputs, one rounding each in float32) in different
orders: h's sum of K terms, then the expand's sum of R, each off by at most about n * 2^-24 times the sum of the
terms' magnitudes (`magnitudes` below). Then in 16 bits each
side rounds h and y once: the two may land a step apart, one step of the value (2^-7 of it, relative, in
bfloat16; 2^-10 in float16), and under the interpreter, which truncates float32 -> bfloat16 where torch rounds to
nearest even, up to one and a half (counted as two). h's step reaches y through |B|: at most step * sum_r |h_r| |B_rc|.
"""

import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: pip install -e '.[dev]'")

from nanoinfer.platforms import Platform
from nanoinfer.platforms.cuda.kernels import lora as lora_kernels
from nanoinfer.platforms.cuda.kernels.lora import PREFILL_CONFIG, LoraBlockConfig, add_lora

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HIDDEN = 100  # K: not a multiple of the shrink's K blocks (32, 128)
NUM_SLOTS = 4  # slots 0-2 in use, 3 never (NaN)
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# (slice widths, rank): N 72, 112, 81, none a multiple of the expand's column blocks (64); S = 3's uneven, as
# q, k, v; R 8 pads to the 16 rows tl.dot needs at least
SLICES = {
    "S1-R8": ((72,), 8),
    "S2-R16": ((40, 72), 16),
    "S3-R8": ((48, 9, 24), 8),
}


def offsets_of(widths: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sum(widths[:i]) for i in range(len(widths) + 1))


def make_slots(num_rows: int) -> torch.Tensor:
    """The first 12 rows interleave slots 2, 0, -1, 1 (a decode batch: one 16-row tile, three adapters and the base
    model); then a run of slot 0 across the tile boundary at 16 (a prompt's rows); the last of 33 rows -1."""
    slots = [(2, 0, -1, 1)[t % 4] if t < 12 else 0 for t in range(num_rows)]
    if num_rows > 12:
        slots[-1] = -1
    return torch.tensor(slots, dtype=torch.int32)


def make_inputs(num_rows: int, widths: tuple[int, ...], rank: int, dtype: torch.dtype, seed: int = 0):
    """y, x, lora_a, lora_b scaled so h and the delta are O(1), like y; slot 3 and x's rows of slot -1 are NaN."""
    gen = torch.Generator().manual_seed(seed)
    n_out, num_slices = sum(widths), len(widths)
    row_slots = make_slots(num_rows)
    x = torch.randn(num_rows, HIDDEN, generator=gen)
    x[row_slots < 0] = float("nan")
    y = torch.randn(num_rows, n_out, generator=gen)
    lora_a = torch.randn(NUM_SLOTS, num_slices * rank, HIDDEN, generator=gen) * HIDDEN**-0.5
    lora_b = torch.randn(NUM_SLOTS, rank, n_out, generator=gen) * rank**-0.5
    lora_a[NUM_SLOTS - 1], lora_b[NUM_SLOTS - 1] = float("nan"), float("nan")
    return y.to(dtype), x.to(dtype), lora_a.to(dtype), lora_b.to(dtype), row_slots


def run_both(y, x, lora_a, lora_b, row_slots, slice_offsets, device, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kernel's y, back on CPU; the reference's y): each on its own copy of y."""
    got = y.to(device, copy=True)  # copy: on CPU .to would alias
    add_lora(got, x.to(device), lora_a.to(device), lora_b.to(device), row_slots.to(device), slice_offsets, **kwargs)
    expected = y.clone()
    Platform().add_lora(expected, x, lora_a, lora_b, row_slots, slice_offsets)
    return got.cpu(), expected


def magnitudes(x, lora_a, lora_b, row_slots, slice_offsets) -> tuple[torch.Tensor, torch.Tensor]:
    """Per element of y, for its row's slot: sum_r (sum_k |x_k| |A_rk|) |B_rc|, the magnitude of the terms both sums
    add up, and sum_r |h_r| |B_rc|, what one step of h's rounding moves y by at most (float32, rows of slot -1: 0)."""
    live = (row_slots >= 0)[:, None]
    slots = row_slots.clamp(min=0).long()
    xs = torch.where(live, x.float(), 0.0)  # rows of slot -1 hold NaN
    a, b = lora_a.float()[slots], lora_b.float()[slots].abs()  # each row's own slot: [T, S * R, K], [T, R, N]
    h = torch.einsum("tk,tjk->tj", xs, a)
    h_terms = torch.einsum("tk,tjk->tj", xs.abs(), a.abs())
    rank = lora_b.shape[1]

    def through_b(m: torch.Tensor) -> torch.Tensor:  # [T, S * R] -> [T, N]: each column through its slice's rows
        return torch.cat([torch.einsum("tr,trn->tn", m[:, s * rank : (s + 1) * rank], b[:, :, lo:hi])
                          for s, (lo, hi) in enumerate(zip(slice_offsets, slice_offsets[1:]))], dim=1)  # fmt: skip

    return through_b(h_terms), through_b(h.abs())


def assert_close_to_reference(got, expected, y, x, lora_a, lora_b, row_slots, slice_offsets) -> None:
    """Rows with slot -1 equal y exactly; the others within the module docstring's bound, elementwise."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    live = row_slots >= 0
    assert torch.equal(got[~live], y[~live])
    terms, h_through_b = magnitudes(x, lora_a, lora_b, row_slots, slice_offsets)
    bound = 2 * (x.shape[1] + lora_b.shape[1] + 2) * 2.0**-24 * terms  # both sums, either side
    if got.dtype == torch.float32:
        bound += 2.0**-23 * expected.abs()  # y + delta, rounded once in float32 on each side
    else:
        step = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[got.dtype]
        if INTERPRETED and got.dtype == torch.bfloat16:
            step *= 2
        bound += step * (h_through_b + expected.float().abs())  # h's rounding through |B|, then y's
    error = (got.float() - expected.float()).abs()
    assert bool((error[live] <= bound[live]).all()), (float(error[live].max()), float(bound[live].min()))


@pytest.mark.parametrize("num_rows", [1, 5, 33])
@pytest.mark.parametrize("slices", SLICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_lora_matches_the_reference(device, dtype, slices, num_rows):
    widths, rank = SLICES[slices]
    inputs = make_inputs(num_rows, widths, rank, dtype)
    offsets = offsets_of(widths)
    got, expected = run_both(*inputs, offsets, device)
    assert_close_to_reference(got, expected, *inputs, offsets)
    assert not torch.equal(expected, inputs[0])  # the delta is there to compare


def test_add_lora_matches_the_reference_in_float16(device):
    widths, rank = SLICES["S3-R8"]
    inputs = make_inputs(33, widths, rank, torch.float16)
    got, expected = run_both(*inputs, offsets_of(widths), device)
    assert_close_to_reference(got, expected, *inputs, offsets_of(widths))


# Tile choices the default (by T) does not make at these sizes: the prefill tiles (64 rows: all 33 rows in one
# tile, three adapters and runs in it); K split in two shares of 64 (the expand sums the partials); 16-wide
# rank blocks and columns (S = 2 at R 16: two rank blocks, a 40-wide slice in three blocks).
CONFIGS = {
    "prefill-tiles": PREFILL_CONFIG,
    "split-k": LoraBlockConfig(block_m=16, block_r=16, block_k=32, block_n=16),
}


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_other_tiles_match_the_reference(device, dtype, config):
    widths, rank = SLICES["S2-R16"]
    inputs = make_inputs(33, widths, rank, dtype)
    got, expected = run_both(*inputs, offsets_of(widths), device, config=CONFIGS[config])
    assert_close_to_reference(got, expected, *inputs, offsets_of(widths))


def test_column_runs_of_several_blocks_match_the_reference(device, monkeypatch):
    """With as many programs as a long prefill has, each expand program walks a run of column blocks (reading h
    once): aiming at 2 programs makes these 3 row tiles walk each slice's columns whole."""
    monkeypatch.setattr(lora_kernels, "_TARGET_PROGRAMS", 2)
    widths, rank = (130, 9), 16  # 130: three 64-wide blocks, the last of 2 columns
    inputs = make_inputs(33, widths, rank, torch.float32)
    got, expected = run_both(*inputs, offsets_of(widths), device)
    assert_close_to_reference(got, expected, *inputs, offsets_of(widths))


@pytest.mark.parametrize("num_rows", [5, 33])
def test_rows_without_an_adapter_are_left_alone(device, num_rows):
    """All rows slot -1, x and every slot NaN: nothing is read into y, and y comes back bit for bit."""
    widths, rank = SLICES["S3-R8"]
    y, x, lora_a, lora_b, _ = make_inputs(num_rows, widths, rank, torch.bfloat16)
    row_slots = torch.full((num_rows,), -1, dtype=torch.int32)
    nan = float("nan")
    got, expected = run_both(y, x.fill_(nan), lora_a.fill_(nan), lora_b.fill_(nan), row_slots, offsets_of(widths),
                             device)  # fmt: skip
    assert torch.equal(got, y) and torch.equal(expected, y)


def test_a_step_without_rows_launches_nothing(no_launch):
    stand_ins = no_launch(lora_kernels, ("_lora_shrink_kernel", "_lora_expand_kernel"))
    y = torch.empty(0, 72)
    add_lora(y, torch.empty(0, HIDDEN), torch.empty(2, 8, HIDDEN), torch.empty(2, 8, 72),
             torch.empty(0, dtype=torch.int32), (0, 72))  # fmt: skip
    assert [stand_ins[name].launches for name in stand_ins] == [0, 0]


# --- graph safety, dispatch, checks ---------------------------------------------------------------------------


def test_the_launcher_reads_no_values_so_a_cuda_graph_can_capture_it(no_launch):
    """On the meta device a tensor has a shape and no values, so any read back to the host (.item(), .tolist(),
    unique or nonzero sizing their results from the data, as the reference does) raises: the launches and the
    scratch are sized from T, K, N, S and R alone. One shrink, then one expand per slice with columns."""
    stand_ins = no_launch(lora_kernels, ("_lora_shrink_kernel", "_lora_expand_kernel"))
    meta = dict(device="meta", dtype=torch.bfloat16)
    for num_rows in (7, 300):  # the decode tiles and the prefill ones
        add_lora(torch.empty(num_rows, 73, **meta), torch.empty(num_rows, HIDDEN, **meta),
                 torch.empty(NUM_SLOTS, 3 * 16, HIDDEN, **meta), torch.empty(NUM_SLOTS, 16, 73, **meta),
                 torch.empty(num_rows, dtype=torch.int32, device="meta"), (0, 40, 40, 73))  # fmt: skip
    assert [stand_ins[name].launches for name in stand_ins] == [2, 4]  # the empty middle slice: no launch


def test_cuda_platform_keeps_the_reference_for_tensors_off_the_gpu():
    from nanoinfer.platforms.cuda import CudaPlatform

    widths, rank = SLICES["S2-R16"]
    y, x, lora_a, lora_b, row_slots = make_inputs(5, widths, rank, torch.float32)
    expected, got = y.clone(), y.clone()
    Platform().add_lora(expected, x, lora_a, lora_b, row_slots, offsets_of(widths))
    CudaPlatform("float32").add_lora(got, x, lora_a, lora_b, row_slots, offsets_of(widths))
    assert torch.equal(got, expected)


def test_inputs_that_do_not_fit_are_refused(device):
    widths, rank = SLICES["S2-R16"]
    y, x, lora_a, lora_b, row_slots = (t.to(device) for t in make_inputs(5, widths, rank, torch.float32))
    offsets = offsets_of(widths)
    with pytest.raises(ValueError, match=r"lora_a \(4, 32, 100\) and lora_b \(4, 16, 111\)"):
        add_lora(y, x, lora_a, lora_b[:, :, :111], row_slots, offsets)
    with pytest.raises(ValueError, match=r"x/y/lora_a/lora_b dtypes torch.float32/torch.float32/torch.bfloat16"):
        add_lora(y, x, lora_a.bfloat16(), lora_b, row_slots, offsets)
    with pytest.raises(ValueError, match=r"slice_offsets \(0, 72, 40\) must rise from 0 to 112"):
        add_lora(y, x, lora_a, lora_b, row_slots, (0, 72, 40))
    with pytest.raises(ValueError, match=r"row_slots \(5,\) torch.int64 must be int32"):
        add_lora(y, x, lora_a, lora_b, row_slots.long(), offsets)
