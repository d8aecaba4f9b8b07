"""The Triton linear-attention kernels (platforms/cuda/kernels/gated_delta.py) against the plain-torch ops of
attention/gated_delta.py, under the interpreter on CPU (see conftest.py): the causal conv for decode and prefill
rows, the recurrent delta rule for decode rows, and the split of a mixed step into decode rows and prefill
sequences (prefill through the reference's chunked form, and through flash-linear-attention's calling
convention with a stand-in for its kernel, which needs a GPU). Every case has GQA, a sequence without context
(its slot holds NaN, which must not be read), and most a padded row (slot -1) that must touch no slot.

Tolerances. The kernels do the reference's float32 arithmetic in the same order except for sums (over D_k in
S^T k, S^T q and the l2 norms; over the K taps of the conv), which they add up in another order: a sum of n
terms then differs by at most about n * 2^-24 times the sum of the terms' magnitudes, bounded here by
n * 2^-24 * (the largest output magnitude) times a small factor. bfloat16 inputs are exact in float32, so on top
of that each bfloat16 result differs by its roundings only: one a result for the delta rule (its output), two
for the conv (its output, then silu's), each at most one bfloat16 step of the value (2^-8 of it, relative)
when rounding to nearest even, and twice that under the interpreter, which truncates float32 -> bfloat16.
The states the kernels write are compared the same way (float32), or exactly (the conv's copies of inputs).
"""

import itertools
import os
import sys
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not installed: pip install -e '.[dev]'")

from nanoinfer.attention import gated_delta as reference
from nanoinfer.attention.metadata import AttentionMetadata
from nanoinfer.platforms import Platform
from nanoinfer.platforms.cuda.kernels import gated_delta as kernels

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
NUM_SLOTS = 7
K_HEADS, V_HEADS, K_DIM, V_DIM = 2, 6, 24, 40  # GQA 3; neither head dim a power of two, D_v not a multiple of 16
CHANNELS = 100  # not a multiple of the conv's channel blocks (64, 256)


def make_metadata(specs: list[tuple[int, int]], slots: list[int], device, host_lists: bool = True):
    """specs: (context before this step, query_len) per sequence. host_lists=False: as a CUDA graph's metadata."""
    query_lens = [query_len for _, query_len in specs]
    seq_lens = [context + query_len for context, query_len in specs]
    ints = dict(dtype=torch.int32, device=device)
    return AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64, device=device),
        query_start_loc=torch.tensor([0, *itertools.accumulate(query_lens)], **ints),
        seq_lens=torch.tensor(seq_lens, **ints), block_tables=torch.zeros(len(specs), 1, **ints),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens if host_lists else None, seq_lens_cpu=seq_lens if host_lists else None,
        state_slots=torch.tensor(slots, **ints),
    )  # fmt: skip


def fresh_slots(state: torch.Tensor, metadata) -> torch.Tensor:
    """A copy of the state cache whose slots of sequences without context hold NaN: they must not be read."""
    state = state.clone()
    for slot, query_len, seq_len in zip(metadata.state_slots.tolist(), metadata.query_lens_cpu, metadata.seq_lens_cpu):
        if slot >= 0 and seq_len == query_len:
            state[slot] = float("nan")
    return state


def delta_inputs(num_tokens: int, dtype: torch.dtype, seed: int = 0):
    """q, k, v, g (log decays <= 0, some near 0), beta in (0, 1), and an O(1) float32 state cache."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, K_HEADS, K_DIM, generator=gen).to(dtype)
    k = torch.randn(num_tokens, K_HEADS, K_DIM, generator=gen).to(dtype)
    v = torch.randn(num_tokens, V_HEADS, V_DIM, generator=gen).to(dtype)
    g = F.logsigmoid(torch.randn(num_tokens, V_HEADS, generator=gen) + 2).to(dtype)
    beta = torch.rand(num_tokens, V_HEADS, generator=gen).to(dtype)
    ssm_state = torch.randn(NUM_SLOTS, V_HEADS, K_DIM, V_DIM, generator=gen)
    return (q, k, v, g, beta), ssm_state


def assert_close(got: torch.Tensor, expected: torch.Tensor, terms: int, rounded: torch.Tensor | None = None) -> None:
    """|got - expected| within a sum of `terms` added up in another order (relative to the largest magnitude),
    plus one bfloat16 step of each magnitude in `rounded` (the values each side rounds on the way, elementwise;
    see the module docstring)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    got, expected = got.cpu().float(), expected.float()
    assert torch.equal(got.isnan(), expected.isnan())
    got, expected = got.nan_to_num(), expected.nan_to_num()
    scale = float(expected.abs().max())
    bound = 4 * terms * 2.0**-24 * scale
    if rounded is not None:
        step = 2.0**-7 if INTERPRETED else 2.0**-8  # relative: truncating loses up to a whole step
        bound = bound + step * rounded.float()
    error = (got - expected).abs()
    assert bool((error <= bound).all()), (float(error.max()), scale)


