"""Multi-LoRA equals transformers + PEFT token for token (greedy, float32): adapters of different ranks and targets and
the base model interleaved in one batch, through slot swaps (more adapters than max_loras), chunked prefill and
preemption, and the prefix cache (the same prompt under two adapters never shares KV)."""

from __future__ import annotations

import random

import pytest

from nanoinfer import LLM, LoRARequest, SamplingParams
from nanoinfer.errors import ConfigError, LoRAError, RequestError
from nanoinfer.testing.tiny_lora import build_tiny_adapter, peft_greedy
from nanoinfer.testing.tiny_models import build_tiny_model

NUM_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# (rank, targets, lora_alpha, use_rslora): every projection somewhere, three ranks, both scalings
ADAPTERS = [(8, ("q_proj", "v_proj"), 16, False), (16, ALL_TARGETS, 32, False), (4, ("o_proj", "down_proj"), 8, True)]


@pytest.fixture(scope="module")
def llama_with_adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model = build_tiny_model("llama", root / "llama")
    loras = [
        LoRARequest(f"adapter{i}", i, str(build_tiny_adapter(model, root / f"adapter{i}", rank=rank,
                                                             target_modules=targets, lora_alpha=alpha,
                                                             use_rslora=rslora, seed=i)))
        for i, (rank, targets, alpha, rslora) in enumerate(ADAPTERS, start=1)
    ]  # fmt: skip
    return model, loras


def references(model_dir, prompts, choice) -> list[list[int]]:
    """The reference tokens of prompt i under adapter choice[i] (None: the base model)."""
    expected = [None] * len(prompts)
    for lora in {c for c in choice}:
        rows = [i for i, c in enumerate(choice) if c == lora]
        tokens = peft_greedy(model_dir, lora.lora_path if lora else None, [prompts[i] for i in rows], NUM_TOKENS)
        for i, t in zip(rows, tokens):
            expected[i] = t
    return expected


