"""Prompt logprobs and scoring against transformers' log_softmax over the prompt (float32, CPU): in one batch,
with chunked prefill, preemption, on prefix-cache hits (whole blocks and a shared partly filled block), and
max_tokens=0 as score only."""

from __future__ import annotations

import pytest
import torch

from nanoinfer import LLM, SamplingParams
from nanoinfer.testing.hf_reference import hf_model

# float32 on both sides: the kernels' sums differ in order only, so 1e-4 (the issue's bound) holds with room
TOLERANCE = 1e-4
TOP = 3


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return str(tiny_model_dirs["llama"])


@pytest.fixture(scope="module")
def hf(model_dir):
    return hf_model(model_dir)


def reference(hf, token_ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax over the prompt: row p is the distribution of token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([token_ids])).logits[0].float(), dim=-1)


def check_prompt_logprobs(hf, token_ids: list[int], logprobs: list, start: int = 1) -> None:
    assert len(logprobs) == len(token_ids)
    assert all(lp is None for lp in logprobs[:start])
    ref = reference(hf, token_ids)
    for p in range(start, len(token_ids)):
        lp = logprobs[p]
        assert lp.token_id == token_ids[p]
        assert abs(lp.logprob - ref[p - 1, token_ids[p]].item()) < TOLERANCE, p
        top_values, top_ids = torch.topk(ref[p - 1], len(lp.top))
        assert [t for t, _ in lp.top] == top_ids.tolist(), p
        assert max(abs(v - r) for (_, v), r in zip(lp.top, top_values.tolist())) < TOLERANCE


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 500, (n,), generator=g).tolist() for n in lengths]


def make_llm(model_dir: str, **settings) -> LLM:
    settings = {"max_model_len": 1024, **settings}
    return LLM(model_dir, device="cpu", dtype="float32", cpu_kvcache_space_gib=0.25, **settings)


def run(llm: LLM, requests: list[tuple[list[int], SamplingParams, int]]) -> list:
    """Add (prompt, params, prompt_logprobs_start) requests at once, step to the end; outputs in request order."""
    ids = [llm.add_request(p, sp, prompt_logprobs_start=start) for p, sp, start in requests]
    outputs = {}
    while llm.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in llm.step()[0])
    return [outputs[i] for i in ids]


SCORE = SamplingParams(max_tokens=0, prompt_logprobs=TOP)


def test_score_only_in_one_batch_with_generation_beside(model_dir, hf):
    llm = make_llm(model_dir)
    batch = prompts(0, [40, 300, 7, 129])
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    outs = run(llm, [(p, SCORE, 1) for p in batch] + [(batch[1], greedy, 1)])
    for p, out in zip(batch, outs):
        assert out.finish_reason == "length" and out.outputs[0].token_ids == []
        check_prompt_logprobs(hf, p, out.prompt_logprobs)
    generated = outs[-1]
    assert len(generated.token_ids) == 6 and all(lp.top == [] for lp in generated.prompt_logprobs[1:])
    assert [lp.logprob for lp in generated.prompt_logprobs[1:]] == [lp.logprob for lp in outs[1].prompt_logprobs[1:]]
    with torch.no_grad():
        expected = hf.generate(torch.tensor([batch[1]]), max_new_tokens=6, do_sample=False)[0, len(batch[1]):]
    assert generated.token_ids == expected.tolist()


def test_chunked_prefill_and_preemption(model_dir, hf):
    # 64-token steps cut every prompt into chunks; each sequence crosses the 256-token block boundary while it
    # decodes, so a 3-block cache keeps preempting (by recompute: the prompt logprobs are not asked twice).
    llm = make_llm(model_dir, max_model_len=512, max_num_batched_tokens=64, max_num_seqs=4,
                   num_kvcache_blocks=3)
    batch = prompts(1, [236 + 2 * i for i in range(6)])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=TOP)
    outs = run(llm, [(p, params, 1) for p in batch])
    for p, out in zip(batch, outs):
        check_prompt_logprobs(hf, p, out.prompt_logprobs)
        with torch.no_grad():
            expected = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p):]
        assert out.token_ids == expected.tolist()
    assert llm.engine.scheduler.num_preemptions >= 2


def test_prefix_cache_hits_return_every_asked_logprob(model_dir, hf):
    llm = make_llm(model_dir)
    context, *continuations = prompts(2, [300, 9, 14, 3, 30])
    first = run(llm, [(context + continuations[0], SCORE, len(context))])[0]
    # The rest of the group together, after the first finished: whole blocks hit, the partly filled one is taken
    # by one and copied by the others.
    rest = run(llm, [(context + c, SCORE, len(context)) for c in continuations[1:]])
    for c, out in zip(continuations, [first, *rest]):
        check_prompt_logprobs(hf, context + c, out.prompt_logprobs, start=len(context))
    assert first.num_cached_tokens == 0
    assert [o.num_cached_tokens for o in rest] == [len(context) - 1] * 3  # the context's last row is needed
    # A request asking for every prompt logprob gets them all, from a recomputed prefix.
    full = run(llm, [(context + continuations[1], SCORE, 1)])[0]
    check_prompt_logprobs(hf, context + continuations[1], full.prompt_logprobs)
    assert full.num_cached_tokens == 0


def test_generation_after_a_shared_partial_block_equals_transformers(model_dir, hf):
    llm = make_llm(model_dir)
    context, *tails = prompts(3, [200, 5, 8, 12])
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    run(llm, [(context + tails[0], greedy, 1)])  # leaves its partly filled block in the cache
    outs = run(llm, [(context + t, greedy, 1) for t in tails])
    assert [o.num_cached_tokens for o in outs] == [len(context) + len(tails[0]) - 1, len(context), len(context)]
    for t, out in zip(tails, outs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([context + t]), max_new_tokens=8, do_sample=False)
        assert out.token_ids == expected[0, len(context) + len(t):].tolist()


def test_n_sequences_share_one_list_of_prompt_logprobs(model_dir, hf):
    llm = make_llm(model_dir)
    prompt = prompts(4, [50])[0]
    out = run(llm, [(prompt, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4, prompt_logprobs=1), 1)])[0]
    assert len(out.outputs) == 3
    check_prompt_logprobs(hf, prompt, out.prompt_logprobs)


def test_max_tokens_zero_without_prompt_logprobs_finishes_without_a_step(model_dir):
    llm = make_llm(model_dir)
    outs = run(llm, [(prompts(5, [20])[0], SamplingParams(max_tokens=0), 1)])
    assert outs[0].finish_reason == "length" and outs[0].token_ids == [] and outs[0].prompt_logprobs is None


def test_a_step_that_fails_before_its_forward_pass_hands_its_copies_to_the_next(model_dir, hf):
    """Ctrl-C inside a step, after the scheduler shared rows inside a block but before the copy: the next step copies
    them, so the rows the prompt reads are its own (a lost copy would serve stale rows, silently)."""
    llm = make_llm(model_dir)
    context, *tails = prompts(6, [120, 4, 7])
    run(llm, [(context + tails[0], SCORE, len(context))])
    runner = llm.engine.model_runner
    execute = runner.execute
    runner.execute = lambda out: (_ for _ in ()).throw(KeyboardInterrupt())
    llm.add_request(context + tails[1], SCORE, prompt_logprobs_start=len(context))
    with pytest.raises(KeyboardInterrupt):
        llm.step()
    runner.execute = execute
    outs = []
    while llm.has_unfinished_requests():
        outs += llm.step()[0]
    assert outs[0].num_cached_tokens == len(context) - 1
    check_prompt_logprobs(hf, context + tails[1], outs[0].prompt_logprobs, start=len(context))
