"""Greedy tokens without the LM head's logits, on CPUs with AMX (elsewhere neither path is taken):
- float32, from its bfloat16 copy (csrc/greedy_lm_head.cpp): always the argmax of the float32 logits our panel
  GEMM computes, bit for bit, including near-ties bfloat16 cannot tell apart and exact ties (the first index wins);
- bfloat16, in the AMX GEMM's epilogue (csrc/amx_gemm.cpp, amx_greedy_argmax): the argmax of the bfloat16 logits
  amx_linear would have written, ties and all."""

from __future__ import annotations

import pytest
import torch

from nanoinfer.platforms.cpu.linear import linear, pack_greedy_lm_head, pack_weight
from nanoinfer.platforms.cpu.ops import cpu_ops

pytestmark = pytest.mark.skipif(cpu_ops() is None or not cpu_ops().amx_available(), reason="no AMX on this CPU")


def _picks(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(greedy_lm_head's tokens, the argmax of the full float32 logits through the same packed weight)."""
    panels = pack_weight(weight, "panels")
    head = pack_greedy_lm_head(weight)
    picked = cpu_ops().greedy_lm_head(hidden, head.amx_packed, head.weight_norms, panels.data, weight.shape[0])
    full = torch.argmax(linear(hidden, weight, None, panels), dim=-1)
    return picked, full


# Vocabularies a multiple of 16 and not (a partial panel), hidden sizes a multiple of 32 and not; rows within
# one 16-row block of the AMX GEMM, across blocks and across its 256-row runs.
@pytest.mark.parametrize("vocab, hidden_size", [(4096, 576), (1000, 64), (333, 100)])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_the_float32_argmax_on_random_logits(vocab, hidden_size, rows):
    gen = torch.Generator().manual_seed(vocab + rows)
    weight = torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.5
    hidden = torch.randn(rows, hidden_size, generator=gen) * 3
    picked, full = _picks(hidden, weight)
    assert picked.dtype == torch.long and torch.equal(picked, full)


def test_near_ties_bfloat16_cannot_see_and_exact_ties():
    """Rows of W that differ below bfloat16's resolution: the bfloat16 logits tie, the float32 ones do not; and
    duplicated rows, whose float32 logits tie exactly: torch.argmax's first index must win."""
    gen = torch.Generator().manual_seed(0)
    hidden_size, vocab = 256, 512
    base = torch.randn(hidden_size, generator=gen)
    weight = torch.randn(vocab, hidden_size, generator=gen) * 0.05
    for j in range(100, 164):  # 64 rows within ~1e-4 of one another, all far above the rest
        weight[j] = base * (1 + 1e-5 * (j - 130)) + 1e-6 * torch.randn(hidden_size, generator=gen)
    weight[300] = weight[140]  # an exact duplicate later in the vocabulary
    weight[90] = weight[131]  # and one earlier
    hidden = torch.stack([base, -base, base * 1e3, base * 1e-3, base + 0.01 * torch.randn(hidden_size, generator=gen)])
    picked, full = _picks(hidden, weight)
    assert torch.equal(picked, full)
    bfloat16_argmax = torch.argmax(hidden.bfloat16().float() @ weight.bfloat16().float().t(), dim=-1)
    assert not torch.equal(bfloat16_argmax, full)  # bfloat16's own argmax would have picked other tokens


def test_rows_that_are_not_finite_are_left_to_the_full_path():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(300, 64, generator=gen)
    hidden = torch.randn(4, 64, generator=gen)
    hidden[1, 3] = float("nan")
    hidden[2, 5] = float("inf")
    hidden[3] = 3e38  # finite in float32, infinite once rounded to bfloat16
    head, panels = pack_greedy_lm_head(weight), pack_weight(weight, "panels")
    picked = cpu_ops().greedy_lm_head(hidden, head.amx_packed, head.weight_norms, panels.data, 300)
    assert picked[0] >= 0 and picked[1:].tolist() == [-1, -1, -1]


def test_a_row_with_more_candidates_than_slots_is_left_to_the_full_path():
    """1,000 equal logits: more columns within the bound than a thread keeps (256) while it runs. On top, the row
    goes to the full path; at the bottom (each thread's first columns then later ones above them), it is exact."""
    from nanoinfer.models.layers.embedding import ParallelLMHead

    gen = torch.Generator().manual_seed(5)
    head = ParallelLMHead(1100, 64)
    top = torch.randn(64, generator=gen)
    weight = torch.randn(1100, 64, generator=gen) * 0.01
    weight[50:1050] = top
    head.weight.data = weight
    head.greedy_head = pack_greedy_lm_head(head.weight)
    head.packed_weight = pack_weight(head.weight, "panels")
    hidden = torch.stack([top, -top])  # the 1,000 on top, then at the bottom
    picked = cpu_ops().greedy_lm_head(hidden, head.greedy_head.amx_packed, head.greedy_head.weight_norms,
                                      head.packed_weight.data, 1100)
    full = torch.argmax(head(hidden), dim=-1)
    assert picked[0] == -1 and picked[1] == full[1]
    assert head.greedy_token_ids(hidden).tolist() == full.tolist() and full[0] == 50


def test_the_lm_head_module_falls_back_for_those_rows():
    from nanoinfer.models.layers.embedding import ParallelLMHead

    gen = torch.Generator().manual_seed(2)
    head = ParallelLMHead(300, 64)
    head.weight.data = torch.randn(300, 64, generator=gen)
    hidden = torch.randn(3, 64, generator=gen)
    expected = torch.argmax(hidden @ head.weight.data.t(), dim=-1)
    hidden[1] = float("nan")
    expected[1] = 0  # torch.argmax of a NaN row: its first NaN
    head.greedy_head = pack_greedy_lm_head(head.weight)
    head.packed_weight = pack_weight(head.weight, "panels")
    assert head.greedy_token_ids(hidden).tolist() == expected.tolist()


def _fast_and_full(llm, use_full_logits) -> tuple[list, list]:
    """Greedy outputs of a few prompts through the LM head's greedy path (checked to be taken), then again after
    use_full_logits() turns it off (the full logits and the sampler's argmax)."""
    from nanoinfer import SamplingParams

    lm_head = llm.engine.model_runner.model.lm_head
    prompts = [[(7 * i + 3 * j) % 5000 + 1 for j in range(20 + 9 * i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    calls = []
    pick = lm_head.greedy_token_ids
    lm_head.greedy_token_ids = lambda h: calls.append(len(h)) or pick(h)
    fast = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert calls  # the greedy rows went through it
    use_full_logits()
    return fast, [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_a_float32_model_takes_it_and_generates_what_the_full_logits_give(default_model_dir):
    from nanoinfer import LLM

    llm = LLM(str(default_model_dir), max_model_len=512, cpu_kvcache_space_gib=0.25, max_num_seqs=8)
    lm_head = llm.engine.model_runner.model.lm_head
    assert lm_head.greedy_head is not None
    fast, full = _fast_and_full(llm, lambda: setattr(lm_head, "greedy_head", None))
    assert fast == full


# ---- bfloat16: the argmax taken in the AMX GEMM's epilogue --------------------------------------------------


def _bfloat16_picks(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(amx_greedy_argmax's tokens, torch.argmax of the bfloat16 logits amx_linear writes with the same weight)."""
    packed = pack_weight(weight, "amx")
    picked = cpu_ops().amx_greedy_argmax(hidden, packed.data, weight.shape[0])
    full = torch.argmax(linear(hidden, weight, None, packed), dim=-1)
    return picked, full


# Vocabularies a multiple of a pair's 32 columns and not (a partial pair, one of under 16 columns); hidden sizes a
# multiple of 32 and not; rows within one 16-row block, across blocks and across 256-row runs.
@pytest.mark.parametrize("vocab, hidden_size", [(4096, 576), (1000, 64), (37, 96), (9, 32)])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_the_bfloat16_argmax_without_writing_the_logits(vocab, hidden_size, rows):
    gen = torch.Generator().manual_seed(vocab + rows)
    weight = (torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.5).bfloat16()
    hidden = (torch.randn(rows, hidden_size, generator=gen) * 3).bfloat16()
    picked, full = _bfloat16_picks(hidden, weight)
    assert picked.dtype == torch.long and torch.equal(picked, full)


def test_bfloat16_ties_go_to_the_first_index_across_pairs_and_threads():
    """Equal logits in one pair and in pairs far apart (which two threads may run in either order)."""
    gen = torch.Generator().manual_seed(3)
    vocab, hidden_size = 2048, 64
    weight = torch.randn(vocab, hidden_size, generator=gen) * 0.05
    top = torch.randn(hidden_size, generator=gen)
    for j in (5, 6, 1500, 2047):  # exact duplicates: one pair's neighbours, then far away
        weight[j] = top
    weight = weight.bfloat16()
    hidden = torch.stack([top, top * 2, -top, torch.zeros(hidden_size)]).bfloat16()
    picked, full = _bfloat16_picks(hidden, weight)
    assert torch.equal(picked, full)
    assert picked[3] == 0  # every logit 0: the first index


def test_bfloat16_rows_with_a_nan_are_left_to_the_full_path():
    from nanoinfer.models.layers.embedding import ParallelLMHead

    gen = torch.Generator().manual_seed(4)
    head = ParallelLMHead(300, 64).bfloat16()
    head.weight.data = torch.randn(300, 64, generator=gen).bfloat16()
    hidden = torch.randn(3, 64, generator=gen).bfloat16()
    expected = torch.argmax(hidden.float() @ head.weight.data.float().t(), dim=-1)
    head.packed_weight = pack_weight(head.weight, "amx")
    hidden[1, 7] = float("nan")
    assert cpu_ops().amx_greedy_argmax(hidden, head.packed_weight.data, 300).tolist()[1] == -1
    picked = head.greedy_token_ids(hidden).tolist()
    assert picked[1] == torch.argmax(head(hidden[1:2]), dim=-1).item()  # torch's answer for that row
    assert picked[0] == expected[0] and picked[2] == expected[2]


def test_a_bfloat16_model_takes_it_and_generates_what_the_full_logits_give(default_model_dir, monkeypatch):
    from nanoinfer import LLM
    from nanoinfer.models.layers.embedding import ParallelLMHead

    llm = LLM(str(default_model_dir), dtype="bfloat16", max_model_len=512, cpu_kvcache_space_gib=0.25, max_num_seqs=8,
              num_speculative_tokens=3)
    lm_head = llm.engine.model_runner.model.lm_head
    assert lm_head.has_greedy_kernel and lm_head.packed_weight.kind == "amx"
    no_kernel = property(lambda self: False)
    fast, full = _fast_and_full(llm, lambda: monkeypatch.setattr(ParallelLMHead, "has_greedy_kernel", no_kernel))
    assert fast == full