# --- causal conv ------------------------------------------------------------------------------------------

CONV_CASES = {
    # decode rows: with context, without, and a padded row
    "decode": ([(5, 1), (0, 1), (2, 1), (0, 1)], [3, 0, 6, -1]),
    # prefill: longer than a row block (16) with and without context, shorter than the state with context,
    # a decode row of the same step, and a padded sequence
    "mixed": ([(9, 37), (0, 20), (4, 2), (6, 1), (0, 3)], [2, 5, 0, 4, -1]),
}


def conv_inputs(num_tokens: int, width: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, CHANNELS + 28, generator=gen).to(dtype)[:, 28:]  # a view of a wider projection
    weight = (torch.randn(CHANNELS, width, generator=gen) * width**-0.5).to(dtype)
    conv_state = torch.randn(NUM_SLOTS, CHANNELS, width - 1, generator=gen).to(dtype)
    return x, weight, conv_state


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [4, 2])  # Qwen3-Next's 4; 2 keeps a one-column state
@pytest.mark.parametrize("case", CONV_CASES)
def test_causal_conv1d_matches_the_reference(device, dtype, width, case):
    specs, slots = CONV_CASES[case]
    metadata = make_metadata(specs, slots, "cpu")
    x, weight, conv_state = conv_inputs(sum(q for _, q in specs), width, dtype)
    conv_state = fresh_slots(conv_state, metadata)
    expected_state = conv_state.clone()
    expected = reference.causal_conv1d(x, weight, expected_state, metadata)
    got_state = conv_state.to(device, copy=True)  # copy: on CPU .to would alias
    got = kernels.causal_conv1d(x.to(device), weight.to(device), got_state, make_metadata(specs, slots, device))
    live = torch.cat([torch.full((q,), slot >= 0) for (_, q), slot in zip(specs, slots)])
    rounded = None
    if dtype != torch.float32:  # the convolution's output y, then silu(y): silu' <= 1.1 carries y's rounding
        y = reference.causal_conv1d(x, weight, conv_state.clone(), metadata, activation=None)
        rounded = (1.1 * y.float().abs() + expected.float().abs())[live]
    assert_close(got[live], expected[live], terms=width, rounded=rounded)
    assert not got[~live].cpu().any()  # a padded row's output: zeros (the reference leaves it unwritten)
    assert torch.equal(got_state.cpu().nan_to_num(), expected_state.nan_to_num())  # copies of inputs: exact


def test_causal_conv1d_without_activation(device):
    specs, slots = CONV_CASES["mixed"]
    metadata = make_metadata(specs, slots, "cpu")
    x, weight, conv_state = conv_inputs(sum(q for _, q in specs), 4, torch.float32)
    expected = reference.causal_conv1d(x, weight, conv_state.clone(), metadata, activation=None)
    got = kernels.causal_conv1d(x.to(device), weight.to(device), conv_state.to(device, copy=True),
                                make_metadata(specs, slots, device), activation=None)  # fmt: skip
    live = torch.cat([torch.full((q,), slot >= 0) for (_, q), slot in zip(specs, slots)])
    assert_close(got[live], expected[live], terms=4)


# --- the delta rule ---------------------------------------------------------------------------------------

DECODE_SPECS, DECODE_SLOTS = [(5, 1), (0, 1), (9, 1), (3, 1), (1, 1)], [3, 0, 5, -1, 6]


