"""The engine on CUDA against Hugging Face transformers on the same GPU, for every attention backend that can
run here: float32 greedy token for token; bfloat16 by vLLM's check_logprobs_close rule. And the KV-cache
planner against what the engine really allocated, CUDA graphs included. Decode runs through CUDA graphs
(the default) in the comparisons with transformers; graph-vs-eager checks the two paths agree.
Run by scripts/gpu_check.sh; skipped without CUDA.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import random

import pytest
import torch

from nanoinfer import SamplingParams, memory
from nanoinfer.testing.hf_reference import check_logprobs_close

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BACKENDS = ("torch", "triton", "flash-attn")
NUM_TOKENS = 32
NUM_LOGPROBS = 5  # vLLM's models tests use 5
# Small batches so that the two long prompts are prefilled in chunks over their own cached blocks, and
# prefill chunks share steps with decodes. 64 blocks of 256 tokens hold all 16 sequences at once.
ENGINE_SETTINGS = dict(
    max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=512, num_kvcache_blocks=64, enforce_eager=False
)


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """16 prompts of 1..600 tokens: around and across the 256-token block boundary, and longer than one
    512-token step."""
    rng = random.Random(seed)
    lengths = [1, 2, 7, 16, 31, 64, 100, 128, 200, 255, 256, 257, 300, 511, 513, 600]
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


def backend_skip_reason(backend: str, dtype: str) -> str | None:
    """Why `backend` cannot run in this process (None when it can)."""
    if backend == "triton":
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        if os.environ.get("TRITON_INTERPRET") == "1":
            # tests/kernels/conftest.py sets it when both folders run in one process without an explicit value.
            return "TRITON_INTERPRET=1 in this process: run with TRITON_INTERPRET=0 for the compiled kernels"
    if backend == "flash-attn":
        if importlib.util.find_spec("flash_attn") is None:
            return "flash-attn is not installed (optional: pip install 'nanoinfer[cuda]')"
        if dtype == "float32":
            return "flash-attn has no float32 kernels (Config refuses the pairing)"
    return None


def skip_unless_runnable(backend: str, dtype: str) -> None:
    if (reason := backend_skip_reason(backend, dtype)) is not None:
        pytest.skip(reason)


def generate(llm, prompts: list[list[int]], num_logprobs: int | None = None):
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=num_logprobs)
    outputs = llm.generate(prompts, params)
    for out in outputs:
        assert out.finish_reason == "length", out.error
        assert len(out.token_ids) == NUM_TOKENS
    return outputs


def vocab_size(model_dir) -> int:
    import transformers

    return transformers.AutoConfig.from_pretrained(model_dir).vocab_size


# --- attention backend selection ------------------------------------------------------------------------


def test_auto_backend_on_cuda_is_flash_attn_when_installed_else_triton(cuda_model_dirs, cuda_llm):
    expected = "flash-attn" if importlib.util.find_spec("flash_attn") else "triton"
    if expected == "triton" and importlib.util.find_spec("triton") is None:
        expected = "torch"
    with cuda_llm(cuda_model_dirs["qwen3"], dtype="bfloat16", **ENGINE_SETTINGS) as llm:
        assert llm.config.attention_backend == expected
        assert llm.engine.model_runner.backend.name == expected


# --- engine vs transformers -----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_float32_greedy_matches_transformers_token_for_token(
    cuda_model_dirs, cuda_llm, hf_reference, no_tf32, family, backend
):
    skip_unless_runnable(backend, "float32")
    model_dir = cuda_model_dirs[family]
    prompts = make_prompts(vocab_size(model_dir))
    expected = hf_reference(family, "float32", prompts, NUM_TOKENS, NUM_LOGPROBS)
    with cuda_llm(model_dir, dtype="float32", attention_backend=backend, **ENGINE_SETTINGS) as llm:
        assert llm.engine.model_runner.backend.name == backend
        outputs = generate(llm, prompts)
    for i, (out, ref) in enumerate(zip(outputs, expected, strict=True)):
        assert out.token_ids == ref.token_ids, (
            f"{backend}: prompt {i} ({len(prompts[i])} tokens) diverged from transformers"
        )


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "qwen3_next", "qwen3_5"])
def test_moe_float32_greedy_matches_transformers_through_cuda_graphs(cuda_model_dirs, cuda_llm, hf_reference, no_tf32,
                                                                    family):  # fmt: skip
    """The Triton fused-MoE path (and gpt-oss's attention sinks in the Triton kernels, Qwen3-Next's and Qwen3.5's
    linear-attention kernels with their state slots), decode captured in CUDA graphs: token for token with
    transformers in float32."""
    skip_unless_runnable("triton", "float32")
    model_dir = cuda_model_dirs[family]
    prompts = make_prompts(vocab_size(model_dir))
    expected = hf_reference(family, "float32", prompts, NUM_TOKENS, NUM_LOGPROBS)
    with cuda_llm(model_dir, dtype="float32", attention_backend="triton", **ENGINE_SETTINGS) as llm:
        assert llm.engine.model_runner.uses_cuda_graphs
        outputs = generate(llm, prompts)
    for i, (out, ref) in enumerate(zip(outputs, expected, strict=True)):
        assert out.token_ids == ref.token_ids, f"{family}: prompt {i} ({len(prompts[i])} tokens) diverged"


@pytest.mark.parametrize("backend", BACKENDS)
def test_speculation_in_float32_matches_transformers_token_for_token(
    cuda_model_dirs, cuda_llm, hf_reference, no_tf32, backend
):
    """n-gram speculation on CUDA: proposed tokens verified as decode rows (through the CUDA graphs up to
    their largest bucket) give transformers' float32 greedy tokens, and proposals were kept."""
    skip_unless_runnable(backend, "float32")
    model_dir = cuda_model_dirs["llama"]
    prompts = make_prompts(vocab_size(model_dir))
    expected = hf_reference("llama", "float32", prompts, NUM_TOKENS, NUM_LOGPROBS)
    settings = dict(ENGINE_SETTINGS, num_speculative_tokens=3)
    with cuda_llm(model_dir, dtype="float32", attention_backend=backend, **settings) as llm:
        outputs = generate(llm, prompts)
        assert llm.engine.scheduler.num_accepted_tokens > 0
    for i, (out, ref) in enumerate(zip(outputs, expected, strict=True)):
        assert out.token_ids == ref.token_ids, f"{backend}: prompt {i} diverged from transformers"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_bfloat16_greedy_is_close_to_transformers_by_logprobs(cuda_model_dirs, cuda_llm, hf_reference, family, backend):
    skip_unless_runnable(backend, "bfloat16")
    model_dir = cuda_model_dirs[family]
    prompts = make_prompts(vocab_size(model_dir))
    expected = hf_reference(family, "bfloat16", prompts, NUM_TOKENS, NUM_LOGPROBS)
    with cuda_llm(model_dir, dtype="bfloat16", attention_backend=backend, **ENGINE_SETTINGS) as llm:
        assert llm.engine.model_runner.backend.name == backend
        outputs = generate(llm, prompts, num_logprobs=NUM_LOGPROBS)
    ours = []
    for out in outputs:
        logprobs = out.outputs[0].logprobs
        assert [lp.token_id for lp in logprobs] == out.token_ids
        assert all(len(lp.top) == NUM_LOGPROBS for lp in logprobs)
        ours.append((out.token_ids, [{token_id for token_id, _ in lp.top} for lp in logprobs]))
    theirs = [(ref.token_ids, ref.top_ids) for ref in expected]
    num_diverged = check_logprobs_close(ours, theirs, (f"nanoinfer[{backend}]", "transformers"))
    print(f"bfloat16 {family} {backend}: {num_diverged}/{len(prompts)} sequences diverged within the top-k")


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_fp8_kv_cache_is_close_to_a_bfloat16_cache_by_logprobs(cuda_model_dirs, cuda_llm, family, backend):
    """kv_cache_dtype fp8 (e4m3, scale 1) on CUDA, through CUDA graphs and chunked prefill, against the same
    model with a bfloat16 cache by vLLM's check_logprobs_close rule. e4m3's 3 mantissa bits move these tiny
    random models' near-flat logits, so up to half the sequences may differ (first differences in each other's
    top 5, as the CPU test of the same cache allows); each block is half the bytes."""
    skip_unless_runnable(backend, "bfloat16")
    if torch.cuda.get_device_capability() < (8, 9) and backend == "triton":
        pytest.skip("Triton's e4m3 needs compute capability 8.9 or newer")
    model_dir = cuda_model_dirs[family]
    prompts = make_prompts(vocab_size(model_dir))
    runs, block_bytes = {}, {}
    for kv_cache_dtype in ("bfloat16", "fp8"):
        with cuda_llm(model_dir, dtype="bfloat16", attention_backend=backend, kv_cache_dtype=kv_cache_dtype,
                      **ENGINE_SETTINGS) as llm:  # fmt: skip
            assert all(t.dtype == (torch.float8_e4m3fn if kv_cache_dtype == "fp8" else torch.bfloat16)
                       for pair in llm.engine.model_runner.kv_caches for t in pair)  # fmt: skip
            outputs = generate(llm, prompts, num_logprobs=NUM_LOGPROBS)
            runs[kv_cache_dtype] = [(o.token_ids, [{t for t, _ in lp.top} for lp in o.outputs[0].logprobs])
                                    for o in outputs]  # fmt: skip
            block_bytes[kv_cache_dtype] = llm.engine.plan.block_bytes
    num_diverged = check_logprobs_close(runs["fp8"], runs["bfloat16"], ("fp8 cache", "bfloat16 cache"))
    print(f"fp8 cache {family} {backend}: {num_diverged}/{len(prompts)} sequences diverged within the top-k")
    assert num_diverged <= len(prompts) // 2
    assert block_bytes["fp8"] * 2 == block_bytes["bfloat16"]


