"""The Triton small-op kernels (kernels/fused_ops.py) against the torch code they replace (model/layers.py).

Under the interpreter (CPU) Triton truncates float32 -> bfloat16 where compiled code rounds to nearest even,
so each rounding may land one bfloat16 ulp away; compiled on CUDA the results must be bit-identical except
where a float32 sum is added in another order (RMSNorm's mean of squares).
"""

import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: pip install -e '.[dev]'")

from nanoinfer.models.layers.norm import RMSNorm
from nanoinfer.models.layers.rotary import RotaryEmbedding
from nanoinfer.platforms import Platform
from nanoinfer.platforms.cuda.kernels import fused_ops

DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


@pytest.fixture(autouse=True)
def torch_small_ops_on_cpu(monkeypatch):
    """The reference is the plain-torch platform's ops (platforms/interface.py), which layers built here bind to:
    on CPU, bfloat16 would otherwise take the C++ kernels (csrc/fused_ops.cpp, tested in
    tests/unit/test_cpu_fused_ops.py), and their rotary works in place."""
    from nanoinfer import platforms

    monkeypatch.setattr(platforms, "_current", platforms.Platform())
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    got, expected = got.cpu(), expected.cpu()
    if not INTERPRETED or got.dtype == torch.float16:
        # Rounded as torch rounds (float16 converts correctly in the interpreter too): equal up to the order of a
        # float32 sum, i.e. almost every element identical and the rest one ulp away.
        torch.testing.assert_close(got.float(), expected.float(), rtol=1e-2, atol=1e-3)
        assert (got != expected).float().mean() < 0.01
    else:
        # Interpreted bfloat16 truncates at every rounding, and a sum of two rounded products (rotary) can
        # cancel: allow a few ulps of the largest magnitude. A wrong index or sign is off by O(1) and fails.
        ulp = expected.float().abs().max() * 2.0**-7
        torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=float(4 * ulp))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_residual_matches_torch(device, dtype):
    gen = torch.Generator().manual_seed(0)
    hidden = 96  # not a power of two: the masked tail
    norm = RMSNorm(hidden, 1e-6)
    norm.weight.data = torch.randn(hidden, generator=gen) * 0.5 + 1
    norm = norm.to(dtype).requires_grad_(False)
    x = (torch.randn(7, hidden, generator=gen) * 3).to(dtype)
    residual = torch.randn(7, hidden, generator=gen).to(dtype)
    expected = norm(x.clone())  # bfloat16 on CPU takes layers.py's torch path
    expected_out, expected_residual = norm(x.clone(), residual.clone())
    weight = norm.weight.data.to(device)

    close(fused_ops.rms_norm(x.to(device), weight, 1e-6), expected)
    out, new_residual = fused_ops.rms_norm(x.to(device), weight, 1e-6, residual.to(device))
    close(out, expected_out)
    close(new_residual, expected_residual)


