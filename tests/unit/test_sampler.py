"""Sampler: greedy, filtering, penalties, seeds and logprobs on hand-made logits (no model)."""

from __future__ import annotations

import math

import pytest
import torch

from nanoinfer.engine.sampler import Sampler
from nanoinfer.engine.sequence import Request
from nanoinfer.errors import RequestError
from nanoinfer.sampling_params import SamplingParams


def seqs_for(n: int, **params) -> list:
    return [Request(f"r{i}", [1, 2, 3], SamplingParams(**params)).sequences[0] for i in range(n)]


LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def test_temperature_zero_is_argmax():
    logits = torch.randn(8, 50)
    assert Sampler()(logits, seqs_for(8, temperature=0)) == logits.argmax(-1).tolist()


def test_greedy_rows_of_bfloat16_logits_are_their_argmax_with_or_without_logprobs():
    """Plain greedy rows take the argmax of the logits as they are; a batch with a logprobs row takes the
    full path (float32): the same tokens either way, the first of tied bfloat16 logits included."""
    logits = torch.randn(6, 300).bfloat16()
    logits[0, [5, 250]] = 9.0  # a tie: 5
    expected = logits.float().argmax(-1).tolist()
    assert expected[0] == 5
    assert Sampler()(logits, seqs_for(6, temperature=0)) == expected
    seqs = seqs_for(6, temperature=0)
    seqs[2] = seqs_for(1, temperature=0, logprobs=2)[0]
    assert Sampler()(logits, seqs) == expected
    assert seqs[2].logprobs[0].token_id == expected[2]


def test_top_k_one_equals_greedy():
    logits = torch.randn(8, 50)
    assert Sampler()(logits, seqs_for(8, temperature=1.3, top_k=1)) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_empirical_frequencies_match_softmax(temperature):
    # 40,000 draws: the standard error of each frequency is at most sqrt(0.25 / 40000) = 0.0025, so a
    # tolerance of 0.012 is about 5 standard errors.
    n = 40_000
    tokens = Sampler(seed=0)(LOGITS.repeat(n, 1), seqs_for(n, temperature=temperature))
    freq = torch.bincount(torch.tensor(tokens), minlength=len(LOGITS)).float() / n
    expected = torch.softmax(LOGITS / temperature, dim=-1)
    assert (freq - expected).abs().max().item() < 0.012


def test_top_k_top_p_min_p_never_sample_filtered_tokens():
    n = 4000
    sampler = Sampler(seed=1)
    assert set(sampler(LOGITS.repeat(n, 1), seqs_for(n, top_k=2))) == {0, 1}
    probs = torch.softmax(LOGITS, -1)  # [0.56, 0.21, 0.12, 0.08, 0.03, 0.004]
    # top_p=0.7: token 0 (0.56) is below 0.7, so token 1 is kept too; token 2 starts after 0.77 > 0.7.
    assert probs[0] < 0.7 < probs[0] + probs[1]
    assert set(sampler(LOGITS.repeat(n, 1), seqs_for(n, top_p=0.7))) == {0, 1}
    # min_p=0.3 keeps tokens with prob >= 0.3 * 0.56 = 0.17: tokens 0 and 1.
    assert set(sampler(LOGITS.repeat(n, 1), seqs_for(n, min_p=0.3))) == {0, 1}


def test_seeded_sequence_draws_the_same_whatever_the_batch():
    def draws(batch_size: int, position: int) -> list[int]:
        result = []
        seqs = seqs_for(batch_size, temperature=1.0)
        seqs[position] = Request("seeded", [1], SamplingParams(temperature=1.0, seed=1234)).sequences[0]
        sampler = Sampler(seed=batch_size)
        for _ in range(20):
            result.append(sampler(LOGITS.repeat(batch_size, 1), seqs)[position])
        return result

    alone = draws(1, 0)
    assert draws(7, 3) == alone
    assert draws(3, 2) == alone
    assert len(set(alone)) > 1  # it really samples


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(1, 10)
    seq = Request("r", [1, 4, 4, 7], SamplingParams(temperature=0, repetition_penalty=1.7)).sequences[0]
    from nanoinfer.engine.sampler import _apply_penalties

    ours = _apply_penalties(logits[0].clone(), seq)
    theirs = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([[1, 4, 4, 7]]), logits.clone())[0]
    torch.testing.assert_close(ours, theirs)


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    from nanoinfer.engine.sampler import _apply_penalties

    seq = Request("r", [5, 5], SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)).sequences[0]
    seq.token_ids += [2, 2, 3]  # generated: token 2 twice, token 3 once
    out = _apply_penalties(torch.zeros(8), seq)
    assert out[2].item() == pytest.approx(-0.5 - 0.5)
    assert out[3].item() == pytest.approx(-0.5 - 0.25)
    assert out[5].item() == 0.0  # prompt tokens are not penalised


def test_logprobs_of_sampled_token_and_top_alternatives():
    seqs = seqs_for(1, temperature=0, logprobs=3)
    token = Sampler()(LOGITS.unsqueeze(0), seqs)[0]
    lp = seqs[0].logprobs[0]
    expected = torch.log_softmax(LOGITS, -1)
    assert lp.token_id == token == 0
    assert lp.logprob == pytest.approx(expected[0].item())
    assert [t for t, _ in lp.top] == [0, 1, 2]
    assert math.isclose(lp.top[1][1], expected[1].item(), rel_tol=1e-6)


@pytest.mark.parametrize("bad", [
    dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2), dict(min_p=2), dict(n=0),
    dict(max_tokens=-1), dict(min_tokens=5, max_tokens=2), dict(logprobs=50), dict(stop=[""]), dict(prompt_logprobs=21),
    dict(max_tokens=True), dict(seed="x"), dict(presence_penalty=3),
])
def test_bad_sampling_values_are_request_errors(bad):
    with pytest.raises(RequestError) as e:
        SamplingParams(**bad)
    assert next(iter(bad)) in str(e.value)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_every_sampling_feature_runs_on_the_logits_device(device):
    """Filters, penalties, seeds and logprobs together on the logits' own device: on CUDA a CPU tensor or a
    CPU generator anywhere in the sampler fails (an H200 run found the temperatures tensor on the CPU)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    n = 64
    logits = LOGITS.repeat(n, 1).to(device)
    params = dict(temperature=0.8, top_k=3, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
                  presence_penalty=0.1, frequency_penalty=0.1, logprobs=2)  # fmt: skip

    def run(seed: int | None) -> tuple[list[int], list]:
        seeds = [None if seed is None else seed + i for i in range(n)]  # one seed per request
        seqs = [Request(f"r{i}", [1, 2, 3], SamplingParams(**params, seed=s)).sequences[0] for i, s in enumerate(seeds)]
        for seq in seqs:
            seq.token_ids.append(0)  # one generated token, so presence and frequency penalties apply
        return Sampler(seed=0)(logits, seqs), seqs

    tokens, seqs = run(seed=7)
    assert set(tokens) <= {0, 1, 2} and len(set(tokens)) > 1  # top_k=3 keeps tokens 0..2
    assert all(seq.generator.device == logits.device for seq in seqs)
    assert run(seed=7)[0] == tokens  # seeded: the same draws again
    unseeded, seqs = run(seed=None)
    assert set(unseeded) <= {0, 1, 2} and all(seq.generator is None for seq in seqs)
    assert all(len(seq.logprobs) == 1 and len(seq.logprobs[0].top) == 2 for seq in seqs)
