"""The CPU linear-attention ops (csrc/gated_delta.cpp through platforms/cpu/gated_delta.py) against the reference,
nanoinfer.attention.gated_delta, on seeded random steps.

Tolerances, from what each side rounds (output scale: the reference's largest magnitude; 2^-24 ~ 6e-8 a float32
ulp):
- float32, one token (the decode kernel, and any one-token row): both compute in float32 the same sums in other
  orders (the kernel decays S^T k instead of S, fuses multiply-adds, and sums a column's D_k products in another
  order), each a few ulps of sums within a small factor of the scale, the state's entries being O(1): 1e-5 of
  the scale is over 100 ulps of margin, while a wrong decay, beta, norm, scale or head is off by O(1) of it.
- float32, a prompt chunk against the recurrent form (reference.recurrent_gated_delta_rule, the kernel's exact
  spec): the same per-token rounding, carried in the state from token to token. The rule's step,
  S -> exp(g) (I - beta k k^T) S + ..., is non-expansive (|k| = 1; beta, exp(g) in [0, 1]), so a token's rounding
  is never magnified, only added to: over 300 tokens as a random walk, sqrt(300) x 4 ulps ~ 70 ulps ~ 4e-6 of the
  scale (measured: under 6e-7, the decay forgetting most of it).
- float32, a prompt chunk against the chunked form (reference.gated_delta_rule, what the other platforms run):
  besides the above, the chunked form sums each 64-token chunk's terms in matrix products and solves a unit
  triangular system for its corrections (off-diagonal entries beta k_i.k_j, about D_k^-1/2 for these random
  keys: well conditioned), so its own rounding is larger: 2e-5 of the scale (measured: under 1.5e-6).
- bfloat16 inputs: both widen them to float32 and compute as above, and round the output once, so a value
  whose float32 results straddle a rounding boundary differs by one bfloat16 ulp (2^-7 relative).
- the convolution in bfloat16: the sum of its K products is rounded (conv1d's output) and silu's result again;
  a sum in another order may round to the neighbouring value before silu: up to two ulps (2^-6 relative).
  Its state is a copy of inputs: equal bits.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nanoinfer.attention import gated_delta as reference
from nanoinfer.platforms.cpu.ops import cpu_ops

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="the C++ extension is not built here (no compiler)")

NUM_SLOTS = 9
UNUSED = 7.0  # what the slots no sequence names hold: they must keep it


def make_step(specs, *, heads_k, heads_v, dim_k, dim_v, dtype, seed, conv_channels=48, conv_width=4):
    """One step's inputs. specs: (query_len, context_len, slot) per sequence, rows back to back; slot -1 a padded
    row. q, k, v are views of one [T, 2 H_k D_k + H_v D_v] tensor, as the model splits the convolution's output.
    Every slot holds UNUSED but those of the sequences with context, which hold random states (N(0, 1))."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    T = sum(n for n, _, _ in specs)
    mixed = randn(T, 2 * heads_k * dim_k + heads_v * dim_v).to(dtype)
    q, k, v = mixed.split([heads_k * dim_k, heads_k * dim_k, heads_v * dim_v], dim=1)
    ssm_state = torch.full((NUM_SLOTS, heads_v, dim_k, dim_v), UNUSED)
    conv_state = torch.full((NUM_SLOTS, conv_channels, conv_width - 1), UNUSED).to(dtype)
    for _, context, slot in specs:
        if context and slot >= 0:
            ssm_state[slot] = randn(heads_v, dim_k, dim_v)
            conv_state[slot] = randn(conv_channels, conv_width - 1).to(dtype)
    return SimpleNamespace(
        q=q.view(T, heads_k, dim_k), k=k.view(T, heads_k, dim_k), v=v.view(T, heads_v, dim_v),
        g=-2 * torch.rand(T, heads_v, generator=gen),  # log decay: exp(g) in [0.14, 1]
        beta=torch.rand(T, heads_v, generator=gen).to(dtype), ssm_state=ssm_state,
        x=randn(T, conv_channels).to(dtype), conv_weight=(randn(conv_channels, conv_width) / 2).to(dtype),
        conv_state=conv_state,
        metadata=SimpleNamespace(state_slots=torch.tensor([s for _, _, s in specs], dtype=torch.int32),
                                 query_lens_cpu=[n for n, _, _ in specs],
                                 seq_lens_cpu=[n + context for n, context, _ in specs]),
    )  # fmt: skip


