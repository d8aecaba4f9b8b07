"""Hybrid models (linear-attention layers with a state per sequence, Qwen3-Next and Qwen3.5): the state cache's
slots as the scheduler hands them out, what Config refuses or switches off for them, and the reference delta rule
against transformers' own functions. Token-for-token equality with transformers in every regime is in
test_families.py; tensor parallelism in tests/distributed."""

from __future__ import annotations

import random

import pytest
import torch

from nanoinfer import LLM, SamplingParams, memory
from nanoinfer.attention import gated_delta
from nanoinfer.attention.metadata import AttentionMetadata
from nanoinfer.config import Config
from nanoinfer.errors import ConfigError, OutOfMemoryError
from nanoinfer.testing.hf_reference import check_logprobs_close, hf_greedy, hf_greedy_logprobs
from nanoinfer.testing.tiny_models import build_tiny_model

NUM_TOKENS = 16


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    return build_tiny_model("qwen3_5", tmp_path_factory.mktemp("hybrid") / "qwen3_5")


def budget_for(llm_kwargs: dict, folder, num_slots: float, num_blocks: int) -> float:
    """cpu_kvcache_space_gib that leaves room for num_slots state slots beside num_blocks KV blocks."""
    config = Config(model=str(folder), **llm_kwargs)
    slot = memory.state_slot_bytes(config.model_spec, 1, config.dtype)
    block = memory.kv_block_bytes(config.model_spec, config.kvcache_block_size, 1, config.dtype)
    return (num_blocks * block + num_slots * slot) / memory.GiB


def test_sequences_wait_for_a_state_slot_and_all_finish_equal_to_transformers(qwen3_5):
    """Two slots for six prompts: at most two sequences run at once, the rest are admitted as slots free up, and
    every output is still transformers' (no state leaks from a slot's earlier owner)."""
    settings = dict(dtype="float32", max_model_len=512, num_kvcache_blocks=6)
    space = budget_for(settings, qwen3_5, num_slots=2.5, num_blocks=6)
    llm = LLM(str(qwen3_5), cpu_kvcache_space_gib=space, **settings)
    assert llm.engine.plan.num_state_slots == 2
    scheduler = llm.engine.scheduler
    running, schedule = [], scheduler.schedule

    def recording_schedule():
        out = schedule()
        running.append(len(out.scheduled))
        return out

    scheduler.schedule = recording_schedule
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 40, 9, 120, 2, 60)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
    expected, _ = hf_greedy_logprobs(qwen3_5, prompts, NUM_TOKENS)
    assert [o.token_ids for o in outputs] == expected
    assert max(running) == 2
    assert len(llm.engine.block_manager.free_state_slots) == 2


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_bfloat16_greedy_is_close_to_transformers_by_logprobs(tmp_path, family):
    """bfloat16 (the state stays float32 in both; the projections, the convolution and the norms round), by vLLM's
    check_logprobs_close rule: where the two first differ, each token is in the other's top 5."""
    path = build_tiny_model(family, tmp_path / family)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (4, 30, 75, 140, 200, 9, 60, 110)]
    expected, _, expected_top = hf_greedy(path, prompts, NUM_TOKENS, dtype=torch.bfloat16, top_k=5)
    llm = LLM(str(path), dtype="bfloat16", max_model_len=512, cpu_kvcache_space_gib=0.25)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5))
    ours = [(o.token_ids, [{t for t, _ in lp.top} for lp in o.outputs[0].logprobs]) for o in outputs]
    diverged = check_logprobs_close(ours, list(zip(expected, expected_top)), ("nanoinfer", "transformers"))
    assert diverged <= len(prompts) // 2, f"{diverged}/{len(prompts)} sequences diverged"


def test_prefix_caching_is_switched_off_with_a_notice(qwen3_5, caplog):
    with caplog.at_level("WARNING", logger="nanoinfer"):
        llm = LLM(str(qwen3_5), dtype="float32", max_model_len=256, cpu_kvcache_space_gib=0.05)
    assert [r.getMessage() for r in caplog.records if "prefix caching" in r.getMessage()] == [
        "prefix caching is off for a model with linear-attention layers (its prefixes would also need the layers' "
        "state, which is not cached)"
    ]
    assert not llm.config.enable_prefix_caching
    assert any(field == "enable_prefix_caching" and "linear-attention" in why for field, _, why in llm.config.notes)


def test_speculative_decoding_is_refused_by_name(qwen3_5):
    with pytest.raises(ConfigError, match="num_speculative_tokens.*must be 0 for Qwen3_5ForCausalLM"):
        LLM(str(qwen3_5), dtype="float32", max_model_len=256, num_speculative_tokens=2)


