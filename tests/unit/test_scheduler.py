"""Scheduler without a model: the test plays the model, choosing each "sampled" token.

Blocks of 256 tokens as in real configs, so prompt lengths here are in the hundreds.
"""

from factories import EOS, make_request, make_scheduler, run_step, run_to_completion

from nanoinfer.engine.sequence import SequenceStatus

BS = 256


def fake_model(seq) -> int:
    """A deterministic "model": the next token depends only on the position, so a recompute after
    preemption reproduces the same tokens (as greedy decoding would)."""
    return 1000 + seq.num_tokens


# ---- the three limits ------------------------------------------------------------------------------------


def test_token_budget_chunks_the_prefill_of_several_sequences_in_one_step():
    sched = make_scheduler(max_num_batched_tokens=1000)
    a, b, c = (make_request(num_prompt_tokens=n) for n in (300, 300, 600))
    for r in (a, b, c):
        sched.add_request(r)
    (sa,), (sb,), (sc,) = a.sequences, b.sequences, c.sequences

    out, _ = run_step(sched)
    # a and b fit whole; c gets what is left of the budget (a chunk), nothing is sampled for it.
    assert [(s, n) for s, n in out.scheduled] == [(sa, 300), (sb, 300), (sc, 400)]
    assert out.num_scheduled_tokens == 1000
    assert (sa.num_tokens, sb.num_tokens, sc.num_tokens) == (301, 301, 600)
    assert sc.num_computed_tokens == 400

    out, _ = run_step(sched)
    # Running sequences first, oldest first: a and b decode one token each, c finishes its prompt.
    assert [(s, n) for s, n in out.scheduled] == [(sa, 1), (sb, 1), (sc, 200)]
    assert sc.num_tokens == 601


def test_token_budget_smaller_than_a_prompt_splits_it_over_steps():
    sched = make_scheduler(max_num_batched_tokens=256)
    req = make_request(num_prompt_tokens=700, max_tokens=1)
    sched.add_request(req)
    chunks = []
    while sched.has_unfinished:
        out, _ = run_step(sched)
        chunks.append(out.num_scheduled_tokens)
    assert chunks == [256, 256, 188]
    assert req.sequences[0].output_token_ids == [7]


def test_max_num_seqs_caps_the_running_batch():
    sched = make_scheduler(max_num_seqs=2)
    reqs = [make_request(num_prompt_tokens=10, max_tokens=2) for _ in range(5)]
    for r in reqs:
        sched.add_request(r)

    out, _ = run_step(sched)
    assert [s for s, _ in out.scheduled] == [reqs[0].sequences[0], reqs[1].sequences[0]]
    assert len(sched.waiting) == 3
    _, finished = run_step(sched)  # second token each: both reach max_tokens
    assert finished == reqs[:2]
    out, _ = run_step(sched)
    assert [s for s, _ in out.scheduled] == [reqs[2].sequences[0], reqs[3].sequences[0]]


def test_max_num_seqs_counts_each_of_n_sequences():
    sched = make_scheduler(max_num_seqs=3)
    req = make_request(num_prompt_tokens=10, n=4, max_tokens=1)
    sched.add_request(req)
    out, _ = run_step(sched)
    assert [s for s, _ in out.scheduled] == req.sequences[:3]
    _, finished = run_step(sched)
    assert finished == [req]


def test_max_model_len_ends_generation_at_exactly_that_length():
    sched = make_scheduler(max_model_len=310)
    req = make_request(num_prompt_tokens=300, max_tokens=None)
    sched.add_request(req)
    assert run_to_completion(sched) == [req]
    seq = req.sequences[0]
    assert seq.num_tokens == 310 and seq.num_output_tokens == 10
    assert seq.finish_reason == "length"


# ---- preemption --------------------------------------------------------------------------------------------


