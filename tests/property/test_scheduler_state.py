"""The scheduler under random request mixes, driven step by step with fake sampled tokens.

Every step: the three limits hold, num_computed_tokens <= num_tokens, blocks are free xor owned with exact
ref counts, and something runs while a servable request is unfinished. Every servable request finishes
within a computed bound of steps; unservable ones finish with an error; then no block is in use.

Caches are kept small to force preemption. max_model_len never exceeds the cache's capacity: Config and
memory.check_fits refuse that setting before a Scheduler is built.
"""

from dataclasses import dataclass

from factories import EOS, make_request, make_scheduler
from hypothesis import event, given, settings, target
from hypothesis import strategies as st

from nanoinfer.engine.sequence import SequenceStatus

VOCAB = [EOS, 3, 4, 5, 6]  # few ids, so eos and stop ids are sampled often


@dataclass
class Case:
    block_size: int
    num_blocks: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    requests: list[dict]  # make_request keywords
    script: list[int]  # the fake model's outputs, indexed by position


@st.composite
def cases(draw) -> Case:
    block_size = draw(st.sampled_from([1, 2, 4, 16, 256]))
    num_blocks = draw(st.integers(2 if block_size == 1 else 1, 8))
    capacity = block_size * num_blocks
    max_model_len = draw(st.integers(2, min(capacity, 300)))
    requests = []
    for _ in range(draw(st.integers(1, 6))):
        length = draw(st.integers(1, max_model_len - 1))  # LLM.add_request refuses empty and too-long prompts
        # A short varied head then filler: equal heads give prefix-cache hits.
        head = [draw(st.sampled_from([7, 8])) for _ in range(min(length, 4))]
        max_tokens = draw(st.none() | st.integers(1, 12))
        requests.append(
            {
                "prompt_token_ids": head + [9] * (length - len(head)),
                "n": draw(st.integers(1, 3)),
                "max_tokens": max_tokens,
                "min_tokens": min(draw(st.integers(0, 2)), max_tokens or 2),
                "ignore_eos": draw(st.booleans()),
                "stop_token_ids": draw(st.lists(st.sampled_from(VOCAB[1:]), max_size=1)),
            }
        )
    return Case(
        block_size=block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 2 * max_model_len)),
        enable_prefix_caching=draw(st.booleans()),
        requests=requests,
        script=draw(st.lists(st.sampled_from(VOCAB), min_size=1, max_size=16)),
    )


def is_servable(case: Case, num_prompt_tokens: int) -> bool:
    return (
        0 < num_prompt_tokens < case.max_model_len
        and num_prompt_tokens + 1 <= case.num_blocks * case.block_size
    )


def max_length(case: Case, request) -> int:
    """The longest a sequence of `request` can grow: prompt + max_tokens, capped by max_model_len."""
    max_tokens = request.sampling_params.max_tokens
    limit = case.max_model_len if max_tokens is None else len(request.prompt_token_ids) + max_tokens
    return min(limit, case.max_model_len)


def check_step(case: Case, sched, out, seqs) -> None:
    scheduled = [seq for seq, _ in out.scheduled]
    assert out.num_scheduled_tokens <= case.max_num_batched_tokens
    assert len(scheduled) <= case.max_num_seqs and len(sched.running) <= case.max_num_seqs
    assert len(set(map(id, scheduled))) == len(scheduled)
    bm = sched.block_manager
    for seq, num_new in out.scheduled:
        assert num_new >= 1
        assert seq.status == SequenceStatus.RUNNING
        assert seq.num_computed_tokens + num_new <= seq.num_tokens
        assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens + num_new
    for seq in seqs:
        assert seq.num_computed_tokens <= seq.num_tokens
        if seq.finish_reason != "error":  # refused prompts may be longer than max_model_len
            assert seq.num_tokens <= case.max_model_len
        if seq.status != SequenceStatus.RUNNING:
            assert seq.block_table == []
    # Blocks: free xor held by running sequences, ref count = number of tables holding it.
    held = [block_id for seq in sched.running for block_id in seq.block_table]
    assert not set(held) & set(bm.free_block_ids)
    assert set(held) | set(bm.free_block_ids) == set(range(bm.num_blocks))
    for block in bm.blocks:
        assert block.ref_count == held.count(block.block_id)
    if sched.num_unfinished_requests:
        assert scheduled, "a servable request is unfinished but nothing was scheduled"


def drive(case: Case):
    """Run the case to the end, checking every step; returns the scheduler and the requests."""
    sched = make_scheduler(
        num_blocks=case.num_blocks,
        block_size=case.block_size,
        enable_prefix_caching=case.enable_prefix_caching,
        max_num_seqs=case.max_num_seqs,
        max_num_batched_tokens=case.max_num_batched_tokens,
        max_model_len=case.max_model_len,
    )
    requests = [make_request(**kw) for kw in case.requests]
    for request in requests:
        sched.add_request(request)
    seqs = [seq for request in requests for seq in request.sequences]
    # Each step the oldest running sequence computes >= 1 token and is never preempted (it alone fits the
    # cache), and a step with nothing running admits the queue head. So a sequence is the oldest for at most
    # as many steps as tokens it can reach; one more step returns the requests refused at admission.
    bound = 1 + sum(
        max_length(case, r) * r.sampling_params.n
        for r in requests
        if is_servable(case, len(r.prompt_token_ids))
    )

    def fake_model(seq):
        return case.script[seq.num_tokens % len(case.script)]

    finished = []
    num_steps = 0
    while sched.has_unfinished:
        num_steps += 1
        assert num_steps <= bound, f"not finished within {bound} steps"
        out = sched.schedule()
        check_step(case, sched, out, seqs)
        sampled = {
            seq.seq_id: [fake_model(seq)]
            for seq, n in out.scheduled
            if seq.num_computed_tokens + n == seq.num_tokens
        }
        finished += sched.update(out, sampled)

    assert sorted(r.request_id for r in finished) == sorted(r.request_id for r in requests)
    assert sched.running == [] and not sched.waiting
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(block.ref_count == 0 for block in bm.blocks)
    for request in requests:
        servable = is_servable(case, len(request.prompt_token_ids))
        for seq in request.sequences:
            assert seq.is_finished
            assert (seq.finish_reason == "error") == (not servable), seq
            if servable:
                params = seq.params
                assert seq.num_tokens <= max_length(case, request)
                if seq.finish_reason == "stop":
                    assert seq.num_output_tokens >= params.min_tokens
    return sched, requests


@settings(max_examples=200, deadline=None)
@given(cases())
def test_random_request_mixes_respect_the_limits_and_finish(case):
    sched, _ = drive(case)
    if sched.num_preemptions:
        event("preempted")
    if sched.block_manager.num_cache_hits:
        event("prefix-cache hit")
    target(float(sched.num_preemptions), label="preemptions")


def test_a_tight_cache_mix_preempts_and_still_finishes():
    # Not vacuous: this mix (6 sequences of 8-token prompts in a 6-block cache of 4-token blocks) preempts.
    case = Case(
        block_size=4,
        num_blocks=6,
        max_model_len=24,
        max_num_seqs=6,
        max_num_batched_tokens=64,
        enable_prefix_caching=True,
        script=[5],
        requests=[{"prompt_token_ids": [7 + i] * 8, "n": 2, "max_tokens": 10} for i in range(3)],
    )
    sched, requests = drive(case)
    assert sched.num_preemptions >= 3
    assert all(seq.num_output_tokens == 10 for r in requests for seq in r.sequences)
