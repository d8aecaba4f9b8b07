"""LoRA in the engine's bookkeeping, without a model: the scheduler's max_loras rule (vLLM's: a waiting sequence whose
adapter would make more than max_loras adapters among the running sequences waits, the rest of the queue goes on, and
its turn comes when an adapter's sequences have all finished) and the prefix cache keyed by adapter (the same tokens
under two adapters hold other keys and values, so their blocks never match).

The adapters' folders are never read here: LoRARequests with dummy paths.
"""

from __future__ import annotations

import pytest
from factories import make_request, make_scheduler, make_seq, run_step, run_to_completion

from nanoinfer import LoRARequest
from nanoinfer.engine import block_manager as block_manager_module
from nanoinfer.engine.block_manager import BlockManager, root_hash
from nanoinfer.engine.sequence import SequenceStatus

A, B, C, D = (LoRARequest(name, i, f"/adapters/{name}") for i, name in enumerate("ABCD", start=1))


def lora_request(lora: LoRARequest | None, **kwargs):
    """A request (make_request's keywords) that runs with `lora` (None: the base model)."""
    request = make_request(**kwargs)
    request.lora_request = lora
    return request


def lora_scheduler(max_loras: int, **kwargs):
    scheduler = make_scheduler(**kwargs)
    scheduler.max_loras = max_loras
    return scheduler


def scheduled(out) -> list:
    return [seq for seq, _ in out.scheduled]


def running_loras(scheduler) -> set[int]:
    return {seq.request.lora_int_id for seq in scheduler.running} - {0}


# ---- the max_loras rule -----------------------------------------------------------------------------------------


def test_a_third_adapter_waits_while_two_run_and_the_queue_goes_on_past_it():
    sched = lora_scheduler(max_loras=2)
    a1 = lora_request(A, max_tokens=2)
    b = lora_request(B, max_tokens=10)
    c = lora_request(C, max_tokens=2)
    a2 = lora_request(A, max_tokens=4)
    base = lora_request(None, max_tokens=10)
    for r in (a1, b, c, a2, base):
        sched.add_request(r)
    (sa1,), (sb,), (sc,), (sa2,), (sbase,) = (r.sequences for r in (a1, b, c, a2, base))

    out, _ = run_step(sched)
    # A and B fill the two adapters; C waits; the second A request and the base model's are not held up behind it
    assert scheduled(out) == [sa1, sb, sa2, sbase]
    assert list(sched.waiting) == [sc] and sc.status == SequenceStatus.WAITING
    assert running_loras(sched) == {A.lora_int_id, B.lora_int_id}

    _, finished = run_step(sched)  # a1's second token: it finishes, but A still runs (a2)
    assert finished == [a1]
    out, finished = run_step(sched)
    assert sc not in scheduled(out)  # A's other sequence still runs: C's turn has not come
    assert finished == []
    out, finished = run_step(sched)  # a2's fourth token: A's last sequence finishes in this step's update
    assert sc not in scheduled(out) and finished == [a2]
    out, _ = run_step(sched)
    assert scheduled(out) == [sb, sbase, sc]  # admitted once all of A's sequences finished, behind the running ones
    assert running_loras(sched) == {B.lora_int_id, C.lora_int_id}
    assert sched.block_manager.num_free_blocks > 0  # (blocks were never what held C back)


def test_each_of_n_sequences_counts_under_its_requests_adapter():
    sched = lora_scheduler(max_loras=1)
    a = lora_request(A, n=2, max_tokens=3, temperature=1.0)
    c = lora_request(C, max_tokens=1)
    sched.add_request(a)
    sched.add_request(c)
    out, _ = run_step(sched)
    assert scheduled(out) == a.sequences and list(sched.waiting) == c.sequences
    finished = []
    while not finished:
        out, finished = run_step(sched)
        assert c.sequences[0] not in scheduled(out)
    assert finished == [a]
    out, _ = run_step(sched)
    assert scheduled(out) == c.sequences