@pytest.mark.parametrize("backend, dtype", [("triton", "float32"), ("triton", "bfloat16"), ("flash-attn", "bfloat16")])
def test_cuda_graph_decode_matches_eager(cuda_model_dirs, cuda_llm, no_tf32, backend, dtype):
    skip_unless_runnable(backend, dtype)
    model_dir = cuda_model_dirs["qwen3"]
    prompts = make_prompts(vocab_size(model_dir))
    runs = {}
    for eager in (False, True):
        settings = {**ENGINE_SETTINGS, "enforce_eager": eager}
        with cuda_llm(model_dir, dtype=dtype, attention_backend=backend, **settings) as llm:
            graphs = llm.engine.model_runner.graph_runner
            assert (graphs is None) == eager
            if not eager:
                assert graphs.batch_sizes == [1, 2, 4, 8, 16] and llm.engine.plan.graph_bytes > 0
            outputs = generate(llm, prompts, num_logprobs=NUM_LOGPROBS)
            runs[eager] = [(o.token_ids, [{t for t, _ in lp.top} for lp in o.outputs[0].logprobs]) for o in outputs]
    if dtype == "float32":
        assert [ids for ids, _ in runs[False]] == [ids for ids, _ in runs[True]]
    else:  # a padded batch may pick other GEMM tiles: low-precision sums may round differently
        num_diverged = check_logprobs_close(runs[False], runs[True], ("graphs", "eager"))
        print(f"{dtype} {backend}: graphs vs eager, {num_diverged}/{len(prompts)} sequences diverged within the top-k")