@pytest.mark.parametrize("dtype", DTYPES)
def test_recurrent_step_matches_the_reference(device, dtype):
    metadata = make_metadata(DECODE_SPECS, DECODE_SLOTS, "cpu")
    args, ssm_state = delta_inputs(len(DECODE_SPECS), dtype)
    ssm_state = fresh_slots(ssm_state, metadata)
    expected_state = ssm_state.clone()
    expected = reference.gated_delta_rule(*args, expected_state, metadata)
    got_state = ssm_state.to(device, copy=True)
    got = kernels.gated_delta_rule(*(a.to(device) for a in args), got_state,
                                   make_metadata(DECODE_SPECS, DECODE_SLOTS, device, host_lists=False))  # fmt: skip
    assert_close(got, expected, terms=K_DIM, rounded=None if dtype == torch.float32 else expected.abs())
    assert not got[3].cpu().any()  # the padded row
    assert_close(got_state, expected_state, terms=K_DIM)  # unused slots (1, 2, 4) and the padded row's: as given


def test_recurrent_steps_carry_the_state_from_step_to_step(device):
    """Three decode steps in a row, each continuing from the state the previous one wrote."""
    metadata = make_metadata(DECODE_SPECS, DECODE_SLOTS, "cpu")
    _, ssm_state = delta_inputs(len(DECODE_SPECS), torch.float32)
    ssm_state = fresh_slots(ssm_state, metadata)
    expected_state, got_state = ssm_state.clone(), ssm_state.to(device, copy=True)
    for step in range(3):
        specs = [(context + step, 1) for context, _ in DECODE_SPECS]
        args, _ = delta_inputs(len(specs), torch.float32, seed=step + 1)
        expected = reference.gated_delta_rule(*args, expected_state, make_metadata(specs, DECODE_SLOTS, "cpu"))
        got = kernels.gated_delta_rule(*(a.to(device) for a in args), got_state,
                                       make_metadata(specs, DECODE_SLOTS, device, host_lists=False))  # fmt: skip
        assert_close(got, expected, terms=K_DIM * (step + 1))  # the state's own differences grow step by step
    assert_close(got_state, expected_state, terms=3 * K_DIM)


def test_a_step_of_padded_rows_touches_no_slot(device):
    args, ssm_state = delta_inputs(3, torch.bfloat16)
    metadata = make_metadata([(4, 1), (0, 1), (2, 1)], [-1, -1, -1], device, host_lists=False)
    state = ssm_state.to(device, copy=True)
    out = kernels.gated_delta_rule(*(a.to(device) for a in args), state, metadata)
    assert torch.equal(state.cpu(), ssm_state) and not out.cpu().any()
    x, weight, conv_state = conv_inputs(3, 4, torch.bfloat16)
    state = conv_state.to(device, copy=True)
    out = kernels.causal_conv1d(x.to(device), weight.to(device), state, metadata)
    assert torch.equal(state.cpu(), conv_state) and not out.cpu().any()


# A prefill step with decode rows in it: a sequence over two chunks (64) with context, one without, a
# one-token sequence without context, decode rows, and a padded sequence
MIXED_SPECS, MIXED_SLOTS = [(3, 70), (2, 1), (0, 9), (0, 1), (7, 1), (0, 4)], [4, 1, 0, 6, 2, -1]


def fake_fla_chunk_gated_delta_rule(calls: list):
    """flash-linear-attention's chunk_gated_delta_rule as its docstring specifies it (q, k [1, T, H_k, D_k],
    v [1, T, H_v, D_v], g and beta [1, T, H_v], one initial state a sequence of cu_seqlens, the final states
    returned in float32), computed by the reference's chunked form: checks how the prefill path calls it."""

    def chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
              use_qk_l2norm_in_kernel=False):  # fmt: skip
        calls.append(dict(cu_seqlens=cu_seqlens.tolist(), scale=scale, l2norm=use_qk_l2norm_in_kernel))
        assert q.shape[0] == 1 and cu_seqlens.dtype == torch.long and initial_state.dtype == torch.float32
        assert initial_state.shape == (len(cu_seqlens) - 1, v.shape[2], q.shape[3], v.shape[3])
        out, final = torch.empty_like(v[0]), torch.empty_like(initial_state)
        bounds = cu_seqlens.tolist()
        for i, (start, end) in enumerate(itertools.pairwise(bounds)):
            rows = slice(start, end)
            prepared = reference._prepare(q[0, rows], k[0, rows], v[0, rows], g[0, rows], beta[0, rows])
            o, final[i] = reference.chunked_gated_delta_rule(*prepared, initial_state[i].clone())
            out[rows] = o.transpose(0, 1).to(v.dtype)
        return out[None], final

    return lambda: chunk


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prefill", ["reference", "fla"])
def test_a_mixed_step_splits_decode_rows_and_prefill_sequences(device, monkeypatch, dtype, prefill):
    calls = []
    monkeypatch.setattr(kernels, "fla_chunk_gated_delta_rule",
                        fake_fla_chunk_gated_delta_rule(calls) if prefill == "fla" else lambda: None)  # fmt: skip
    metadata = make_metadata(MIXED_SPECS, MIXED_SLOTS, "cpu")
    args, ssm_state = delta_inputs(metadata.query_start_loc[-1].item(), dtype)
    ssm_state = fresh_slots(ssm_state, metadata)
    expected_state = ssm_state.clone()
    expected = reference.gated_delta_rule(*args, expected_state, metadata)
    got_state = ssm_state.to(device, copy=True)
    got = kernels.gated_delta_rule(*(a.to(device) for a in args), got_state, make_metadata(MIXED_SPECS, MIXED_SLOTS,
                                                                                           device))  # fmt: skip
    # The chunked form's float32 sums run over a chunk's 64 rows as well as D_k
    assert_close(got, expected, terms=K_DIM + 64,
                 rounded=None if dtype == torch.float32 else expected.abs())
    assert not got[-4:].cpu().any()  # the padded sequence's rows
    assert_close(got_state, expected_state, terms=K_DIM + 64)
    if prefill == "fla":  # only the two sequences of more than one token (the padded one skipped), normalised there
        assert calls == [dict(cu_seqlens=[0, 70, 79], scale=K_DIM**-0.5, l2norm=True)]


