"""The C++ CPU kernels for RMSNorm, rotary and SiLU-and-mul against the torch formulas they replace."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from nanoinfer.models.layers.norm import RMSNorm
from nanoinfer.models.layers.rotary import RotaryEmbedding
from nanoinfer.platforms import Platform
from nanoinfer.platforms.cpu import CpuKernelPlatform
from nanoinfer.platforms.cpu.ops import cpu_ops
from nanoinfer.platforms.interface import _rotate_half

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="the CPU kernels could not be built here")


def torch_rms_norm(x, weight, eps):
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("shape", [(1, 576), (37, 576), (5, 9, 64), (3, 100)])  # 100: not a multiple of 8
def test_rms_norm(shape):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(shape, generator=gen) * 3, torch.randn(shape[-1], generator=gen)
    torch.testing.assert_close(cpu_ops().rms_norm(x, w, 1e-5), torch_rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-5)


def test_rms_norm_of_strided_heads():
    """Qwen3's per-head q norm reads heads straight out of the fused qkv output (rows not back to back)."""
    qkv = torch.randn(6, 9 * 64 + 2 * 3 * 64)
    q = qkv[:, : 9 * 64].view(6, 9, 64)
    w = torch.randn(64)
    torch.testing.assert_close(cpu_ops().rms_norm(q, w, 1e-6), torch_rms_norm(q, w, 1e-6), rtol=1e-5, atol=1e-5)


def test_fused_add_rms_norm_updates_both_in_place():
    gen = torch.Generator().manual_seed(1)
    x, residual, w = torch.randn(11, 100, generator=gen), torch.randn(11, 100, generator=gen), torch.randn(100)
    expected_sum = x + residual
    expected = torch_rms_norm(expected_sum, w, 1e-5)
    cpu_ops().fused_add_rms_norm(x, residual, w, 1e-5)
    torch.testing.assert_close(residual, expected_sum, rtol=0, atol=0)
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hidden", [576, 96, 100])
@pytest.mark.parametrize("rows", [2, 7, 64, 301])
def test_bfloat16_fused_add_rms_norm_rows_in_pairs_keep_each_rows_bits(hidden, rows):
    """bfloat16 rows go two at a time where AVX-512 is built (csrc/fused_ops.cpp, add_norm_rows2): each row's
    bits must be those it gets alone (one row a call takes the one-row path), in the residual and the output."""
    gen = torch.Generator().manual_seed(hidden + rows)
    x = (torch.randn(rows, hidden, generator=gen) * 3).bfloat16()
    residual = torch.randn(rows, hidden, generator=gen).bfloat16()
    w = torch.randn(hidden, generator=gen).bfloat16()
    together_x, together_r = x.clone(), residual.clone()
    cpu_ops().fused_add_rms_norm(together_x, together_r, w, 1e-6)
    alone_x, alone_r = x.clone(), residual.clone()
    for i in range(rows):
        cpu_ops().fused_add_rms_norm(alone_x[i : i + 1], alone_r[i : i + 1], w, 1e-6)
    assert torch.equal(together_r.view(torch.int16), alone_r.view(torch.int16))
    assert torch.equal(together_x.view(torch.int16), alone_x.view(torch.int16))
    expected = torch_rms_norm(alone_r.float(), w.float(), 1e-6)
    torch.testing.assert_close(together_x.float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("intermediate", [1536, 100])
def test_silu_and_mul(intermediate):
    x = torch.randn(17, 2 * intermediate, generator=torch.Generator().manual_seed(2)) * 8  # deep in both tails
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_ops().silu_and_mul(x), F.silu(gate) * up, rtol=1e-5, atol=1e-5)


