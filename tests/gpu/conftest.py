"""CUDA fixtures: tiny models built on the spot (the GPU machine has no internet) and Hugging Face
transformers run on the same GPU as the reference. Without CUDA every test here is skipped (see
`pytestmark` in each module), and no fixture below runs, so CPU CI only collects them.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch

# qwen3_moe, gpt_oss: the fused-MoE kernel, attention sinks; qwen3_next, qwen3_5: the linear-attention kernels
FAMILIES = ("qwen3", "llama", "qwen3_moe", "gpt_oss", "qwen3_next", "qwen3_5")
# head_dim 64 (the smallest the issue asks the kernels for) and GQA 2:1; still a few hundred KiB of weights.
TINY_SHAPE = dict(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=256)


def release_cuda_memory() -> None:
    """Drop unreachable engines and models and hand cached blocks back, so the next test plans from a clean GPU."""
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture
def cuda_llm():
    """cuda_llm(model_dir, **settings): a context manager giving an LLM on cuda:0, torn down (KV cache
    freed) when the block ends, so that each test plans its cache from a clean GPU."""
    from nanoinfer import LLM

    @contextmanager
    def make(model_dir, **settings):
        release_cuda_memory()
        llm = LLM(str(model_dir), device="cuda", **settings)
        try:
            yield llm
        finally:
            llm.engine.close()
            del llm
            release_cuda_memory()

    return make


@pytest.fixture(scope="session")
def cuda_model_dirs(tmp_path_factory) -> dict:
    """Tiny random folders of FAMILIES, saved in float32 (each test casts to its dtype)."""
    from nanoinfer.testing.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("cuda-tiny-models")
    return {family: build_tiny_model(family, root / family, **TINY_SHAPE) for family in FAMILIES}


@dataclass
class HFResult:
    token_ids: list[int]  # greedy tokens
    top_ids: list[set[int]]  # the top-k token ids at each generated position


@contextmanager
def exact_float32_matmuls():
    """TF32 would round float32 matmul inputs to 10 mantissa bits: keep both sides in true float32."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture
def no_tf32():
    """Turn TF32 off for the test (torch's default, but a site setting may have turned it on)."""
    with exact_float32_matmuls():
        yield


def hf_greedy_cuda(
    model_dir, prompts: list[list[int]], num_tokens: int, dtype: torch.dtype, num_logprobs: int
) -> list[HFResult]:
    """transformers' own forward pass on cuda:0 in `dtype`, greedy, one prompt at a time (no padding), EOS
    ignored. Each step reruns the whole sequence without a cache: a few seconds for these tiny models, and
    no dependence on transformers' cache API, which changes between releases.

    Logprobs are log_softmax of the logits cast to float32, as transformers' generate() scores them.
    """
    from nanoinfer.testing.hf_reference import hf_model

    model = hf_model(model_dir, torch.float32).to(device="cuda", dtype=dtype)
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            token_ids, top_ids = [], []
            for _ in range(num_tokens):
                logits = model(torch.tensor([prompt + token_ids], device="cuda"), use_cache=False).logits
                logprobs = torch.log_softmax(logits[0, -1].float(), dim=-1)
                token_ids.append(int(logprobs.argmax()))
                top_ids.append(set(torch.topk(logprobs, num_logprobs).indices.tolist()))
            results.append(HFResult(token_ids, top_ids))
    del model
    release_cuda_memory()
    return results


@pytest.fixture(scope="session")
def hf_reference(cuda_model_dirs) -> Callable[..., list[HFResult]]:
    """hf_reference(family, dtype, prompts, num_tokens, num_logprobs): computed once per distinct arguments
    (the float32 and bfloat16 tests of every backend share them)."""

    @functools.cache
    def run(family: str, dtype: str, prompts: tuple, num_tokens: int, num_logprobs: int):
        with exact_float32_matmuls():
            return hf_greedy_cuda(
                cuda_model_dirs[family], [list(p) for p in prompts], num_tokens, getattr(torch, dtype), num_logprobs
            )

    def reference(family: str, dtype: str, prompts: list[list[int]], num_tokens: int, num_logprobs: int):
        return run(family, dtype, tuple(map(tuple, prompts)), num_tokens, num_logprobs)

    return reference