def test_a_step_of_prompts_only_passes_every_row_to_the_prefill_path(device, monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "fla_chunk_gated_delta_rule", fake_fla_chunk_gated_delta_rule(calls))
    specs, slots = [(0, 5), (2, 3)], [1, 3]
    metadata = make_metadata(specs, slots, "cpu")
    args, ssm_state = delta_inputs(8, torch.float32)
    expected_state = ssm_state.clone()
    expected = reference.gated_delta_rule(*args, expected_state, metadata)
    got_state = ssm_state.to(device, copy=True)
    got = kernels.gated_delta_rule(*(a.to(device) for a in args), got_state, make_metadata(specs, slots, device))
    assert_close(got, expected, terms=K_DIM + 64)
    assert_close(got_state, expected_state, terms=K_DIM + 64)
    assert calls[0]["cu_seqlens"] == [0, 5, 8]


# --- graph safety, dispatch, the optional package ---------------------------------------------------------


def test_a_decode_step_reads_nothing_back_so_a_cuda_graph_can_capture_it(no_launch):
    """On the meta device a tensor has a shape and no values, so any read back to the host (.item(), .tolist())
    raises; the metadata carries no host lists, as a CUDA graph's does not."""
    stand_ins = no_launch(kernels, ("_causal_conv1d_kernel", "_fused_recurrent_gated_delta_rule_kernel"))
    metadata = make_metadata([(3, 1)] * 4, [0, 1, 2, -1], "meta", host_lists=False)
    meta = dict(device="meta", dtype=torch.bfloat16)
    x = kernels.causal_conv1d(torch.empty(4, 2 * K_HEADS * K_DIM + V_HEADS * V_DIM, **meta),
                              torch.empty(2 * K_HEADS * K_DIM + V_HEADS * V_DIM, 4, **meta),
                              torch.empty(NUM_SLOTS, 2 * K_HEADS * K_DIM + V_HEADS * V_DIM, 3, **meta), metadata)
    q, k, v = x.split([K_HEADS * K_DIM, K_HEADS * K_DIM, V_HEADS * V_DIM], dim=-1)
    out = kernels.gated_delta_rule(q.view(4, K_HEADS, K_DIM), k.view(4, K_HEADS, K_DIM), v.view(4, V_HEADS, V_DIM),
                                   torch.empty(4, V_HEADS, device="meta"), torch.empty(4, V_HEADS, **meta),
                                   torch.empty(NUM_SLOTS, V_HEADS, K_DIM, V_DIM, device="meta"), metadata)
    assert out.shape == (4, V_HEADS, V_DIM) and out.device.type == "meta"
    assert [stand_ins[name].launches for name in stand_ins] == [1, 1]