def test_rms_norm_per_head_on_a_strided_view(device):
    """Qwen3's q_norm: each head of q, a [T, H, D] view into the fused qkv output (row stride > H * D)."""
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.rand(64, generator=gen) + 0.5
    norm = norm.to(torch.bfloat16).requires_grad_(False)
    qkv = torch.randn(5, 4 * 64 + 2 * 2 * 64, generator=gen).to(torch.bfloat16)
    q = qkv[:, : 4 * 64].view(5, 4, 64)
    assert not q.is_contiguous()
    got = fused_ops.rms_norm(qkv.to(device)[:, : 4 * 64].view(5, 4, 64), norm.weight.data.to(device), 1e-6)
    close(got, norm(q))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(device, dtype):
    x = (torch.randn(6, 2 * 1500, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)  # two column tiles
    close(fused_ops.silu_and_mul(x.to(device)), Platform().silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_matches_torch_on_strided_views(device, dtype, head_dim):
    gen = torch.Generator().manual_seed(3)
    rotary = RotaryEmbedding(SimpleNamespace(rope_theta=1_000_000.0), head_dim, max_position=4096)
    qkv = torch.randn(9, (8 + 2 + 2) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : 8 * head_dim].view(9, 8, head_dim)
    k = qkv[:, 8 * head_dim : 10 * head_dim].view(9, 2, head_dim)
    positions = torch.tensor([0, 1, 2, 255, 256, 1000, 3000, 4095, 7])
    expected_q, expected_k = rotary(positions, q, k)  # 16-bit: layers.py's torch path

    d = qkv.to(device)
    got_q, got_k = fused_ops.rotary_embedding(
        positions.to(device), d[:, : 8 * head_dim].view(9, 8, head_dim),
        d[:, 8 * head_dim : 10 * head_dim].view(9, 2, head_dim), rotary.cos.to(device), rotary.sin.to(device),
    )  # fmt: skip
    close(got_q, expected_q)
    close(got_k, expected_k)


def test_float32_is_refused_so_the_exact_path_stays_torch(device):
    with pytest.raises(ValueError, match="16-bit only"):
        fused_ops.silu_and_mul(torch.randn(2, 8, device=device))


def test_the_model_runs_its_small_ops_through_the_kernels_where_they_apply(tmp_path, monkeypatch):
    """The wiring through the platform's ops: a bfloat16 Qwen3 (q/k norms on strided head views, fused residual
    norms, rotary, SiLU) with the Triton small ops standing in for torch's (on CPU under the interpreter, where the
    CUDA platform's gate would otherwise keep torch): every op goes through a kernel, and the logits stay close to
    torch's."""
    from nanoinfer import LLM, SamplingParams
    from nanoinfer.platforms import Platform
    from nanoinfer.testing.tiny_models import build_tiny_model

    path = build_tiny_model("qwen3", tmp_path / "qwen3", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                            head_dim=64, intermediate_size=256)  # fmt: skip
    llm = LLM(str(path), device="cpu", dtype="bfloat16", max_model_len=512, cpu_kvcache_space_gib=0.05)
    prompts = [[5, 9, 200, 31, 7, 64, 2, 300], [17, 4, 99]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    engine_platform = type(llm.engine.platform)

    def use_small_ops(ops) -> None:
        """Every module's platform becomes the engine's with its small ops replaced by `ops`'."""

        class WithSmallOps(engine_platform):
            def rms_norm(self, x, weight, eps, residual=None):
                return ops.rms_norm(x, weight, eps, residual)

            def silu_and_mul(self, x):
                return ops.silu_and_mul(x)

            def rotary_embedding(self, positions, q, k, cos, sin):
                return ops.rotary_embedding(positions, q, k, cos, sin)

        platform = WithSmallOps.__new__(WithSmallOps)
        platform.__dict__.update(llm.engine.platform.__dict__)
        for module in llm.engine.model_runner.model.modules():
            if hasattr(module, "platform"):
                module.platform = platform

    plain = Platform()
    use_small_ops(SimpleNamespace(rms_norm=plain.rms_norm, silu_and_mul=plain.silu_and_mul,
                                  rotary_embedding=plain.rotary_embedding))  # fmt: skip
    torch_out = llm.generate(prompts, params)

    calls = []

    def spy(name):
        def call(*args, **kwargs):
            calls.append(name)
            return getattr(fused_ops, name)(*args, **kwargs)

        return call

    spies = SimpleNamespace(**{n: spy(n) for n in ("rms_norm", "silu_and_mul", "rotary_embedding")})
    use_small_ops(spies)
    triton_out = llm.generate(prompts, params)

    # Per forward: 2 layers x (input norm, q norm, k norm, post-attention norm) + the final norm; rotary and
    # SiLU once per layer (SiLU not at all where the AMX GEMM runs it in its epilogue). Two prompts in one
    # prefill step, then 5 decode steps.
    steps = 6
    packed = getattr(llm.engine.model_runner.model.model.layers[0].mlp.gate_up_proj, "packed_weight", None)
    silu_in_gemm = packed is not None and packed.gated
    assert calls.count("rms_norm") == steps * (2 * 4 + 1)
    assert calls.count("rotary_embedding") == steps * 2
    assert calls.count("silu_and_mul") == (0 if silu_in_gemm else steps * 2)
    for a, b in zip(torch_out, triton_out):
        first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        assert first_a.token_id == first_b.token_id  # the first token: same greedy choice ...
        # ... with nearly the same probability: within about one bfloat16 step of a logit of magnitude 8-16
        # (0.0625; the LM head's output is bfloat16), where the two paths' roundings of the norms differ.
        assert abs(first_a.logprob - first_b.logprob) < 0.1


def test_the_start_up_check_runs_every_kernel_and_reports_a_failure_in_one_line(device, monkeypatch):
    """The CUDA platform compiles and runs each kernel once before the engine relies on them; a failure (a Triton
    or driver this code was not tried with) keeps torch's ops instead of stopping the engine."""
    from nanoinfer.platforms.cuda import CudaPlatform, check_small_ops

    assert check_small_ops(device, torch.bfloat16) is None

    def broken(*args, **kwargs):
        raise RuntimeError("PassManager::run failed\nlong compiler log")

    monkeypatch.setattr(fused_ops, "rotary_embedding", broken)
    assert check_small_ops(device, torch.bfloat16) == "RuntimeError: PassManager::run failed"
    platform = CudaPlatform("bfloat16")
    platform.prepare_model(torch.nn.Linear(64, 64).to(device=device, dtype=torch.bfloat16))
    assert platform.triton_small_ops is False  # torch's ops for the whole engine
