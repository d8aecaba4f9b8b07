"""Greedy float32 output equals Hugging Face transformers token for token, in every scheduling regime:
one batch, chunked prefill, heavy preemption, prefix-cache hits, and block sizes 256 and 512."""

from __future__ import annotations

import random

import pytest
import torch

from nanoinfer import LLM, SamplingParams
from nanoinfer.engine.scheduler import SchedulerOutput
from nanoinfer.engine.sequence import Request
from nanoinfer.platforms.cpu.ops import cpu_ops
from nanoinfer.testing.hf_reference import check_logprobs_close, hf_greedy

FAMILIES = ["qwen3", "qwen2", "llama"]
NUM_REFERENCE_TOKENS = 32

NUM_PROMPTS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_REFERENCE_TOKENS, ignore_eos=True)


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """16 prompts of mixed lengths (3..300 tokens), so prefills cross the 256-token block boundary."""
    rng = random.Random(seed)
    lengths = [3, 7, 12, 20, 33, 47, 64, 90, 128, 150, 200, 230, 255, 256, 257, 300]
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def make_boundary_prompts(vocab_size: int, seed: int = 2) -> list[list[int]]:
    """16 prompts of 236..251 tokens: each crosses the 256-token block boundary while decoding, so a
    3-block cache must keep preempting."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(236 + i)] for i in range(NUM_PROMPTS)]


def make_shared_prefix_prompts(vocab_size: int, seed: int = 1) -> list[list[int]]:
    """16 prompts sharing a 600-token prefix (two full 256-token blocks) with distinct tails."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab_size) for _ in range(600)]
    return [prefix + [rng.randrange(3, vocab_size) for _ in range(5 + 3 * i)] for i in range(NUM_PROMPTS)]


@pytest.fixture(scope="module")
def references(tiny_model_dirs):
    """(prompts, hf tokens, hf first-step logits) per family and prompt set."""
    import transformers

    refs = {}
    for family, path in tiny_model_dirs.items():
        vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
        sets = {"mixed": make_prompts(vocab), "shared": make_shared_prefix_prompts(vocab),
                "boundary": make_boundary_prompts(vocab)}
        for kind, prompts in sets.items():
            tokens, logits = hf_greedy(path, prompts, NUM_REFERENCE_TOKENS)
            refs[family, kind] = (prompts, tokens, logits)
    return refs