def test_set_aside_sequences_keep_their_order_ahead_of_later_ones():
    sched = lora_scheduler(max_loras=2)
    a = lora_request(A, max_tokens=2)
    b = lora_request(B, max_tokens=8)
    c1, d, c2 = lora_request(C, max_tokens=4), lora_request(D, max_tokens=4), lora_request(C, max_tokens=4)
    for r in (a, b, c1, d, c2):
        sched.add_request(r)
    (sc1,), (sd,), (sc2,) = c1.sequences, d.sequences, c2.sequences
    run_step(sched)
    assert list(sched.waiting) == [sc1, sd, sc2]  # set aside, in the order they came

    c3 = lora_request(C, max_tokens=4)  # a later C request queues behind the set-aside ones
    sched.add_request(c3)
    _, finished = run_step(sched)
    assert finished == [a] and list(sched.waiting) == [sc1, sd, sc2, *c3.sequences]
    out, _ = run_step(sched)
    # A's slot goes to C (the first set aside), all of C's requests in their order; D still waits, ahead of nothing
    assert scheduled(out)[1:] == [sc1, sc2, *c3.sequences]
    assert list(sched.waiting) == [sd]


def test_the_rule_holds_when_the_sequence_slots_end_the_step_first():
    # max_num_seqs stops admission with a set-aside sequence in hand: it goes back ahead of the rest of the queue
    sched = lora_scheduler(max_loras=1, max_num_seqs=2)
    a1, c, a2, a3 = (lora_request(lora, max_tokens=2) for lora in (A, C, A, A))
    for r in (a1, c, a2, a3):
        sched.add_request(r)
    out, _ = run_step(sched)
    assert scheduled(out) == [*a1.sequences, *a2.sequences]
    assert list(sched.waiting) == [*c.sequences, *a3.sequences]


def test_a_preempted_sequence_readmits_under_the_rule():
    # 3 blocks of 4 tokens: a base sequence x and A's sequence take one block each, C waits for the adapter slot
    sched = lora_scheduler(max_loras=1, num_blocks=3, block_size=4)
    x = lora_request(None, num_prompt_tokens=4, max_tokens=3)
    a = lora_request(A, num_prompt_tokens=4, max_tokens=4)
    c = lora_request(C, num_prompt_tokens=4, max_tokens=1)
    for r in (x, a, c):
        sched.add_request(r)
    (sx,), (sa,), (sc,) = x.sequences, a.sequences, c.sequences
    out, _ = run_step(sched)
    assert scheduled(out) == [sx, sa] and list(sched.waiting) == [sc]

    out, _ = run_step(sched)  # x takes the last block; a, admitted last, is preempted
    assert out.num_preempted == 1 and scheduled(out) == [sx]
    assert list(sched.waiting) == [sa, sc] and running_loras(sched) == set()

    # From here no A sequence runs, so C could take the adapter slot: it must not pass the preempted A sequence,
    # which readmits first, under the rule, and C waits for it again.
    admitted_a = False
    while not admitted_a:
        out, _ = run_step(sched)
        assert sc not in scheduled(out)
        admitted_a = sa in scheduled(out)
    assert sa.num_preemptions == 1 and list(sched.waiting) == [sc]
    while sa.status != SequenceStatus.FINISHED:
        out, _ = run_step(sched)
        assert sc not in scheduled(out) or sa.status == SequenceStatus.FINISHED
    assert sa.output_token_ids == [7, 7, 7, 7]
    assert run_to_completion(sched) == [c] and sc.finish_reason == "length"


def test_base_model_requests_never_wait_for_an_adapter_slot():
    sched = lora_scheduler(max_loras=1)
    reqs = [lora_request(lora, max_tokens=2) for lora in (A, B, None, None)]
    for r in reqs:
        sched.add_request(r)
    out, _ = run_step(sched)
    assert scheduled(out) == [reqs[0].sequences[0], reqs[2].sequences[0], reqs[3].sequences[0]]


# ---- the prefix cache keyed by adapter --------------------------------------------------------------------------

BLOCK_SIZE = 4


def adapted_seq(token_ids: list[int], lora: LoRARequest | None):
    seq = make_seq(token_ids)
    seq.request.lora_request = lora
    return seq