def three_full_block_prompts_in_a_four_block_cache():
    """a, b, c: prompts of exactly one block each, prefilled in step 1 (3 of 4 blocks). In step 2 each
    needs a second block for its first output token, and only one is free."""
    sched = make_scheduler(num_blocks=4, max_num_seqs=3, max_num_batched_tokens=1024)
    reqs = [
        make_request(list(range(i * 1000, i * 1000 + BS)), max_tokens=3, ignore_eos=True) for i in range(3)
    ]
    d = make_request(num_prompt_tokens=10, max_tokens=1)
    for r in reqs + [d]:
        sched.add_request(r)
    return sched, [r.sequences[0] for r in reqs], d.sequences[0]


def test_preemption_takes_the_most_recently_admitted_and_puts_it_at_the_front_of_the_queue():
    sched, (a, b, c), d = three_full_block_prompts_in_a_four_block_cache()
    out, _ = run_step(sched, fake_model)
    assert [s for s, _ in out.scheduled] == [a, b, c]  # d waits: max_num_seqs
    assert (a.block_table, b.block_table, c.block_table) == ([0], [1], [2])

    out, _ = run_step(sched, fake_model)
    # a takes the last free block (3). b finds none: c, admitted last, is preempted and its block goes to b.
    assert out.num_preempted == 1
    assert [(s, n) for s, n in out.scheduled] == [(a, 1), (b, 1)]
    assert (a.block_table, b.block_table) == ([0, 3], [1, 2])
    assert list(sched.waiting) == [c, d]  # ahead of d, which was waiting already
    assert c.status == SequenceStatus.WAITING and c.block_table == [] and c.num_computed_tokens == 0
    assert c.num_tokens == BS + 1  # its sampled token is kept and recomputed
    assert sched.num_preemptions == 1 and c.num_preemptions == 1


def test_no_admission_in_a_step_that_preempted():
    sched, (_, _, c), d = three_full_block_prompts_in_a_four_block_cache()
    run_step(sched, fake_model)
    out, _ = run_step(sched, fake_model)
    assert out.num_preempted == 1
    assert c not in [s for s, _ in out.scheduled] and d not in [s for s, _ in out.scheduled]


def test_preempted_sequence_resumes_and_completes_with_the_same_tokens():
    sched, (a, b, c), d = three_full_block_prompts_in_a_four_block_cache()
    finished = run_to_completion(sched, fake_model)
    assert {r.request_id for r in finished} == {s.request.request_id for s in (a, b, c, d)}
    assert c.num_preemptions >= 1
    for seq in (a, b, c):
        # Position-determined tokens: the same output whether or not the sequence was recomputed.
        assert seq.output_token_ids == [1000 + BS, 1001 + BS, 1002 + BS]
        assert seq.finish_reason == "length"
    assert sched.block_manager.num_free_blocks == 4


def test_resumed_sequence_recomputes_prompt_and_output_tokens():
    sched, (_, _, c), _ = three_full_block_prompts_in_a_four_block_cache()
    run_step(sched, fake_model)
    run_step(sched, fake_model)  # c preempted with 257 tokens
    out = None
    while c not in [s for s, _ in (out.scheduled if out else [])]:
        out, _ = run_step(sched, fake_model)
    # Its first block (the full prompt) was handed to b, so nothing is cached: all 257 tokens again.
    assert {s.seq_id: n for s, n in out.scheduled}[c.seq_id] == BS + 1
    assert c.num_cached_tokens == 0


# ---- stop conditions ------------------------------------------------------------------------------------


def generate(choose, **sampling):
    sched = make_scheduler()
    req = make_request(num_prompt_tokens=20, **sampling)
    sched.add_request(req)
    assert run_to_completion(sched, choose) == [req]
    return req.sequences[0]


def test_eos_stops():
    seq = generate(lambda s: EOS if s.num_output_tokens == 2 else 5)
    assert seq.output_token_ids == [5, 5, EOS]
    assert (seq.finish_reason, seq.stop_reason) == ("stop", None)


def test_stop_token_id_stops_and_is_named_as_the_reason():
    seq = generate(lambda s: 9 if s.num_output_tokens == 1 else 5, stop_token_ids=[9])
    assert seq.output_token_ids == [5, 9]
    assert (seq.finish_reason, seq.stop_reason) == ("stop", 9)