REGIMES = {
    # name: (prompt set, engine settings)
    "one_batch": ("mixed", dict(max_model_len=512)),
    "chunked_prefill": ("mixed", dict(max_model_len=512, max_num_batched_tokens=64, max_num_seqs=8)),
    "preemption": ("boundary", dict(max_model_len=512, num_kvcache_blocks=3)),
    "prefix_cache": ("shared", dict(max_model_len=1024, max_num_seqs=4)),
    "block_size_512": ("mixed", dict(max_model_len=1024, kvcache_block_size=512)),
    # n-gram speculation: proposed tokens verified as decode rows, kept up to the first the model refuses.
    "speculation": ("mixed", dict(max_model_len=512, num_speculative_tokens=3)),
    "speculation_preemption": ("boundary", dict(max_model_len=512, num_kvcache_blocks=3, num_speculative_tokens=5)),
    "speculation_chunked_prefill": ("mixed", dict(max_model_len=512, max_num_batched_tokens=64, max_num_seqs=8,
                                                  num_speculative_tokens=2, prompt_lookup_min=2)),
}


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers(tiny_model_dirs, references, family, regime):
    kind, settings = REGIMES[regime]
    prompts, expected, _ = references[family, kind]
    llm = LLM(str(tiny_model_dirs[family]), cpu_kvcache_space_gib=0.25, **settings)
    outputs = llm.generate(prompts, GREEDY)
    for i, (out, ref) in enumerate(zip(outputs, expected)):
        assert out.finish_reason == "length", out.error
        assert out.token_ids == ref, f"prompt {i} ({len(prompts[i])} tokens) diverged from transformers"
    if settings.get("num_speculative_tokens"):
        scheduler = llm.engine.scheduler
        assert scheduler.num_accepted_tokens > 0  # the regime did verify and keep proposals
    scheduler, block_manager = llm.engine.scheduler, llm.engine.block_manager
    if regime == "chunked_prefill":
        longest = max(len(p) for p in prompts)
        assert -(-longest // settings["max_num_batched_tokens"]) >= 3  # the longest prompt took >= 3 chunks
    if regime in ("preemption", "speculation_preemption"):
        assert scheduler.num_preemptions >= 10, scheduler.num_preemptions
    if regime == "prefix_cache":
        assert sum(o.num_cached_tokens for o in outputs) > 0
        assert block_manager.num_cache_hits > 0
    assert block_manager.num_free_blocks == block_manager.num_blocks  # nothing leaked
    if cpu_ops() is not None and cpu_ops().vectorized:  # the MLP's SiLU ran inside the gate_up GEMM
        assert llm.engine.model_runner.model.model.layers[0].mlp.gate_up_proj.packed_weight.kind == "gated"


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_cpu_decode_is_bit_identical_to_the_layer_loop(tiny_model_dirs, references, family, monkeypatch):
    """Pure-decode steps run every layer in one C++ call where they can (platforms/cpu/decode_runner.py: Llama and Qwen2
    here, not Qwen3's q/k norms): the same kernels in the same order, so the same tokens as transformers and
    the same log-probabilities, to the bit, as the per-layer path."""
    from nanoinfer.platforms.cpu.decode_runner import FusedDecode

    prompts, expected, _ = references[family, "mixed"]
    params = SamplingParams(temperature=0, max_tokens=NUM_REFERENCE_TOKENS, ignore_eos=True, logprobs=3)
    settings = dict(device="cpu", dtype="float32", max_model_len=512, cpu_kvcache_space_gib=0.25)
    llm = LLM(str(tiny_model_dirs[family]), **settings)
    calls = []
    original = FusedDecode.run
    monkeypatch.setattr(FusedDecode, "run", lambda self, *a: calls.append(1) or original(self, *a))
    fused = llm.generate(prompts, params)
    assert [out.token_ids for out in fused] == expected
    vectorized = cpu_ops() is not None and cpu_ops().vectorized
    assert bool(calls) == (vectorized and family != "qwen3")  # every decode step, where the path applies
    monkeypatch.setattr(FusedDecode, "applies", staticmethod(lambda *args: False))
    looped = LLM(str(tiny_model_dirs[family]), **settings).generate(prompts, params)
    assert [out.token_ids for out in looped] == expected
    for a, b in zip(fused, looped):
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fused_cpu_decode_in_bfloat16_on_amx_is_bit_identical_to_the_layer_loop(tiny_model_dirs, family, monkeypatch):
    """bfloat16 on an AMX CPU: pure-decode steps run every layer in one C++ call through the AMX GEMM, the same
    kernels as the per-layer path, so the same tokens and log-probabilities to the bit."""
    from nanoinfer.platforms.cpu.decode_runner import FusedDecode

    if cpu_ops() is None or not cpu_ops().amx_available():
        pytest.skip("no AMX on this CPU")
    import transformers

    prompts = make_prompts(transformers.AutoConfig.from_pretrained(tiny_model_dirs[family]).vocab_size)[:8]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    settings = dict(device="cpu", dtype="bfloat16", max_model_len=512, cpu_kvcache_space_gib=0.25)
    calls = []
    original = FusedDecode.run
    monkeypatch.setattr(FusedDecode, "run", lambda self, *a: calls.append(1) or original(self, *a))
    fused = LLM(str(tiny_model_dirs[family]), **settings).generate(prompts, params)
    assert calls  # every decode step
    monkeypatch.setattr(FusedDecode, "applies", staticmethod(lambda *args: False))
    looped = LLM(str(tiny_model_dirs[family]), **settings).generate(prompts, params)
    for a, b in zip(fused, looped):
        assert a.token_ids == b.token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_speculation_gives_the_tokens_of_plain_decoding(tmp_path, dtype):
    """Speculation keeps a proposed token only where the model's own greedy token is the same, and each
    verified row is computed as a lone decode row would be (csrc/paged_attention.cpp's runs of rows: on AMX
    several rows share the key tiles), so outputs equal plain decoding's in bfloat16 too, to the
    log-probability of the rows plain decoding samples. 64-dim heads, 3 query heads a KV head: SmolLM2's
    grouping, which the AMX attention takes."""
    from nanoinfer.testing.tiny_models import build_tiny_model

    path = build_tiny_model("llama", tmp_path / "llama", hidden_size=192, num_heads=6, num_kv_heads=2, head_dim=64)
    import transformers

    prompts = make_prompts(transformers.AutoConfig.from_pretrained(path).vocab_size)[:10]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    settings = dict(device="cpu", dtype=dtype, max_model_len=512, cpu_kvcache_space_gib=0.25)
    plain = LLM(str(path), **settings).generate(prompts, params)
    llm = LLM(str(path), num_speculative_tokens=4, **settings)
    speculated = llm.generate(prompts, params)
    assert [out.token_ids for out in speculated] == [out.token_ids for out in plain]
    assert llm.engine.scheduler.num_accepted_tokens > 0


def _snap_linears_to_q4_1(path) -> None:
    """Rewrite a saved model's linear weights as a GGUF Q4_1 file dequantizes them (llama.cpp's quantizer: per
    32 inputs m = min, d = (max - min) / 15, q = round((x - m) / d); then float16 d * q + float16 m)."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    for name, w in tensors.items():
        if w.dim() != 2 or "embed" in name or "lm_head" in name:
            continue
        blocks = w.reshape(w.shape[0], -1, 32)
        lo, hi = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
        d = (hi - lo) / 15
        q = ((blocks - lo) / d).add(0.5).floor().clamp(0, 15)
        tensors[name] = (d.half().float() * q + lo.half().float()).reshape(w.shape).contiguous()
    save_file(tensors, file, metadata={"format": "pt"})


def test_exact_4bit_weights_give_transformers_tokens(tmp_path, monkeypatch):
    """A float32 model whose linears are exactly 4-bit blocks (what a GGUF Q4_1 file dequantizes to; the built-in
    default model is one) keeps them in that form too: steps of few rows expand them for the panel GEMM (the
    float32 panels' bits), steps of many rows run on AMX (exact products, float32 sums in another order). The
    tokens of transformers; the fused decode loop's log-probabilities are the per-layer path's to the bit, and
    within float32 rounding of the float32 panels alone."""
    from nanoinfer.platforms.cpu.decode_runner import FusedDecode
    from nanoinfer.testing.tiny_models import build_tiny_model

    if cpu_ops() is None or cpu_ops().simd != "avx512":
        pytest.skip("the GEMM expands 4-bit weights with AVX-512 only")
    import transformers

    path = build_tiny_model("llama", tmp_path / "llama", hidden_size=96, num_heads=6, num_kv_heads=2, head_dim=16)
    _snap_linears_to_q4_1(path)
    vocab_size = transformers.AutoConfig.from_pretrained(path).vocab_size
    # 32 prompts: decode steps of 32 rows (the 4-bit form in chunked tiles), then fewer as prompts finish
    prompts = make_prompts(vocab_size, seed=3) + make_prompts(vocab_size, seed=4)
    lengths = [24 - i % 20 for i in range(len(prompts))]
    expected, _ = hf_greedy(path, prompts, 24)
    expected = [ids[:n] for ids, n in zip(expected, lengths)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3) for n in lengths]
    settings = dict(device="cpu", dtype="float32", max_model_len=512, cpu_kvcache_space_gib=0.25)
    llm = LLM(str(path), **settings)
    model = llm.engine.model_runner.model
    projections = [m for m in model.modules()
                   if getattr(m, "packed_weight", None) is not None and m is not model.lm_head]  # fmt: skip
    assert projections and all(m.packed_weight.compact is not None for m in projections)
    assert all((m.packed_weight.compact_amx is not None) == cpu_ops().amx_available() for m in projections)
    fused = llm.generate(prompts, params)
    assert [out.token_ids for out in fused] == expected
    monkeypatch.setattr(FusedDecode, "applies", staticmethod(lambda *args: False))
    looped = LLM(str(path), **settings).generate(prompts, params)
    monkeypatch.setattr("nanoinfer.platforms.cpu.linear.pack_compact", lambda weight, gated: None)
    plain = LLM(str(path), **settings).generate(prompts, params)
    for a, b, c in zip(fused, looped, plain):
        assert a.token_ids == b.token_ids == c.token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
        for step_a, step_c in zip(a.outputs[0].logprobs, c.outputs[0].logprobs):
            assert step_a.logprob == pytest.approx(step_c.logprob, rel=1e-4, abs=1e-5)
            assert [t for t, _ in step_a.top] == [t for t, _ in step_c.top]


@pytest.mark.parametrize("family", FAMILIES)
def test_mlp_row_chunks_match_transformers(tiny_model_dirs, references, family, monkeypatch):
    """A long prefill's MLP runs in row chunks on CPU (the platform's mlp_chunk_bytes); at the 64-row floor
    the 2,052-token step of 16 prompts runs in 33 chunks, the last of 4 rows, and must not change a token."""
    from nanoinfer.models.layers.mlp import GatedMLP
    from nanoinfer.platforms.cpu import CpuPlatform

    monkeypatch.setattr(CpuPlatform, "mlp_chunk_bytes", 1)
    calls = []
    original = GatedMLP._forward
    monkeypatch.setattr(GatedMLP, "_forward", lambda self, x: calls.append(x.shape[0]) or original(self, x))
    prompts, expected, _ = references[family, "mixed"]
    llm = LLM(str(tiny_model_dirs[family]), device="cpu", dtype="float32", max_model_len=512,
              cpu_kvcache_space_gib=0.25)  # fmt: skip
    outputs = llm.generate(prompts, GREEDY)
    assert [out.token_ids for out in outputs] == expected
    rows = sum(map(len, prompts))
    chunks = [min(64, rows - start) for start in range(0, rows, 64)]
    assert chunks[-1] == 4 and calls[: len(chunks)] == chunks  # the prefill step (then one call per decode step)


@pytest.mark.parametrize("family", FAMILIES)
def test_first_step_logits_match_transformers(tiny_model_dirs, references, family):
    prompts, _, expected_logits = references[family, "mixed"]
    llm = LLM(str(tiny_model_dirs[family]), max_model_len=512, cpu_kvcache_space_gib=0.25)
    scheduler = llm.engine.scheduler
    for i, prompt in enumerate(prompts):
        scheduler.add_request(Request(f"r{i}", prompt, GREEDY))
    out: SchedulerOutput = scheduler.schedule()
    assert len(out.scheduled) == len(prompts)
    logits = llm.engine.model_runner.compute_logits(out)
    max_diff = (logits - torch.stack(expected_logits)).abs().max().item()
    assert max_diff < 1e-4, max_diff


@pytest.mark.parametrize("family", FAMILIES)
def test_last_layer_runs_only_the_rows_a_step_samples_with_the_same_bits(tiny_model_dirs, references, family):
    """A prompt step samples one row a prompt, so the last layer's o_proj, norms and MLP run for those rows
    alone (DecoderModel.forward's logits_indices): the kept rows' hidden states are the full pass's bit for
    bit, the MLP sees 16 rows instead of 2,052, and a step that samples nothing returns no rows."""
    prompts, _, _ = references[family, "mixed"]
    llm = LLM(str(tiny_model_dirs[family]), device="cpu", dtype="float32", max_model_len=512,
              cpu_kvcache_space_gib=0.25)  # fmt: skip
    runner = llm.engine.model_runner
    for i, prompt in enumerate(prompts):
        llm.engine.scheduler.add_request(Request(f"r{i}", prompt, GREEDY))
    input_ids, positions, metadata, sample_indices, *_ = runner.prepare_inputs(llm.engine.scheduler.schedule())
    assert len(sample_indices) == len(prompts) < input_ids.numel()
    last_mlp = runner.model.model.layers[-1].mlp
    rows_seen = []
    last_mlp.register_forward_hook(lambda module, args, out: rows_seen.append(args[0].shape[0]))
    with torch.inference_mode():
        full = runner.run_model(input_ids, positions, metadata)
        kept = runner.run_model(input_ids, positions, metadata, sample_indices)
        none = runner.run_model(input_ids, positions, metadata, sample_indices[:0])
    assert rows_seen == [input_ids.numel(), len(prompts)]  # the third pass skipped the MLP
    assert torch.equal(kept, full[sample_indices])
    assert none.shape == (0, full.shape[1])


SYSTEM_PROMPT = (
    "You are a careful assistant for a geography quiz. Answer in one short sentence. "
    + " ".join(f"Rule {i}: be accurate, be brief, and name the place you mean." for i in range(1, 25))
)
PARAGRAPH = (
    "The river rises in the mountains, runs through forests and farmland, and reaches the sea after a long "
    "journey past old towns, bridges and mills. "
) * 8


def default_model_prompts(tokenizer) -> list[list[int]]:
    """8 real prompts: 4 raw (a long paragraph, then different endings; about 240 tokens, so decoding
    crosses the 256-token block boundary) and 4 chat-templated ones sharing a long system prompt."""
    endings = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "1, 2, 3, 4, 5,"]
    raw = [tokenizer.encode(PARAGRAPH + e) for e in endings]
    questions = ["What is the capital of France?", "Name a river in Germany.", "Where is Mount Fuji?",
                 "List three colors."]
    chats = []
    for q in questions:
        ids = tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}],
            add_generation_prompt=True, tokenize=True,
        )
        chats.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return raw + chats


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_bfloat16_greedy_is_close_to_transformers_by_logprobs(tiny_model_dirs, family):
    """bfloat16 on the CPU (our GEMMs sum in float32 and round once, in another order than transformers'), by
    vLLM's check_logprobs_close rule: where the two first differ, each token is in the other's top 5."""
    import transformers

    path = tiny_model_dirs[family]
    prompts = make_prompts(transformers.AutoConfig.from_pretrained(path).vocab_size)[:8]
    expected, _, expected_top = hf_greedy(path, prompts, 16, dtype=torch.bfloat16, top_k=5)
    llm = LLM(str(path), dtype="bfloat16", max_model_len=512, cpu_kvcache_space_gib=0.25)
    packed = getattr(llm.engine.model_runner.model.model.layers[0].mlp.gate_up_proj, "packed_weight", None)
    # The widening GEMM keeps SiLU-and-mul a separate op in bfloat16; the AMX one fuses it with its roundings.
    # (Nothing is packed on the plain-torch platform, with the kernels off.)
    assert packed is None or packed.kind != "gated"
    assert packed is not None or llm.engine.platform.name != "cpu" or not cpu_ops().vectorized
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5))
    ours = [(o.token_ids, [{t for t, _ in lp.top} for lp in o.outputs[0].logprobs]) for o in outputs]
    diverged = check_logprobs_close(ours, list(zip(expected, expected_top)), ("nanoinfer", "transformers"))
    print(f"bfloat16 {family}: {diverged}/{len(prompts)} sequences diverged within the top 5")
    assert diverged <= len(prompts) // 2, f"{diverged}/{len(prompts)} sequences diverged"


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize(("kv_cache_dtype", "torch_dtype", "shrink", "top_k"), [
    ("bfloat16", torch.bfloat16, 2, 5), ("fp8_e4m3", torch.float8_e4m3fn, 4, 5), ("fp8_e5m2", torch.float8_e5m2, 4, 10),
])  # fmt: skip
def test_narrower_kv_cache_is_close_to_transformers_by_logprobs(
    tiny_model_dirs, references, family, kv_cache_dtype, torch_dtype, shrink, top_k, monkeypatch
):
    """kv_cache_dtype bfloat16 / fp8 under a float32 model, with chunked prefill (later chunks read the rounded
    cache), against transformers in float32 by vLLM's check_logprobs_close rule (where the two first differ,
    each token is in the other's top 5; top 10 for e5m2's 2 mantissa bits, whose llama run had a token 6th);
    the cache is 1/2 or 1/4 the bytes, so 2 or 4 times the blocks fit.

    bfloat16 keeps most sequences identical. fp8's 2-3 mantissa bits move these tiny random models' near-flat
    logits early (first differences at tokens 0-16, measured), so there the C++ kernels must also give the
    torch path's exact tokens: both round the cache alike, bit for bit."""
    prompts, _, _ = references[family, "mixed"]
    path = tiny_model_dirs[family]
    expected, _, expected_top = hf_greedy(path, prompts[:8], 16, top_k=top_k)
    settings = dict(max_model_len=512, cpu_kvcache_space_gib=0.25, max_num_batched_tokens=64, max_num_seqs=8)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=top_k)
    llm = LLM(str(path), kv_cache_dtype=kv_cache_dtype, **settings)
    assert llm.config.dtype == "float32" and llm.config.kv_cache_dtype == kv_cache_dtype
    assert all(t.dtype == torch_dtype for pair in llm.engine.model_runner.kv_caches for t in pair)
    outputs = llm.generate(prompts[:8], params)
    ours = [(o.token_ids, [{t for t, _ in lp.top} for lp in o.outputs[0].logprobs]) for o in outputs]
    diverged = check_logprobs_close(ours, list(zip(expected, expected_top)), ("nanoinfer", "transformers"))
    print(f"{kv_cache_dtype} KV cache, {family}: {diverged}/8 sequences diverged within the top {top_k}")
    if torch_dtype == torch.bfloat16:
        assert diverged <= 4, f"{diverged}/8 sequences diverged"
    elif cpu_ops() is not None:
        from nanoinfer.attention.torch_backend import TorchBackend
        from nanoinfer.platforms.cpu import CpuKernelPlatform

        monkeypatch.setattr(CpuKernelPlatform, "attention_backend", lambda self, name: TorchBackend())
        torch_path = LLM(str(path), kv_cache_dtype=kv_cache_dtype, **settings)  # the C++ GEMMs, torch's attention
        assert [o.token_ids for o in torch_path.generate(prompts[:8], params)] == [o.token_ids for o in outputs]
    full = LLM(str(path), **settings).engine.plan
    assert llm.engine.plan.block_bytes * shrink == full.block_bytes
    assert llm.engine.plan.num_blocks == shrink * full.num_blocks


def test_default_model_matches_transformers(default_model_dir):
    """The real SmolLM2-135M-Instruct on 8 prompts (chat-templated and raw), in every regime."""
    from transformers import AutoTokenizer

    prompts = default_model_prompts(AutoTokenizer.from_pretrained(default_model_dir))
    assert all(200 < len(p) < 256 for p in prompts[:4]) and all(len(p) > 256 for p in prompts[4:])
    num_tokens = 24
    expected, _ = hf_greedy(default_model_dir, prompts, num_tokens)
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    regimes = {
        "one_batch": dict(max_model_len=512),
        "chunked_prefill": dict(max_model_len=512, max_num_batched_tokens=96, max_num_seqs=8),
        "preemption": dict(max_model_len=512, num_kvcache_blocks=3),
        "prefix_cache": dict(max_model_len=512, max_num_seqs=2),
        "block_size_512": dict(max_model_len=1024, kvcache_block_size=512),
    }
    for regime, settings in regimes.items():
        llm = LLM(str(default_model_dir), cpu_kvcache_space_gib=0.5, **settings)
        outputs = llm.generate(prompts, params)
        for i, (out, ref) in enumerate(zip(outputs, expected)):
            assert out.token_ids == ref, f"{regime}: prompt {i} diverged from transformers"
        if regime == "preemption":
            assert llm.engine.scheduler.num_preemptions >= 1
        if regime == "prefix_cache":
            assert sum(o.num_cached_tokens for o in outputs[4:]) >= 2 * 256  # the shared system prompt