def platform():
    from nanoinfer.platforms.cpu import CpuKernelPlatform

    return CpuKernelPlatform(cpu_ops())


def run_rule(step, op):
    state = step.ssm_state.clone()
    out = op(step.q, step.k, step.v, step.g, step.beta, state, step.metadata)
    return out, state


def run_conv(step, op):
    state = step.conv_state.clone()
    return op(step.x, step.conv_weight, state, step.metadata), state


RECURRENT_ATOL = 4e-6  # of the scale: a prompt chunk against the recurrent form (see the docstring)
CHUNKED_ATOL = 2e-5  # ... against the chunked form


def assert_close(out, ref, rtol=0.0, atol=1e-5):
    """float32 (and the float32 states): atol of the scale; bfloat16 outputs: plus rtol of each value."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol * scale)


def bf16_rtol(dtype, ulps=1):
    return 0.0 if dtype == torch.float32 else ulps * 2.0**-7


def recurrent_reference(step):
    """Every sequence's rows token by token (reference.recurrent_gated_delta_rule, the recurrent form), laid out
    as reference.gated_delta_rule lays them: returns (out, the state cache after the step)."""
    state, out, start = step.ssm_state.clone(), torch.zeros_like(step.v), 0
    meta = step.metadata
    for n, seq_len, slot in zip(meta.query_lens_cpu, meta.seq_lens_cpu, meta.state_slots.tolist()):
        rows, start = slice(start, start + n), start + n
        if slot < 0:
            continue
        initial = state[slot].clone() if seq_len > n else torch.zeros_like(state[slot])
        inputs = reference._prepare(step.q[rows], step.k[rows], step.v[rows], step.g[rows], step.beta[rows])
        o, state[slot] = reference.recurrent_gated_delta_rule(*inputs, initial)
        out[rows] = o.to(out.dtype)
    return out, state


def padded_rows(specs):
    """The rows of the sequences with slot -1."""
    rows, start = [], 0
    for n, _, slot in specs:
        rows += list(range(start, start + n)) if slot < 0 else []
        start += n
    return rows


def assert_untouched(state, step):
    """The slots no sequence with a slot names keep what they held (a padded row's -1 is not the last slot)."""
    named = {slot for slot in step.metadata.state_slots.tolist() if slot >= 0}
    for slot in range(NUM_SLOTS):
        if slot not in named:
            assert torch.equal(state[slot], torch.full_like(state[slot], UNUSED))


DECODE_SHAPES = [(4, 4, 128, 128), (2, 4, 64, 128), (2, 2, 24, 40), (1, 3, 16, 72)]  # H_k, H_v, D_k, D_v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: "Hk{}-Hv{}-Dk{}-Dv{}".format(*s))
@pytest.mark.parametrize("batch", [1, 5])
def test_decode_step_matches_reference(dtype, shape, batch):
    """A decode step (one row a sequence, each with context), GQA (H_v a multiple of H_k) and widths that are not
    whole vectors included; the states change only at the step's slots."""
    heads_k, heads_v, dim_k, dim_v = shape
    slots = torch.randperm(NUM_SLOTS, generator=torch.Generator().manual_seed(batch))[:batch].tolist()
    step = make_step([(1, 3 + i, slot) for i, slot in enumerate(slots)], heads_k=heads_k, heads_v=heads_v,
                     dim_k=dim_k, dim_v=dim_v, dtype=dtype, seed=sum(shape) + batch)  # fmt: skip
    out, state = run_rule(step, platform().gated_delta_rule)
    ref, ref_state = run_rule(step, reference.gated_delta_rule)
    assert_close(out, ref, rtol=0.0 if dtype == torch.float32 else 2.0**-7)
    assert_close(state, ref_state)
    assert_untouched(state, step)

    out, state = run_conv(step, platform().causal_conv1d)
    ref, ref_state = run_conv(step, reference.causal_conv1d)
    assert_close(out, ref, rtol=0.0 if dtype == torch.float32 else 2.0**-6)
    assert torch.equal(state, ref_state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_mixed_step_matches_reference(dtype):
    """Prompt chunks (with and without context, over one chunk of the chunked form) between decode rows, a
    one-token prompt (no context: its slot, holding UNUSED, is not read) and a padded row (slot -1: output zeros,
    no slot written): one call of the prefill kernels."""
    specs = [(1, 9, 4), (70, 0, 0), (1, 0, 2), (1, 12, 7), (1, 0, -1), (5, 20, 3), (1, 1, 5)]
    step = make_step(specs, heads_k=2, heads_v=4, dim_k=32, dim_v=48, dtype=dtype, seed=11)
    out, state = run_rule(step, platform().gated_delta_rule)
    ref, ref_state = run_rule(step, reference.gated_delta_rule)
    assert_close(out, ref, rtol=bf16_rtol(dtype), atol=CHUNKED_ATOL)
    assert_close(state, ref_state, atol=CHUNKED_ATOL)
    assert_untouched(state, step)
    padded = sum(n for n, _, _ in specs[:4])
    assert not out[padded].any()

    out, state = run_conv(step, platform().causal_conv1d)
    ref, ref_state = run_conv(step, reference.causal_conv1d)
    rows = [r for r in range(out.shape[0]) if r != padded]  # the reference leaves a padded row's output unwritten
    assert_close(out[rows], ref[rows], rtol=bf16_rtol(dtype, ulps=2))
    assert torch.equal(state, ref_state)
    assert not out[padded].any()


# (query_len, context_len, slot): a long prompt without context, one continuing a long context, short chunks with
# and without, one-token rows with and without context, and a padded sequence of several rows.
PREFILL_SPECS = [(300, 0, 4), (3, 11, 1), (1, 9, 7), (40, 0, 0), (2, 0, -1), (7, 300, 3), (1, 0, 8), (2, 5, 6)]
PREFILL_SHAPES = [(4, 4, 128, 128), (2, 4, 32, 48), (1, 3, 16, 72), (2, 2, 24, 40)]  # H_k, H_v, D_k, D_v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", PREFILL_SHAPES, ids=lambda s: "Hk{}-Hv{}-Dk{}-Dv{}".format(*s))
def test_prefill_step_matches_the_recurrent_form(dtype, shape):
    """A step of prompt chunks through gated_delta_prefill: tightly against the recurrent form it runs, more
    loosely against the chunked form; GQA, widths that are not whole vectors (or not even one) included. A padded
    sequence's rows are zeros and no slot but the named ones changes."""
    heads_k, heads_v, dim_k, dim_v = shape
    step = make_step(PREFILL_SPECS, heads_k=heads_k, heads_v=heads_v, dim_k=dim_k, dim_v=dim_v, dtype=dtype,
                     seed=sum(shape))  # fmt: skip
    out, state = run_rule(step, platform().gated_delta_rule)
    ref, ref_state = recurrent_reference(step)
    assert_close(out, ref, rtol=bf16_rtol(dtype), atol=RECURRENT_ATOL)
    assert_close(state, ref_state, atol=RECURRENT_ATOL)
    assert_untouched(state, step)
    assert not out[padded_rows(PREFILL_SPECS)].any()

    chunked, chunked_state = run_rule(step, reference.gated_delta_rule)
    assert_close(out, chunked, rtol=bf16_rtol(dtype), atol=CHUNKED_ATOL)
    assert_close(state, chunked_state, atol=CHUNKED_ATOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("width", [2, 4, 5])
def test_conv_prefill_step_matches_reference(dtype, width):
    """A step of prompt chunks through causal_conv1d_prefill, over several blocks of channels and a remainder
    (1030 = 2 x 512 + 6): chunks shorter than the window (their slot's inputs shift), with and without context,
    one-token rows; the states equal the reference's bits, a padded sequence's rows are zeros."""
    step = make_step(PREFILL_SPECS, heads_k=1, heads_v=1, dim_k=8, dim_v=8, dtype=dtype, seed=width,
                     conv_channels=1030, conv_width=width)  # fmt: skip
    out, state = run_conv(step, platform().causal_conv1d)
    ref, ref_state = run_conv(step, reference.causal_conv1d)
    padded = padded_rows(PREFILL_SPECS)
    rows = [r for r in range(out.shape[0]) if r not in padded]  # the reference leaves them unwritten
    assert_close(out[rows], ref[rows], rtol=bf16_rtol(dtype, ulps=2))
    assert torch.equal(state, ref_state)
    assert not out[padded].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_one_token_rows_get_the_decode_kernels_bits(dtype):
    """The prefill kernel's first token is the decode kernel's step, operation for operation (the same norms,
    sums in the same order per column): on widths of whole vectors on every target (D_v = 128), equal bits."""
    specs = [(1, 9, 4), (1, 0, 0), (1, 12, 7), (1, 0, -1), (1, 3, 3)]
    step = make_step(specs, heads_k=2, heads_v=4, dim_k=128, dim_v=128, dtype=dtype, seed=21)
    g, beta = step.g.float().contiguous(), step.beta.float().contiguous()
    has_context = torch.tensor([c > 0 for _, c, _ in specs])
    outs, states = [], []
    for prefill in (False, True):
        state, out = step.ssm_state.clone(), torch.empty(step.v.shape, dtype=dtype)
        if prefill:
            starts = torch.arange(len(specs) + 1)
            cpu_ops().gated_delta_prefill(step.q, step.k, step.v, g, beta, state, step.metadata.state_slots, starts,
                                          out, has_context)  # fmt: skip
        else:
            cpu_ops().gated_delta_decode(step.q, step.k, step.v, g, beta, state, step.metadata.state_slots, out,
                                         has_context)  # fmt: skip
        outs.append(out)
        states.append(state)
    assert torch.equal(outs[0], outs[1]) and torch.equal(states[0], states[1])


def test_float16_runs_the_reference():
    step = make_step([(1, 4, 2), (4, 0, 5)], heads_k=2, heads_v=2, dim_k=16, dim_v=16, dtype=torch.float16, seed=13)
    for op, run in ((reference.gated_delta_rule, run_rule), (reference.causal_conv1d, run_conv)):
        out, state = run(step, getattr(platform(), op.__name__))
        ref, ref_state = run(step, op)
        assert torch.equal(out, ref) and torch.equal(state, ref_state)


def test_kernel_checks_its_slots():
    q = torch.randn(1, 1, 16)
    with pytest.raises(RuntimeError, match="slot"):
        cpu_ops().gated_delta_decode(q, q, q, torch.zeros(1, 1), torch.ones(1, 1), torch.zeros(2, 1, 16, 16),
                                     torch.tensor([2], dtype=torch.int32), torch.empty_like(q))  # fmt: skip


def test_prefill_kernels_check_query_start_loc():
    q, x = torch.randn(3, 1, 16), torch.randn(3, 8)
    rule = (q, q, q, torch.zeros(3, 1), torch.ones(3, 1), torch.zeros(2, 1, 16, 16))
    conv = (x, torch.randn(8, 4), torch.zeros(2, 8, 3))
    slots = torch.tensor([0, 1], dtype=torch.int32)
    for starts, match in (([0, 1, 2], "from 0 to 3"), ([0, 2, 1, 3], "of 3 values"), ([0, 4, 3], "non-decreasing")):
        with pytest.raises(RuntimeError, match=match):
            cpu_ops().gated_delta_prefill(*rule, slots, torch.tensor(starts), torch.empty_like(q))
        with pytest.raises(RuntimeError, match=match):
            cpu_ops().causal_conv1d_prefill(*conv, slots, torch.tensor(starts), torch.empty_like(x))