# --- KV-cache planner vs allocation ---------------------------------------------------------------------


def test_kv_cache_allocation_matches_the_plan_and_a_replan_from_free_memory(cuda_model_dirs, cuda_llm):
    """The engine allocates exactly plan.num_blocks x plan.block_bytes, and planning again from what the GPU
    reports after load (mem_get_info) gives the same block count within 2%."""
    gc.collect()
    torch.cuda.empty_cache()
    leftover = torch.cuda.memory_allocated()  # live tensors of earlier tests: "used by others" to the engine
    with cuda_llm(
        cuda_model_dirs["qwen3"], dtype="bfloat16", gpu_memory_utilization=0.5, max_model_len=1024, enforce_eager=True
    ) as llm:
        plan, config, runner = llm.engine.plan, llm.config, llm.engine.model_runner
        tensors = [t for pair in runner.kv_caches for t in pair]
        assert len(tensors) == 2 * config.hf_config.num_hidden_layers
        assert all(t.shape[0] == plan.num_blocks and t.is_cuda for t in tensors)
        assert sum(t.numel() * t.element_size() for t in tensors) == plan.num_blocks * plan.block_bytes

        free, total = torch.cuda.mem_get_info()
        # Memory torch's allocator does not hold: the CUDA context, kernels modules, other processes.
        other = (total - free) - torch.cuda.memory_reserved() + leftover
        weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        # The activation peak, measured again with the engine's own warm-up pass (no request is in flight and
        # nothing is prefix-cached yet, so overwriting cache blocks is harmless).
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
        runner.warmup()
        torch.cuda.synchronize()
        activation = torch.cuda.max_memory_allocated() - baseline
        replan = memory.plan_kv_cache(
            total_bytes=total, utilization=config.gpu_memory_utilization, weights_bytes=weights,
            activation_bytes=activation, other_bytes=other, block_bytes=plan.block_bytes,
            block_size=plan.block_size, max_model_len=config.max_model_len,
        )  # fmt: skip
    difference = abs(plan.num_blocks - replan.num_blocks) / replan.num_blocks
    print(f"planner: engine {plan.num_blocks} blocks, re-plan {replan.num_blocks} ({difference:.2%})")
    assert difference <= 0.02, (
        f"engine planned {plan.num_blocks} blocks, a re-plan after load gives {replan.num_blocks} "
        f"({difference:.2%} apart). Engine: weights {plan.weights_bytes}, activations {plan.activation_bytes}, "
        f"others {plan.other_bytes}; re-plan: weights {weights}, activations {activation}, others {other}"
    )


