"""The platform seam (platforms/): chosen once per engine, the only place the C++ extension is reached from, plain
torch when the extension is off or not built yet (and then built in the background for the next run)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import nanoinfer
from nanoinfer import LLM, SamplingParams
from nanoinfer.platforms import Platform, current_platform
from nanoinfer.platforms.cpu import CpuKernelPlatform, CpuPlatform
from nanoinfer.platforms.cpu import ops as ops_module
from nanoinfer.testing.hf_reference import hf_greedy
from nanoinfer.testing.tiny_models import build_tiny_model

SRC = Path(nanoinfer.__file__).parent
CPU_ROOM = SRC / "platforms" / "cpu"
# An import of the extension, or an instruction set named in code or comments.
EXTENSION_OR_ISA = re.compile(r"platforms\.cpu(\.ops| import ops)|cpu_ops|\b(avx\w*|amx\w*|sse\d\w*|neon)\b", re.I)


def test_no_file_outside_the_cpu_room_imports_the_extension_or_names_an_instruction_set():
    offenders = [
        f"{path.relative_to(SRC)}:{number}: {line.strip()}"
        for path in sorted(SRC.rglob("*.py")) if CPU_ROOM not in path.parents
        for number, line in enumerate(path.read_text().splitlines(), 1) if EXTENSION_OR_ISA.search(line)
    ]  # fmt: skip
    assert offenders == []


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama") / "llama")


def test_the_engine_runs_on_plain_torch_with_the_kernels_off_and_gives_transformers_tokens(llama_dir):
    prompts = [[5, 9, 200, 31, 7, 64, 2, 300], [17, 4, 99]]
    expected, _ = hf_greedy(llama_dir, prompts, 12)
    llm = LLM(str(llama_dir), device="cpu", dtype="float32", max_model_len=256, cpu_kvcache_space_gib=0.05,
              cpu_kernels="off")  # fmt: skip
    assert type(llm.engine.platform) is CpuPlatform and current_platform() is llm.engine.platform
    runner = llm.engine.model_runner
    assert runner.num_packed_weights == 0 and runner.decode_runner is None
    assert all(m.platform is llm.engine.platform for m in runner.model.modules() if hasattr(m, "platform"))
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outputs] == expected


def test_a_job_waiting_for_the_kernels_uses_them_everywhere(llama_dir):
    if ops_module.cpu_ops() is None:
        pytest.skip("the CPU kernels could not be built here")
    llm = LLM(str(llama_dir), device="cpu", dtype="float32", max_model_len=256, cpu_kvcache_space_gib=0.05,
              cpu_kernels="wait")  # fmt: skip
    assert isinstance(llm.engine.platform, CpuKernelPlatform)
    assert llm.engine.model_runner.backend.name == "torch"  # the CPU backend keeps the user-facing name
    if ops_module.cpu_ops().vectorized:  # the packed GEMM and the fused decode loop need AVX2 at least
        assert llm.engine.model_runner.num_packed_weights > 0 and llm.engine.model_runner.decode_runner is not None


def test_auto_starts_one_background_build_and_answers_plain_torch_until_it_is_done(tmp_path, monkeypatch):
    started = []

    class FakePopen:
        def __init__(self, args, **kwargs):
            started.append(args)
            assert kwargs["start_new_session"]  # outlives this process

    monkeypatch.delenv("NANOINFER_DISABLE_CPU_KERNELS", raising=False)
    monkeypatch.setattr(ops_module, "_module", None)
    monkeypatch.setattr(ops_module, "_failed", False)
    monkeypatch.setattr(ops_module, "_build_dir", lambda name: tmp_path / name)
    monkeypatch.setattr(ops_module.subprocess, "Popen", FakePopen)
    assert ops_module.cpu_ops_for("auto") is None
    assert ops_module.cpu_ops_for("auto") is None  # a second run while it builds starts no second build
    assert len(started) == 1 and "build_in_background" in started[0][-1]
    name = ops_module.extension_name()
    (tmp_path / name / f"{name}.so").write_bytes(b"")  # built: loaded, not rebuilt
    monkeypatch.setattr(ops_module, "cpu_ops", lambda: "the module")
    assert ops_module.cpu_ops_for("auto") == "the module" and len(started) == 1
    assert ops_module.cpu_ops_for("off") is None


def test_the_fused_decode_loop_names_a_missing_tensor(llama_dir):
    ops = ops_module.cpu_ops()
    if ops is None:
        pytest.skip("the CPU kernels could not be built here")
    import torch

    with pytest.raises(RuntimeError, match="layer 0 has no tensor named 'post_attention_layernorm'"):
        ops.DecodeLayers([{"input_layernorm": torch.ones(4)}], torch.ones(1, 2), torch.ones(1, 2), 1, 1, 2, 4, 1e-6,
                         1.0, False)  # fmt: skip


def test_plain_platform_ops_are_the_reference_the_layers_bind_to(monkeypatch):
    from nanoinfer import platforms
    from nanoinfer.models.layers.norm import RMSNorm

    plain = Platform()
    monkeypatch.setattr(platforms, "_current", plain)
    assert RMSNorm(8, 1e-6).platform is plain