def test_silu_and_mul_extremes_are_finite():
    x = torch.tensor([[-1000.0, -90.0, 0.0, 90.0, 1000.0, 1.0, -1.0, 3.0] + [1.0] * 8])
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_ops().silu_and_mul(x), F.silu(gate) * up, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_in_place_on_qkv_views_matches_torch(tiny_hf_config, head_dim):
    rotary = RotaryEmbedding(tiny_hf_config, head_dim, max_position=300)
    gen = torch.Generator().manual_seed(3)
    num_tokens, heads, kv_heads = 7, 4, 2
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    q = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    positions = torch.tensor([0, 1, 5, 64, 100, 255, 299])
    cos, sin = rotary.cos[positions].unsqueeze(1), rotary.sin[positions].unsqueeze(1)
    expected_q = q * cos + _rotate_half(q) * sin
    expected_k = k * cos + _rotate_half(k) * sin
    out_q, out_k = rotary(positions, q, k)
    assert out_q.data_ptr() == q.data_ptr()  # rotated in place, in the qkv buffer
    torch.testing.assert_close(out_q, expected_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_k, expected_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(qkv[:, (heads + kv_heads) * head_dim :], v_before, rtol=0, atol=0)  # v untouched


@pytest.mark.parametrize("head_dim", [64, 128, 48])
@pytest.mark.parametrize("num_tokens", [3, 64])
def test_bfloat16_rotary_rounds_as_the_torch_ops_do(tiny_hf_config, head_dim, num_tokens):
    """HF's bfloat16 rotary (cos / sin cast to bfloat16, each op rounded), bit for bit: one thread and two, cos /
    sin rounded once a position (half a head a multiple of 16) or per head (48)."""
    rotary = RotaryEmbedding(tiny_hf_config, head_dim, max_position=300)
    gen = torch.Generator().manual_seed(head_dim + num_tokens)
    heads, kv_heads = 9, 3
    qkv = (torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 2).bfloat16()
    q = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    positions = torch.randint(0, 300, (num_tokens,), generator=gen)
    cos = rotary.cos[positions].unsqueeze(1).bfloat16()
    sin = rotary.sin[positions].unsqueeze(1).bfloat16()
    expected_q = q * cos + _rotate_half(q) * sin
    expected_k = k * cos + _rotate_half(k) * sin
    out_q, out_k = rotary(positions, q, k)
    assert torch.equal(out_q.view(torch.int16), expected_q.view(torch.int16))
    assert torch.equal(out_k.view(torch.int16), expected_k.view(torch.int16))


def test_the_kernel_platform_matches_plain_torch_and_falls_back_where_its_kernels_do_not_apply():
    """The C++ ops give the plain-torch platform's results in float32; other dtypes (float16) take the torch
    formulas themselves, bit for bit."""
    kernels, plain = CpuKernelPlatform(cpu_ops()), Platform()
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, generator=gen)
    x, residual = torch.randn(5, 64, generator=gen), torch.randn(5, 64, generator=gen)
    fused_out, fused_res = kernels.rms_norm(x.clone(), weight, 1e-5, residual.clone())
    out, res = plain.rms_norm(x.clone(), weight, 1e-5, residual.clone())
    torch.testing.assert_close(out, fused_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res, fused_res, rtol=0, atol=0)
    gate_up = torch.randn(3, 32, generator=gen)
    torch.testing.assert_close(kernels.silu_and_mul(gate_up), F.silu(gate_up[:, :16]) * gate_up[:, 16:])
    half = x.half(), weight.half()
    assert torch.equal(kernels.rms_norm(*half, 1e-5), plain.rms_norm(*half, 1e-5))
    assert torch.equal(kernels.silu_and_mul(gate_up.half()), plain.silu_and_mul(gate_up.half()))


