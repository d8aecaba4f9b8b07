"""The model families through the CUDA path's Triton kernels (KV store, paged prefill and decode attention), run in
Triton's interpreter on CPU (or compiled, on a CUDA device with TRITON_INTERPRET=0, as scripts/gpu_check.sh runs
tests/kernels): greedy float32 tokens equal transformers', with chunked prefill (the prefill kernel over the paged
cache) and pure-decode steps (the decode kernel), across sliding windows and soft caps."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("triton", reason="triton is not installed: pip install -e '.[dev]'")

from nanoinfer import LLM, SamplingParams
from nanoinfer.platforms.cpu import CpuKernelPlatform, CpuPlatform
from nanoinfer.platforms.cuda import triton_backend
from nanoinfer.platforms.cuda.triton_backend import TritonBackend
from nanoinfer.testing.hf_reference import hf_greedy
from nanoinfer.testing.tiny_models import build_tiny_model

# The families whose attention differs: windows (Mistral, Gemma 2 and 3, Phi-3, OLMo 3), soft caps (Gemma 2),
# q/k norms (Gemma 3, OLMo 2), no-rope layers (SmolLM3), partial rotary (Phi-4-mini), sinks (gpt-oss).
FAMILIES = ["llama", "mistral", "gemma2", "gemma3", "phi4_mini", "smollm3", "olmo2", "olmo3", "gpt_oss"]
NUM_TOKENS = 8


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_through_the_triton_kernels_match_transformers(tmp_path, family, device, monkeypatch):
    path = build_tiny_model(family, tmp_path / family)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in (5, 30, 47, 70)]  # past every tiny window
    expected, _ = hf_greedy(path, prompts, NUM_TOKENS)
    calls = []
    for name in ("paged_prefill_attention", "paged_decode_attention"):
        original = getattr(triton_backend, name)
        monkeypatch.setattr(triton_backend, name,
                            lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))  # fmt: skip
    if device == "cpu":  # the CPU platform with the Triton backend, whose kernels the interpreter runs
        for platform in (CpuPlatform, CpuKernelPlatform):
            monkeypatch.setattr(platform, "attention_backend", lambda self, name: TritonBackend())
        settings = dict(device="cpu", cpu_kvcache_space_gib=0.05)
    else:
        settings = dict(device="cuda", attention_backend="triton", num_kvcache_blocks=64)
    llm = LLM(str(path), dtype="float32", max_model_len=256, max_num_batched_tokens=32, max_num_seqs=4,
              **settings)  # fmt: skip
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
    assert [out.token_ids for out in outputs] == expected
    assert {"paged_prefill_attention", "paged_decode_attention"} <= set(calls)