def test_cuda_graphs_fit_in_the_plan(cuda_model_dirs, cuda_llm):
    """With CUDA graphs captured over the final cache, everything this process holds stays within
    gpu_memory_utilization x total (graphs were measured and taken out of the KV budget first)."""
    gc.collect()
    torch.cuda.empty_cache()
    utilization = 0.5
    with cuda_llm(cuda_model_dirs["qwen3"], dtype="bfloat16", gpu_memory_utilization=utilization,
                  max_model_len=1024, max_num_seqs=64) as llm:  # fmt: skip
        plan, runner = llm.engine.plan, llm.engine.model_runner
        assert runner.graph_runner is not None and plan.graph_bytes > 0
        generate(llm, make_prompts(vocab_size(cuda_model_dirs["qwen3"])))
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        used = total - free - plan.other_bytes
        print(f"graphs {plan.graph_bytes / 2**20:.1f} MiB, KV {plan.kv_bytes / 2**30:.2f} GiB, "
              f"used {used / 2**30:.2f} GiB of {utilization} x {total / 2**30:.1f} GiB")
        assert used <= utilization * total * 1.02


def test_lora_float32_greedy_matches_peft_through_cuda_graphs(cuda_model_dirs, cuda_llm, no_tf32, tmp_path):
    """Two adapters and the base model in one batch, decode captured in CUDA graphs (the Triton shrink / expand read
    each replay's row slots): token for token with transformers + PEFT on the same GPU in float32."""
    pytest.importorskip("peft", reason="peft builds the adapters and is the reference (pip install peft)")
    skip_unless_runnable("triton", "float32")
    from nanoinfer import LoRARequest
    from nanoinfer.testing.tiny_lora import build_tiny_adapter, peft_greedy

    model_dir = cuda_model_dirs["llama"]
    targets = [("q_proj", "v_proj", "down_proj"), ("k_proj", "o_proj", "gate_proj", "up_proj")]
    loras = [LoRARequest(f"a{i}", i, str(build_tiny_adapter(model_dir, tmp_path / f"a{i}", rank=8 * i,
                                                            target_modules=t, seed=i)))
             for i, t in enumerate(targets, start=1)]  # fmt: skip
    prompts = make_prompts(vocab_size(model_dir))
    choice = [([None, *loras])[i % 3] for i in range(len(prompts))]
    expected = [peft_greedy(model_dir, lora.lora_path if lora else None, [prompt], NUM_TOKENS, "cuda")[0]
                for prompt, lora in zip(prompts, choice)]
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    with cuda_llm(model_dir, dtype="float32", attention_backend="triton", enable_lora=True, max_loras=2,
                  max_lora_rank=16, **ENGINE_SETTINGS) as llm:  # fmt: skip
        assert llm.engine.model_runner.uses_cuda_graphs
        outputs = llm.generate(prompts, params, lora_request=choice)
    for i, (out, ref) in enumerate(zip(outputs, expected, strict=True)):
        assert out.token_ids == ref, f"prompt {i} ({choice[i].lora_name if choice[i] else 'base'}) diverged"