def test_cuda_platform_keeps_the_reference_for_tensors_off_the_gpu():
    from nanoinfer.platforms.cuda import CudaPlatform

    metadata = make_metadata(MIXED_SPECS, MIXED_SLOTS, "cpu")
    args, ssm_state = delta_inputs(metadata.query_start_loc[-1].item(), torch.float32)
    expected_state, got_state = ssm_state.clone(), ssm_state.clone()
    expected = Platform().gated_delta_rule(*args, expected_state, metadata)
    assert torch.equal(CudaPlatform("float32").gated_delta_rule(*args, got_state, metadata), expected)
    assert torch.equal(got_state, expected_state)
    x, weight, conv_state = conv_inputs(len(args[0]), 4, torch.float32)
    expected_conv, got_conv = conv_state.clone(), conv_state.clone()
    expected = Platform().causal_conv1d(x, weight, expected_conv, metadata)
    live = torch.cat([torch.full((q,), slot >= 0) for (_, q), slot in zip(MIXED_SPECS, MIXED_SLOTS)])
    got = CudaPlatform("float32").causal_conv1d(x, weight, got_conv, metadata)
    assert torch.equal(got[live], expected[live]) and torch.equal(got_conv, expected_conv)


@pytest.mark.parametrize(("version", "usable"), [("0.4.2", False), ("0.5.0", True), ("0.6.0", True)])
def test_flash_linear_attention_is_used_from_the_version_with_more_value_heads_than_key_heads(
    monkeypatch, version, usable
):
    fla, ops = ModuleType("fla"), ModuleType("fla.ops.gated_delta_rule")
    fla.__version__ = version
    ops.chunk_gated_delta_rule = chunk = object()
    monkeypatch.setitem(sys.modules, "fla", fla)
    monkeypatch.setitem(sys.modules, "fla.ops", ModuleType("fla.ops"))
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", ops)
    kernels.fla_chunk_gated_delta_rule.cache_clear()
    try:
        assert kernels.fla_chunk_gated_delta_rule() is (chunk if usable else None)
    finally:
        kernels.fla_chunk_gated_delta_rule.cache_clear()


def test_without_flash_linear_attention_prefill_takes_the_reference(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)  # import fla raises ImportError
    kernels.fla_chunk_gated_delta_rule.cache_clear()
    try:
        assert kernels.fla_chunk_gated_delta_rule() is None
    finally:
        kernels.fla_chunk_gated_delta_rule.cache_clear()


def test_bad_shapes_are_refused(device):
    metadata = make_metadata(DECODE_SPECS, DECODE_SLOTS, device)
    args, ssm_state = delta_inputs(len(DECODE_SPECS), torch.float32)
    args = [a.to(device) for a in args]
    with pytest.raises(ValueError, match="ssm_state"):
        kernels.gated_delta_rule(*args, ssm_state[..., :-1].to(device), metadata)
    with pytest.raises(ValueError, match="must be float32"):
        kernels.gated_delta_rule(*args, ssm_state.to(device, torch.bfloat16), metadata)
    x, weight, conv_state = conv_inputs(len(DECODE_SPECS), 4, torch.float32)
    with pytest.raises(ValueError, match="conv_state"):
        kernels.causal_conv1d(x.to(device), weight.to(device), conv_state[..., :2].to(device), metadata)


def test_a_failing_kernel_at_start_up_falls_back_to_the_reference_and_eager_decode(monkeypatch):
    """prepare_model runs the kernels once through a linear-attention layer; where they fail (a Triton or driver
    this code was not tried with) the layers take the reference, and decode runs eager: the reference reads the
    step's lengths back to the host."""
    from types import SimpleNamespace

    from nanoinfer.models.layers.gated_delta_net import GatedDeltaNet
    from nanoinfer.platforms.cuda import CudaPlatform, check_gated_delta

    layer = GatedDeltaNet(32, K_HEADS, V_HEADS, 16, 8, 4, 1e-6)
    torch.nn.init.normal_(layer.conv1d_weight)
    assert check_gated_delta(layer) is None

    def broken(*args, **kwargs):
        raise RuntimeError("PassManager::run failed\nlong compiler log")

    monkeypatch.setattr(kernels, "gated_delta_rule", broken)
    assert check_gated_delta(layer) == "RuntimeError: PassManager::run failed"
    platform = CudaPlatform("float32")
    config = SimpleNamespace(enforce_eager=False, tensor_parallel_size=1)
    assert platform.uses_cuda_graphs(config, "triton")
    platform.prepare_model(torch.nn.ModuleList([layer]))
    assert platform.triton_gated_delta is False and not platform.uses_cuda_graphs(config, "triton")
