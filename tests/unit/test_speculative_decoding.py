"""n-gram speculative decoding without a model: the proposer (engine/ngram_proposer.py) against a scan of the
whole sequence, and the scheduler's verification (engine/scheduler.py) against plain decoding. A "model" here
is a function from a sequence's tokens to its next greedy token, so every output plain decoding gives is
known, and speculation must give exactly the same tokens, finish reasons and block accounting."""

from __future__ import annotations

import random

import pytest
from factories import EOS, make_request, make_scheduler

from nanoinfer.engine.ngram_proposer import NgramProposer
from nanoinfer.engine.scheduler import SchedulerOutput


def scan_propose(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """What the proposer must return: the tokens after the latest earlier occurrence of the last n tokens,
    longest n first, by scanning the whole sequence."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) <= n:
            continue
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k]
    return []


def test_proposer_matches_a_scan_of_the_whole_sequence_as_the_sequence_grows():
    rng = random.Random(0)
    for _ in range(40):
        min_n, max_n = rng.choice([(1, 1), (1, 3), (2, 4), (3, 3)])
        k = rng.randint(1, 6)
        proposer = NgramProposer(k, min_n, max_n)
        seq = make_request(num_prompt_tokens=1).sequences[0]
        seq.token_ids = [rng.randrange(4) for _ in range(rng.randint(1, 30))]
        for _ in range(60):
            limit = rng.randint(0, 8)
            assert proposer.propose(seq, limit) == scan_propose(seq.token_ids, min_n, max_n, min(k, limit))
            seq.token_ids += [rng.randrange(4) for _ in range(rng.randint(1, 3))]  # one to three kept a step


def test_proposer_prefers_the_longest_match_and_the_latest_occurrence():
    seq = make_request([1, 2, 3, 9, 2, 3, 8, 7, 1, 2, 3]).sequences[0]
    # The 3-gram [1, 2, 3] occurred at the start, followed by 9; the 2-gram [2, 3] last occurred before 8.
    assert NgramProposer(2, 1, 3).propose(seq, 10) == [9, 2]
    assert NgramProposer(2, 1, 2).propose(seq, 10) == [8, 7]
    assert NgramProposer(2, 1, 2).propose(seq, 1) == [8]
    assert NgramProposer(2, 4, 4).propose(seq, 10) == []  # no earlier [9, 2, 3]... [7, 1, 2, 3]


def model_tokens(model, seq, draft: list[int]) -> list[int]:
    """The greedy token after the sequence's tokens and each prefix of the draft, as the runner returns them."""
    context = list(seq.token_ids)
    tokens = [model(context)]
    for token in draft:
        context.append(token)
        tokens.append(model(context))
    return tokens


def run(scheduler, requests, model, check_step=None, max_steps=5000):
    """Drive the scheduler with `model` (tokens -> next token) until every request finishes."""
    for request in requests:
        scheduler.add_request(request)
    finished = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished:
            return finished
        out = scheduler.schedule()
        if check_step is not None:
            check_step(out)
        sampled = {}
        for seq, num_new in out.scheduled:
            if seq.num_computed_tokens + num_new == seq.num_tokens + len(seq.spec_token_ids):
                sampled[seq.seq_id] = model_tokens(model, seq, seq.spec_token_ids)
        finished += scheduler.update(out, sampled)
        check_prefix_cache(scheduler)
    raise AssertionError(f"not finished within {max_steps} steps")


def check_prefix_cache(scheduler):
    """Every block a running sequence registered in the prefix cache holds that sequence's tokens: none of a
    refused proposal's tokens (their keys and values sit in slots past num_computed_tokens) is ever hashed."""
    bm = scheduler.block_manager
    for seq in scheduler.running:
        assert seq.num_computed_tokens < seq.num_tokens
        for j in range(seq.num_hashed_blocks):
            block = bm.blocks[seq.block_table[j]]
            assert block.token_ids == tuple(seq.token_ids[j * bm.block_size : (j + 1) * bm.block_size])


def looping_model(period: int, noise: int):
    """Next token: a cycle through `period` ids, broken now and then (a hash of the context) so that some
    proposals are wrong."""

    def model(tokens: list[int]) -> int:
        if noise and hash(tuple(tokens[-3:])) % noise == 0:
            return 50 + len(tokens) % 7
        return 10 + (tokens[-1] - 9) % period

    return model


def make_requests(seed: int) -> list:
    rng = random.Random(seed)
    requests = []
    for i in range(12):
        prompt = [rng.randrange(3, 40) for _ in range(rng.randint(1, 40))]
        kind = i % 6
        if kind == 0:
            params = dict(temperature=0, max_tokens=rng.randint(1, 60), ignore_eos=True)
        elif kind == 1:
            params = dict(temperature=0, max_tokens=60, stop_token_ids=[10 + rng.randrange(5)])
        elif kind == 2:
            params = dict(temperature=0, max_tokens=60, min_tokens=rng.randint(0, 5))  # stops at EOS
        elif kind == 3:
            params = dict(temperature=0, max_tokens=80, n=2)
        elif kind == 4:
            params = dict(temperature=0.8, max_tokens=30)  # sampled: never speculated
        else:
            params = dict(temperature=0, max_tokens=40, logprobs=2)  # needs every row's logprobs: never speculated
        requests.append(make_request(prompt, request_id=f"r{i}", **params))
    return requests


def outputs(requests):
    return {(r.request_id, s.index): (s.output_token_ids, s.finish_reason, s.stop_reason)
            for r in requests for s in r.sequences}  # fmt: skip


def eos_sometimes(model):
    def with_eos(tokens):
        return EOS if len(tokens) % 23 == 0 else model(tokens)

    return with_eos


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "limits",
    [
        dict(num_blocks=16, block_size=256, max_model_len=2048),
        dict(num_blocks=12, block_size=8, max_model_len=64),  # blocks run short: preemption; the length cap
        dict(num_blocks=40, block_size=4, max_model_len=100, max_num_batched_tokens=24, max_num_seqs=8),
    ],
)
def test_speculation_keeps_every_output_of_plain_decoding(seed, limits):
    model = eos_sometimes(looping_model(period=3 + seed % 4, noise=[0, 5, 11][seed % 3]))
    plain_requests, spec_requests = make_requests(seed), make_requests(seed)
    plain = make_scheduler(**limits)
    run(plain, plain_requests, model)
    spec = make_scheduler(**limits, proposer=NgramProposer(1 + seed % 5, 1, 3))

    def check_step(out: SchedulerOutput):
        assert out.num_scheduled_tokens <= spec.max_num_batched_tokens
        for seq, num_new in out.scheduled:
            if seq.spec_token_ids:
                assert seq.params.is_plain_greedy
                assert num_new == 1 + len(seq.spec_token_ids)
                assert seq.num_tokens + len(seq.spec_token_ids) < spec.max_model_len
                assert seq.num_output_tokens + len(seq.spec_token_ids) < seq.params.max_tokens

    run(spec, spec_requests, model, check_step)
    assert outputs(spec_requests) == outputs(plain_requests)
    assert spec.num_draft_tokens > spec.num_accepted_tokens > 0  # some proposals kept, some refused
    bm = spec.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # every block back, none lost to refused proposals