def test_a_budget_without_room_for_one_state_slot_is_an_error(qwen3_5):
    settings = dict(dtype="float32", max_model_len=256, num_kvcache_blocks=1)
    space = budget_for(settings, qwen3_5, num_slots=0.5, num_blocks=1)
    with pytest.raises(OutOfMemoryError, match="No room for one sequence's linear-attention state"):
        LLM(str(qwen3_5), cpu_kvcache_space_gib=space, **settings)


# ---- the reference delta rule --------------------------------------------------------------------------------
def _metadata(query_lens: list[int], seq_lens: list[int], slots: list[int]) -> AttentionMetadata:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.empty(0), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=torch.empty(0), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_lens_cpu=query_lens, seq_lens_cpu=seq_lens,
        state_slots=torch.tensor(slots, dtype=torch.int32),
    )  # fmt: skip


def _inputs(num_tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    k_heads, v_heads, k_dim, v_dim = 2, 4, 16, 8
    q, k = (torch.randn(num_tokens, k_heads, k_dim, generator=gen) for _ in range(2))
    v = torch.randn(num_tokens, v_heads, v_dim, generator=gen)
    return q, k, v, -torch.rand(num_tokens, v_heads, generator=gen), torch.rand(num_tokens, v_heads, generator=gen)


# float32 throughout: the two forms (and transformers') differ only in the order of their sums, a few ulps of O(1)
# values per token, decayed (exp(g) <= 1) as the state carries them; 1e-5 is far above that and far below the
# outputs' size.
TOLERANCE = dict(atol=1e-5, rtol=1e-5)


def test_chunked_prefill_pieces_continue_the_state_as_one_pass_does():
    """A 150-token prompt as one step, and as 100 + 49 + 1 tokens (the last by the recurrent form): the same
    outputs and final state, equal to transformers' chunked rule on the whole prompt."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    q, k, v, g, beta = _inputs(150)
    expected, expected_state = hf.torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g=g[None], beta=beta[None], output_final_state=True, use_qk_l2norm_in_kernel=True
    )  # fmt: skip
    state = torch.full((3, 4, 16, 8), float("nan"))  # a slot's earlier contents must never be read
    whole = gated_delta.gated_delta_rule(q, k, v, g, beta, state, _metadata([150], [150], [1]))
    torch.testing.assert_close(whole, expected[0], **TOLERANCE)
    torch.testing.assert_close(state[1], expected_state[0], **TOLERANCE)
    assert state[0].isnan().all() and state[2].isnan().all()

    pieces = []
    for start, end in ((0, 100), (100, 149), (149, 150)):
        rows = slice(start, end)
        pieces.append(gated_delta.gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], state,
                                                   _metadata([end - start], [end], [2])))  # fmt: skip
    torch.testing.assert_close(torch.cat(pieces), expected[0], **TOLERANCE)
    torch.testing.assert_close(state[2], expected_state[0], **TOLERANCE)


def test_a_padded_row_reads_and_writes_no_slot():
    q, k, v, g, beta = _inputs(3, seed=1)
    x, weight = torch.randn(3, 6), torch.randn(6, 4)
    state, conv_state = torch.randn(2, 4, 16, 8), torch.randn(2, 6, 3)
    unpadded = state.clone(), conv_state.clone()
    padded = _metadata([1, 1, 1], [5, 1, 7], [0, -1, 1])  # the middle row: a CUDA graph's padding
    gated_delta.gated_delta_rule(q, k, v, g, beta, state, padded)
    gated_delta.causal_conv1d(x, weight, conv_state, padded)
    rows, single = [0, 2], _metadata([1, 1], [5, 7], [0, 1])
    gated_delta.gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], unpadded[0], single)
    gated_delta.causal_conv1d(x[rows], weight, unpadded[1], single)
    torch.testing.assert_close(state, unpadded[0], atol=0, rtol=0)  # the padded row changed nothing
    torch.testing.assert_close(conv_state, unpadded[1], atol=0, rtol=0)


def test_the_convolution_continues_from_its_slot_as_transformers_convolves_the_whole_prompt():
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    gen = torch.Generator().manual_seed(2)
    x, weight = torch.randn(40, 6, generator=gen), torch.randn(6, 4, generator=gen)
    expected = hf.causal_conv1d_fn(x.t()[None], weight, None, activation="silu")[0].t()
    conv_state = torch.full((2, 6, 3), float("nan"))
    pieces = [gated_delta.causal_conv1d(x[a:b], weight, conv_state, _metadata([b - a], [b], [1]))
              for a, b in ((0, 2), (2, 3), (3, 40))]  # fmt: skip
    torch.testing.assert_close(torch.cat(pieces), expected, **TOLERANCE)
