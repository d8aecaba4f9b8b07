"""Every model family beyond the three of test_hf_equivalence.py, as a tiny random model built with transformers'
own classes and the options its published checkpoints set (a sliding window shorter than the prompts, soft caps,
partial rotary, ...): greedy float32 output equals transformers token for token, and each chosen token's
log-probability agrees, in one batch, with chunked prefill, under preemption and on prefix-cache hits (hybrid
models, whose linear-attention state is not cached, run that workload with prefix caching off)."""

from __future__ import annotations

import random

import pytest

from nanoinfer import LLM, SamplingParams
from nanoinfer.testing.hf_reference import hf_greedy_logprobs
from nanoinfer.testing.tiny_models import build_tiny_model

# Families whose tiny model this file checks (nanoinfer.testing.tiny_models.TINY_FAMILIES).
FAMILIES = [
    "mistral",
    "qwen3_window",
    "gemma",
    "gemma2",
    "gemma3",
    "gemma3_multimodal",
    "phi3",
    "phi4_mini",
    "smollm3",
    "olmo2",
    "olmo3",
    "gemma4",
    "gemma4_multimodal",
    "gemma4_moe",
    "qwen3_moe",
    "qwen3_moe_mixed",
    "mixtral",
    "gpt_oss",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_5_multimodal",
]
NUM_TOKENS = 24
# Log-probabilities: the engine's float32 logits agree with transformers' to 1e-4 (summation order only; the
# bound test_hf_equivalence.py's first-step test holds them to), and log_softmax moves by at most twice that.
LOGPROB_TOLERANCE = 2e-4


def _prompts(vocab_size: int, lengths: list[int], seed: int, prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab_size) for _ in range(prefix)]
    return [shared + [rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


PROMPT_SETS = {
    # mixed lengths, most beyond a tiny model's window, crossing the 256-token block boundary
    "mixed": lambda vocab: _prompts(vocab, [3, 12, 30, 47, 90, 150, 230, 256, 257, 300], seed=0),
    # each crosses the block boundary while decoding, so a 3-block cache keeps preempting
    "boundary": lambda vocab: _prompts(vocab, [236 + 2 * i for i in range(8)], seed=2),
    # a 600-token shared prefix (two full blocks) with distinct tails
    "shared": lambda vocab: _prompts(vocab, [5 + 3 * i for i in range(6)], seed=1, prefix=600),
}
REGIMES = {
    "one_batch": ("mixed", dict(max_model_len=512)),
    "chunked_prefill": ("mixed", dict(max_model_len=512, max_num_batched_tokens=64, max_num_seqs=4)),
    "preemption": ("boundary", dict(max_model_len=512, num_kvcache_blocks=3)),
    "prefix_cache": ("shared", dict(max_model_len=1024, max_num_seqs=2)),
}


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: build_tiny_model(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="module")
def family_references(family_models):
    import transformers

    refs = {}
    for family, path in family_models.items():
        vocab = transformers.AutoConfig.from_pretrained(path).get_text_config().vocab_size  # Gemma 3 VL nests it
        for kind, make in PROMPT_SETS.items():
            prompts = make(vocab)
            refs[family, kind] = (prompts, *hf_greedy_logprobs(path, prompts, NUM_TOKENS))
    return refs


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_and_logprobs_match_transformers(family_models, family_references, family, regime):
    kind, settings = REGIMES[regime]
    prompts, expected, expected_logprobs = family_references[family, kind]
    llm = LLM(str(family_models[family]), dtype="float32", cpu_kvcache_space_gib=0.25, **settings)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=1)
    outputs = llm.generate(prompts, params)
    for i, (out, ref, ref_logprobs) in enumerate(zip(outputs, expected, expected_logprobs)):
        assert out.token_ids == ref, f"prompt {i} ({len(prompts[i])} tokens) diverged from transformers"
        ours = [entry.logprob for entry in out.outputs[0].logprobs]
        worst = max(abs(a - b) for a, b in zip(ours, ref_logprobs))
        assert worst < LOGPROB_TOLERANCE, f"prompt {i}: log-probabilities differ by {worst}"
    scheduler, block_manager = llm.engine.scheduler, llm.engine.block_manager
    if regime == "preemption":
        assert scheduler.num_preemptions >= 5, scheduler.num_preemptions
    if regime == "prefix_cache" and llm.engine.config.model_spec.is_hybrid:
        assert not llm.engine.config.enable_prefix_caching and block_manager.num_cache_hits == 0
    elif regime == "prefix_cache":
        assert block_manager.num_cache_hits > 0
    assert block_manager.num_free_blocks == block_manager.num_blocks
    assert len(block_manager.free_state_slots) == block_manager.num_state_slots  # every slot handed back