def test_a_stop_token_inside_a_kept_proposal_ends_the_sequence_there():
    # The model cycles 10, 11, 12, 13. The prefill samples 12; then [10, 11, 12] matches the prompt's start
    # and the proposal [13, 10, 11, 12] is all right, but 11 is a stop token.
    model = looping_model(period=4, noise=0)
    request = make_request([10, 11, 12, 13, 10, 11], temperature=0, max_tokens=50, stop_token_ids=[11])
    scheduler = make_scheduler(proposer=NgramProposer(4, 1, 3))
    steps = []
    run(scheduler, [request], model, check_step=lambda out: steps.append(out.num_scheduled_tokens))
    seq = request.sequences[0]
    assert seq.output_token_ids == [12, 13, 10, 11]
    assert (seq.finish_reason, seq.stop_reason) == ("stop", 11)
    assert steps[1] > 1  # the second step verified a proposal
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


def test_a_stop_string_inside_a_kept_proposal_drops_the_tokens_after_it():
    # As above, the second step keeps the proposal [13, 10, 11, 12] and appends the model's 13. The text after the
    # step holds a stop string completed by the 10 (LLM.step looks): the output ends there, and only the proposed
    # tokens still in it (13, 10) count as accepted.
    model = looping_model(period=4, noise=0)
    request = make_request([10, 11, 12, 13, 10, 11], temperature=0, max_tokens=50, stop=["END"])
    scheduler = make_scheduler(proposer=NgramProposer(4, 1, 3))
    scheduler.add_request(request)
    for _ in range(2):
        out = scheduler.schedule()
        scheduler.update(out, {s.seq_id: model_tokens(model, s, s.spec_token_ids) for s, _ in out.scheduled})
    seq = request.sequences[0]
    assert seq.output_token_ids == [12, 13, 10, 11, 12, 13]
    assert (scheduler.num_draft_tokens, scheduler.num_accepted_tokens) == (4, 4)
    assert scheduler.finish_on_stop_string(seq, 3, "END") is request
    assert (seq.output_token_ids, seq.finish_reason, seq.stop_reason) == ([12, 13, 10], "stop", "END")
    assert seq.num_computed_tokens <= seq.num_tokens
    assert scheduler.num_accepted_tokens == 2
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