def make_prompts(n: int, seed: int, lengths=(5, 9, 17, 40, 70, 120)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


@pytest.mark.parametrize("regime", ["one_batch", "chunked_preempted", "mlp_chunks"])
def test_mixed_batch_equals_peft(llama_with_adapters, regime, monkeypatch):
    model, loras = llama_with_adapters
    prompts = make_prompts(16, seed=0)
    if regime == "mlp_chunks":  # the MLP runs 64 rows at a time: each chunk's rows read their own adapters' slots
        from nanoinfer.platforms.cpu import CpuPlatform

        monkeypatch.setattr(CpuPlatform, "mlp_chunk_bytes", 1024)
    settings = dict(enable_lora=True, max_loras=2, max_lora_rank=16)  # 3 adapters, 2 slots: adapters swap in and out
    if regime == "chunked_preempted":  # prompts that cross a block boundary while decoding, in a 3-block cache
        prompts = make_prompts(16, seed=0, lengths=tuple(range(236, 252)))
        settings |= dict(max_num_batched_tokens=64, max_num_seqs=16, num_kvcache_blocks=3, max_model_len=512)
    choice = [([None, *loras])[i % 4] for i in range(len(prompts))]
    llm = LLM(model, **settings)
    outs = llm.generate(prompts, GREEDY, lora_request=choice)
    assert llm.engine.model_runner.lora_manager.num_slot_loads > 2  # 3 adapters through 2 slots: one was given up
    expected = references(model, prompts, choice)
    assert [o.token_ids for o in outs] == expected
    assert [o.lora_request for o in outs] == choice
    if regime == "chunked_preempted":
        assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    # Each adapter changes what the model says (the comparison above could not pass with adapters ignored) ...
    base = references(model, prompts, [None] * len(prompts))
    for lora in loras:
        assert any(e != b for e, b, c in zip(expected, base, choice) if c == lora), lora.lora_name
    # ... and base requests in the mixed batch equal a base-only run.
    plain = LLM(model, **{k: v for k, v in settings.items() if not k.startswith(("enable_lora", "max_lora"))})
    base_outs = plain.generate(prompts, GREEDY)
    assert [o.token_ids for o, c in zip(outs, choice) if c is None] == [
        o.token_ids for o, c in zip(base_outs, choice) if c is None]


def test_fused_checkpoint_targets_equal_peft(tmp_path):
    """Phi-3's checkpoint fuses q/k/v and gate/up: an adapter on qkv_proj / gate_up_proj has one A for all slices."""
    model = build_tiny_model("phi3", tmp_path / "phi3")
    adapter = build_tiny_adapter(model, tmp_path / "fused", rank=8, target_modules=("qkv_proj", "gate_up_proj",
                                                                                     "o_proj"), seed=5)  # fmt: skip
    lora = LoRARequest("fused", 1, str(adapter))
    prompts = make_prompts(4, seed=3)
    llm = LLM(model, enable_lora=True, max_lora_rank=8)
    outs = llm.generate(prompts, GREEDY, lora_request=lora)
    assert [o.token_ids for o in outs] == references(model, prompts, [lora] * 4)


def test_prefix_cache_keys_blocks_by_adapter(llama_with_adapters):
    """One prompt (two full blocks and a partial one) under two adapters and the base model: three different
    answers, each its reference; the second run of each is served from the cache, the others never are."""
    model, loras = llama_with_adapters
    prompt = make_prompts(1, seed=7, lengths=(600,))[0]
    llm = LLM(model, enable_lora=True, max_loras=2, max_lora_rank=16)
    order = [loras[0], loras[1], None, loras[0], loras[1], None]
    outs = [llm.generate([prompt], GREEDY, lora_request=lora)[0] for lora in order]
    expected = references(model, [prompt] * 3, [loras[0], loras[1], None])
    assert [o.token_ids for o in outs] == expected * 2
    assert len({tuple(t) for t in expected}) == 3
    assert [o.num_cached_tokens for o in outs[:3]] == [0, 0, 0]  # nothing cached under another adapter is used
    assert all(o.num_cached_tokens >= 512 for o in outs[3:])  # its own adapter's blocks are


def test_bad_adapters_are_refused_at_check_time_and_at_run_time(llama_with_adapters, tmp_path):
    model, loras = llama_with_adapters
    dora = build_tiny_adapter(model, tmp_path / "dora", rank=4, target_modules=("q_proj",), use_dora=True)
    head = build_tiny_adapter(model, tmp_path / "head", rank=4, target_modules=("q_proj", "lm_head"))
    bad = {"missing": str(tmp_path / "nowhere"), "big": loras[1].lora_path, "dora": str(dora), "head": str(head)}
    with pytest.raises(ConfigError) as info:
        LLM(model, loras=bad, max_lora_rank=8)
    problems = {}  # every adapter's problems, all at once
    for problem in info.value.problems:
        (name,) = problem.value
        problems[name] = problems.get(name, "") + problem.message
    assert set(problems) == set(bad)
    assert "is not a folder" in problems["missing"]
    assert "rank 16, over max_lora_rank 8 (model.layers.0.mlp.down_proj" in problems["big"]
    assert "DoRA" in problems["dora"]
    assert "lm_head" in problems["head"]
    llm = LLM(model, enable_lora=True, max_lora_rank=8)
    for i, (name, path) in enumerate(bad.items(), start=10):
        with pytest.raises(RequestError) as info:
            llm.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest(name, i, path))
        assert info.value.code == "invalid_lora"
    # a refused adapter anywhere in a generate() call queues none of its prompts
    with pytest.raises(RequestError):
        llm.generate([[5, 6, 7]] * 3, GREEDY, lora_request=[loras[0], None, LoRARequest("big", 20, bad["big"])])
    assert not llm.has_unfinished_requests()
    with pytest.raises(RequestError, match="a LoRARequest, None, or a list"):
        llm.generate([[5, 6, 7]], GREEDY, lora_request=5)
    for lora_id in (0, 2**62, True):
        with pytest.raises(LoRAError, match="lora_int_id must be an integer from 1"):
            LoRARequest("x", lora_id, bad["big"])
    # the engine still serves good requests after refusing bad ones
    assert llm.generate([[5, 6, 7]], GREEDY, lora_request=loras[0])[0].finish_reason == "length"


def test_lora_requests_need_enable_lora(llama_with_adapters):
    model, loras = llama_with_adapters
    llm = LLM(model)
    with pytest.raises(RequestError, match="enable_lora=True"):
        llm.generate([[5, 6, 7]], GREEDY, lora_request=loras[0])


@pytest.mark.parametrize("family", ["llama", "phi3", "gemma4", "qwen3_5"])
def test_slots_take_what_plan_memory_counts(tmp_path, family):
    """The slots the engine allocates are the bytes ModelSpec.lora_slot_bytes plans for (plan-memory): fused layers,
    Gemma 4's layers holding q alone (KV shared from an earlier layer), a hybrid model's attention layers."""
    model = build_tiny_model(family, tmp_path / family)
    llm = LLM(model, enable_lora=True, max_loras=3, max_lora_rank=8)
    manager = llm.engine.model_runner.lora_manager
    assert manager.nbytes == 3 * llm.config.model_spec.lora_slot_bytes(8, 4) > 0


def test_gemma4_layers_sharing_kv_take_q_adapters(tmp_path):
    """Gemma 4's KV-sharing layers hold q alone: an adapter on q/o and the MLP equals PEFT there too."""
    model = build_tiny_model("gemma4", tmp_path / "gemma4")
    adapter = build_tiny_adapter(model, tmp_path / "adapter", rank=4, seed=9,
                                 target_modules=("q_proj", "o_proj", "gate_proj", "down_proj"))  # fmt: skip
    lora = LoRARequest("g", 1, str(adapter))
    prompts = make_prompts(3, seed=5)
    outs = LLM(model, enable_lora=True, max_lora_rank=4).generate(prompts, GREEDY, lora_request=lora)
    assert [o.token_ids for o in outs] == references(model, prompts, [lora] * 3)