def compute_and_free(bm: BlockManager, seq) -> list[int]:
    """Run a sequence's whole prompt (no hits) and free it: its blocks stay cached, whole and partly filled ones."""
    assert bm.allocate_slots(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    block_ids = list(seq.block_table)
    bm.free(seq)
    return block_ids


def test_cache_roots_are_the_adapters_own():
    assert root_hash(0) is None
    assert len({root_hash(1), root_hash(2), root_hash(2**62 - 1)}) == 3 and None not in {root_hash(1), root_hash(2)}
    assert adapted_seq([1, 2], A).request.cache_root == root_hash(A.lora_int_id)
    assert adapted_seq([1, 2], None).request.cache_root is None


def test_whole_blocks_cached_under_an_adapter_are_found_under_that_adapter_only():
    bm = BlockManager(num_blocks=10, block_size=BLOCK_SIZE)
    tokens = list(range(10, 20))  # two full blocks and two tokens
    assert compute_and_free(bm, adapted_seq(tokens, A))[:2] == [0, 1]
    assert bm.get_computed_blocks(tokens, root_hash(A.lora_int_id)) == [0, 1]
    assert bm.get_computed_blocks(tokens, root_hash(B.lora_int_id)) == []
    assert bm.get_computed_blocks(tokens) == []  # the base model's root

    # and the other way round: the base model's blocks serve no adapter
    bm = BlockManager(num_blocks=10, block_size=BLOCK_SIZE)
    compute_and_free(bm, adapted_seq(tokens, None))
    assert bm.get_computed_blocks(tokens) == [0, 1]
    assert bm.get_computed_blocks(tokens, root_hash(A.lora_int_id)) == []


@pytest.fixture
def short_partial_keys(monkeypatch):
    # a share from 2 matching tokens, so 4-token blocks have partial keys (as tests/property does)
    monkeypatch.setattr(block_manager_module, "MIN_SHARED_TOKENS", 2)


def test_a_partly_filled_first_block_is_shared_under_its_adapter_only(short_partial_keys):
    bm = BlockManager(num_blocks=10, block_size=BLOCK_SIZE)
    (block_id,) = compute_and_free(bm, adapted_seq([5, 6, 7], A))
    wanted = [5, 6, 7, 8, 9]
    share = bm.find_partial_share(wanted, [], len(wanted) - 1, root_hash(A.lora_int_id))
    assert share is not None and (share.block_id, share.num_tokens) == (block_id, 3)
    assert bm.find_partial_share(wanted, [], len(wanted) - 1, root_hash(B.lora_int_id)) is None
    assert bm.find_partial_share(wanted, [], len(wanted) - 1) is None


def test_a_partly_filled_block_after_whole_ones_is_shared_under_its_adapter_only(short_partial_keys):
    bm = BlockManager(num_blocks=10, block_size=BLOCK_SIZE)
    compute_and_free(bm, adapted_seq([1, 2, 3, 4, 5, 6, 7], A))  # block 0 whole, block 1 holds 5, 6, 7
    wanted = [1, 2, 3, 4, 5, 6, 9, 9]
    root = root_hash(A.lora_int_id)
    computed = bm.get_computed_blocks(wanted, root)
    assert computed == [0]
    share = bm.find_partial_share(wanted, computed, len(wanted) - 1, root)
    assert share is not None and (share.block_id, share.num_tokens) == (1, 2)
    for other in (root_hash(B.lora_int_id), None):
        assert bm.get_computed_blocks(wanted, other) == []
        assert bm.find_partial_share(wanted, [], len(wanted) - 1, other) is None


def test_the_scheduler_serves_a_prompt_from_the_cache_under_its_own_adapter_only():
    sched = lora_scheduler(max_loras=2, block_size=BLOCK_SIZE, num_blocks=32)
    prompt = list(range(100, 113))  # three full blocks and one token
    counts = []
    for lora in (A, B, None, A, B, None):
        req = lora_request(lora, prompt_token_ids=prompt, max_tokens=1)
        sched.add_request(req)
        run_to_completion(sched)
        counts.append(req.sequences[0].num_cached_tokens)
    assert counts == [0, 0, 0, 12, 12, 12]