def test_max_tokens_ends_with_length():
    seq = generate(5, max_tokens=3)
    assert seq.output_token_ids == [5, 5, 5]
    assert seq.finish_reason == "length"


def test_min_tokens_suppresses_eos_and_stop_ids_until_reached():
    seq = generate(EOS, min_tokens=3, max_tokens=10)
    assert seq.output_token_ids == [EOS, EOS, EOS]
    assert seq.finish_reason == "stop"
    seq = generate(9, min_tokens=2, stop_token_ids=[9], max_tokens=10)
    assert seq.output_token_ids == [9, 9]
    assert seq.stop_reason == 9


def test_ignore_eos_generates_through_eos():
    seq = generate(EOS, ignore_eos=True, max_tokens=5)
    assert seq.output_token_ids == [EOS] * 5
    assert seq.finish_reason == "length"


def test_a_stop_string_found_after_the_step_retires_the_sequence_and_frees_its_blocks():
    # LLM.step finds stop strings in the text after update() and ends the sequence through the scheduler.
    sched = make_scheduler()
    req = make_request(num_prompt_tokens=20, max_tokens=10, stop=["END"])
    sched.add_request(req)
    run_step(sched, 5)
    run_step(sched, 6)
    seq = req.sequences[0]
    assert sched.finish_on_stop_string(seq, 2, "END") is req
    assert (seq.finish_reason, seq.stop_reason, seq.output_token_ids) == ("stop", "END", [5, 6])
    assert sched.running == [] and not sched.has_unfinished
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_a_request_ends_on_a_stop_string_only_with_its_last_sequence():
    sched = make_scheduler()
    req = make_request(num_prompt_tokens=20, n=2, max_tokens=10, stop=["END"])
    sched.add_request(req)
    run_step(sched, 5)
    first, second = req.sequences
    assert sched.finish_on_stop_string(first, 1, "END") is None  # the other sequence still runs
    assert sched.running == [second] and sched.has_unfinished
    assert run_step(sched, 6)[1] == []
    assert sched.finish_on_stop_string(second, 2, "END") is req
    assert [s.output_token_ids for s in req.sequences] == [[5], [5, 6]]
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_a_stop_string_before_the_length_limit_wins_over_it():
    # update() ended the sequence at max_tokens (and reported its request); the stop string came a token earlier.
    sched = make_scheduler()
    req = make_request(num_prompt_tokens=20, max_tokens=2, stop=["END"])
    sched.add_request(req)
    run_step(sched, 5)
    assert run_step(sched, 6)[1] == [req]
    seq = req.sequences[0]
    assert sched.finish_on_stop_string(seq, 1, "END") is None
    assert (seq.finish_reason, seq.stop_reason, seq.output_token_ids) == ("stop", "END", [5])


def test_n_sequences_finish_the_request_together():
    sched = make_scheduler()
    req = make_request(num_prompt_tokens=20, n=3, max_tokens=8)
    sched.add_request(req)
    # Sequence i emits EOS as its (i+1)-th token; the request finishes with its last sequence.
    finished = run_to_completion(sched, lambda s: EOS if s.num_output_tokens == s.index else 5)
    assert finished == [req]
    assert [s.num_output_tokens for s in req.sequences] == [1, 2, 3]
    assert sched.num_unfinished_requests == 0


# ---- unservable requests -----------------------------------------------------------------------------------


def test_a_request_that_fills_the_whole_cache_completes_and_frees_it():
    # Whole cache: 2 x 256 = 512 tokens; 511 prompt tokens + 1 computed output token fill it exactly (the last
    # sampled token is never stored).
    sched = make_scheduler(num_blocks=2, max_model_len=1000)
    ok = make_request(num_prompt_tokens=511, max_tokens=2)
    sched.add_request(ok)
    assert sched.num_unfinished_requests == 1 and list(sched.waiting) == ok.sequences
    assert run_to_completion(sched) == [ok]
    assert ok.sequences[0].finish_reason == "length" and ok.sequences[0].num_tokens == 513
    assert sched.block_manager.num_free_blocks == 2