def _bf16_mismatch(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Fraction of elements that differ; those that do differ by about a bfloat16 step (a step of the
    rounded intermediate, scaled by what multiplies it after, e.g. RMSNorm's weight)."""
    assert actual.dtype == expected.dtype == torch.bfloat16 and actual.shape == expected.shape
    diff = (actual.float() - expected.float()).abs()
    assert bool(torch.all(diff <= expected.float().abs() * 2**-6)), "more than a bfloat16 step apart"
    return float((diff > 0).float().mean())


def test_bfloat16_kernels_round_as_the_torch_formulas(tiny_hf_config):
    """In bfloat16 the C++ RMSNorm (plain and fused with the residual add), SiLU-and-mul and rotary round
    where the torch ops (HF's modules) round: all but a rare element equal (the float32 sum of squares in
    another order), none more than a step apart."""
    gen = torch.Generator().manual_seed(5)
    norm = RMSNorm(576, 1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=gen))
    x, residual = (torch.randn(37, 576, generator=gen) * 3).bfloat16(), torch.randn(37, 576, generator=gen).bfloat16()
    gate_up = (torch.randn(37, 2 * 100, generator=gen) * 4).bfloat16()
    rotary = RotaryEmbedding(tiny_hf_config, 64, max_position=300)
    qkv = torch.randn(7, (4 + 2 * 2) * 64, generator=gen).bfloat16()
    positions = torch.tensor([0, 1, 5, 64, 100, 255, 299])

    @torch.no_grad()
    def run(platform):
        norm.platform = rotary.platform = platform
        plain = norm(x.clone())
        fused, fused_res = norm(x.clone(), residual.clone())
        q, k = qkv.clone()[:, : 4 * 64].view(7, 4, 64), qkv.clone()[:, 4 * 64 : 6 * 64].view(7, 2, 64)
        rq, rk = rotary(positions, q, k)
        return [plain, fused, fused_res, platform.silu_and_mul(gate_up), rq, rk]

    kernel = run(CpuKernelPlatform(cpu_ops()))
    reference = run(Platform())
    assert torch.equal(kernel[2], reference[2])  # the residual sum: one rounding, exact
    rates = [_bf16_mismatch(a, b) for a, b in zip(kernel, reference)]
    assert max(rates) < 0.01, rates


@pytest.fixture
def tiny_hf_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 7, 8, 9, 100, 49152])  # below, at and across the 8-lane width
def test_greedy_argmax_equals_torch(vocab, dtype):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(13, vocab, generator=gen).to(dtype)  # bfloat16: many ties, the first must win
    assert torch.equal(cpu_ops().greedy_argmax(logits), torch.argmax(logits.float(), dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_argmax_ties_infinities_and_nans_as_torch(dtype):
    """The first index of the maximum wins a tie; a row of -inf gives 0; a NaN anywhere (vector body or
    tail) gives the first NaN, as torch.argmax treats NaN as the largest value."""
    logits = torch.zeros(6, 21, dtype=dtype)
    logits[0, [3, 17]] = 5.0  # tie: 3
    logits[1, [9, 20]] = 5.0  # tie across the vector body and the tail: 9
    logits[2] = float("-inf")
    logits[3, [4, 12]] = float("nan")
    logits[4, 19] = float("nan")  # in the scalar tail
    logits[5, 20] = float("inf")
    assert torch.equal(cpu_ops().greedy_argmax(logits), torch.argmax(logits, dim=-1))
    assert cpu_ops().greedy_argmax(logits).tolist() == [3, 9, 0, 4, 19, 20]


def test_greedy_argmax_reads_strided_rows():
    wide = torch.randn(5, 300)
    logits = wide[:, 10:210]  # rows not back to back
    assert torch.equal(cpu_ops().greedy_argmax(logits), torch.argmax(logits, dim=-1))


def test_the_platform_argmax_falls_back_to_torch_off_the_kernel():
    """The kernel takes float32 and bfloat16 CPU rows; other dtypes (and empty vocabularies) stay on
    torch.argmax."""
    argmax = CpuKernelPlatform(cpu_ops()).argmax
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        logits = torch.randn(4, 50, generator=gen).to(dtype)
        assert torch.equal(argmax(logits), torch.argmax(logits.float(), dim=-1))


def test_kernels_are_built_with_this_environments_ninja(monkeypatch, tmp_path):
    """Two ninja versions keep incompatible build logs, so the one PATH finds first must not depend on whether
    the venv is activated: the build (and its up-to-date check) runs with the environment's own ninja first."""
    import sysconfig

    import torch.utils.cpp_extension

    from nanoinfer.platforms.cpu import ops as cpu_ops_module

    scripts = tmp_path / "bin"
    scripts.mkdir()
    (scripts / "ninja").write_text("#!/bin/sh\n")
    (scripts / "ninja").chmod(0o755)
    monkeypatch.setattr(sysconfig, "get_path", lambda name, *a, **k: str(scripts) if name == "scripts" else None)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    seen = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kwargs: seen.append(os.environ["PATH"]) or "built")
    monkeypatch.setattr(cpu_ops_module, "_module", None)
    monkeypatch.setattr(cpu_ops_module, "_failed", False)
    monkeypatch.setattr(cpu_ops_module, "_is_built", lambda name: True)
    assert cpu_ops_module.cpu_ops() == "built"
    assert seen == [f"{scripts}{os.pathsep}/usr/bin:/bin"]
    assert os.environ["PATH"] == "/usr/bin:/bin"  # restored