def test_proposals_take_only_the_budget_left_after_running_sequences_and_admissions():
    """4 requests, 6 tokens a step: with proposals of up to 8 tokens, the running sequences could take the
    whole budget every step and keep the rest waiting forever; they get only what is left."""
    model = looping_model(period=2, noise=0)

    def admissions(proposer):
        requests = [make_request([10, 11, 10, 11, 10], request_id=f"r{i}", temperature=0, max_tokens=30)
                    for i in range(4)]  # fmt: skip
        scheduler = make_scheduler(max_num_batched_tokens=6, max_num_seqs=4, proposer=proposer)
        admitted, sizes = [], []

        def check_step(out):
            assert out.num_scheduled_tokens <= 6
            admitted.append(len(scheduler.running))
            running = scheduler.running
            if len(running) == 4 and all(s.num_tokens - s.num_computed_tokens == 1 for s in running):
                assert len(out.scheduled) == 4  # every sequence every step, proposals in the 2 spare tokens
                sizes.append(out.num_scheduled_tokens)

        run(scheduler, requests, model, check_step)
        assert all(r.sequences[0].output_token_ids == [11, 10] * 15 for r in requests)
        return admitted, sizes, scheduler

    plain_admitted, _, _ = admissions(None)
    spec_admitted, sizes, scheduler = admissions(NgramProposer(8, 1, 3))
    first_full = plain_admitted.index(4)
    assert spec_admitted[: first_full + 1] == plain_admitted[: first_full + 1]
    assert max(sizes) == 6 and scheduler.num_accepted_tokens > 0


def test_sampled_rows_bound_covers_every_speculated_step():
    """CUDA graph buckets and the warm-up's logits are sized by max_num_sampled_rows: a step of max_num_seqs
    speculated sequences samples 1 + k rows each, within the step's token budget."""
    from types import SimpleNamespace

    from nanoinfer.engine.model_runner import max_num_sampled_rows

    config = SimpleNamespace(max_num_batched_tokens=16384, max_num_seqs=64, num_speculative_tokens=3)
    assert max_num_sampled_rows(config) == 256
    config.num_speculative_tokens = 0
    assert max_num_sampled_rows(config) == 64
    config.max_num_batched_tokens, config.num_speculative_tokens = 100, 16
    assert max_num_sampled_rows(config) == 100
