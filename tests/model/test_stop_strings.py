"""Stop strings on the tiny model: generation ends where a search of the whole decoded output after every token ended
it (factories.stop_by_full_decode, how nanoinfer found them before), with and without n-gram speculation, and the
text is decoded once, a few tokens a step, instead of once a stop check."""

from __future__ import annotations

import pytest
from factories import stop_by_full_decode

from nanoinfer import LLM, SamplingParams

PROMPTS = ["The quick brown fox", "Paris is the capital of", "Once upon a time there was"]
MAX_TOKENS = 60


@pytest.fixture(scope="module")
def llms(tiny_model_dirs):
    path = str(tiny_model_dirs["qwen3"])
    plain = LLM(path, max_model_len=256, cpu_kvcache_space_gib=0.25)
    speculating = LLM(path, max_model_len=256, cpu_kvcache_space_gib=0.25, num_speculative_tokens=3)
    return plain, speculating


def greedy(**options) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **options)


def expected_output(tokenizer, free_token_ids: list[int], params: SamplingParams) -> tuple:
    hit = stop_by_full_decode(tokenizer, free_token_ids, params)
    if hit is None:
        return free_token_ids, tokenizer.decode(free_token_ids, skip_special_tokens=True), "length", None
    num_tokens, stop, text = hit
    return free_token_ids[:num_tokens], text, "stop", stop


def stop_cases(tokenizer, token_ids: list[int]) -> list[SamplingParams]:
    """Stop strings from the output itself: across each of a few token boundaries, several at once (one that starts
    earlier listed last), and an early one with min_tokens past it."""
    # The text's length after each token whose decode ends in a whole character (where it ends in the full text)
    boundaries = []
    for n in range(1, len(token_ids)):
        prefix = tokenizer.decode(token_ids[:n], skip_special_tokens=True)
        if not prefix.endswith("\ufffd"):
            boundaries.append(len(prefix))
    text = tokenizer.decode(token_ids, skip_special_tokens=True)

    def piece(start: int, end: int) -> str:
        return text[max(start, 0) : end].replace("\ufffd", "")

    cases = []
    for b in boundaries[2::3]:
        for before, after in ((1, 1), (2, 1), (1, 3)):
            if piece(b - before, b + after):
                cases.append(greedy(stop=[piece(b - before, b + after)]))
    late, middle, early = piece(len(text) - 4, len(text)), piece(len(text) // 2, len(text) // 2 + 2), piece(3, 5)
    cases.append(greedy(stop=[s for s in (late, middle, early, "never in this output") if s]))
    cases += [greedy(stop=[early], min_tokens=n) for n in (5, 20) if early]
    return cases


def outputs_of(out) -> tuple:
    completion = out.outputs[0]
    return completion.token_ids, completion.text, completion.finish_reason, completion.stop_reason


@pytest.mark.timeout(300)
def test_stop_strings_end_generation_as_a_full_decode_after_every_token_did(llms):
    """Across token boundaries, several stops, min_tokens; with speculation too, where a stop string may be completed
    by a proposed token that the model kept with more after it: those are dropped."""
    plain, speculating = llms
    tokenizer = plain.tokenizer
    free = plain.generate(PROMPTS, greedy())
    prompts, params, expected = [], [], []
    for prompt, out in zip(PROMPTS, free):
        for case in stop_cases(tokenizer, out.token_ids):
            prompts.append(prompt)
            params.append(case)
            expected.append(expected_output(tokenizer, out.token_ids, case))
    assert sum(e[2] == "stop" for e in expected) > 20

    dropped = []
    finish = speculating.engine.finish_on_stop_string

    def recording(seq, num_output_tokens, stop, stats):
        dropped.append(seq.num_output_tokens - num_output_tokens)
        return finish(seq, num_output_tokens, stop, stats)

    speculating.engine.finish_on_stop_string = recording
    try:
        for llm in (plain, speculating):
            got = [outputs_of(out) for out in llm.generate(prompts, params)]
            for g, e, p in zip(got, expected, params):
                assert g == e, (p.stop, p.min_tokens)
    finally:
        del speculating.engine.finish_on_stop_string
    assert max(dropped) > 0  # some stop string ended the output inside a kept proposal


class CountingDecode:
    def __init__(self, decode):
        self.decode = decode
        self.calls: list[int] = []  # how many ids each decode was given

    def __call__(self, token_ids, skip_special_tokens=False):
        self.calls.append(len(token_ids))
        return self.decode(token_ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.timeout(120)
def test_each_step_decodes_only_its_new_tokens(llms, monkeypatch):
    plain, _ = llms
    counting = CountingDecode(plain.tokenizer.decode)
    monkeypatch.setattr(plain.tokenizer, "decode", counting)
    with_stops = plain.add_request(PROMPTS[0], greedy(stop=["never in this output"]))
    without = plain.add_request(PROMPTS[1], greedy())
    calls_a_step = []
    outputs = {}
    while plain.has_unfinished_requests():
        before = len(counting.calls)
        finished, _ = plain.step()
        outputs.update((o.request_id, o) for o in finished)
        calls_a_step.append(counting.calls[before:])
    assert len(calls_a_step) == MAX_TOKENS
    # The last step decodes both outputs whole for their RequestOutputs (no stop string hit: its text is the decode).
    assert sorted(calls_a_step[-1])[-2:] == [MAX_TOKENS, MAX_TOKENS]
    # Before that, only the sequence with stop strings is decoded, a token a step: its new token in a window of a few
    # tokens, and the window's context when it has moved on. A decode of the whole output a step would be 1830 ids.
    steps = calls_a_step[:-1]
    assert all(calls and max(calls) <= 8 for calls in steps), steps
    assert sum(map(len, steps)) <= 2 * len(steps) + 2  # (+ 2: whether a token that adds no text is a special one)
    assert sum(map(sum, steps)) <= 5 * MAX_TOKENS
    assert set(outputs) == {with_stops, without}
    assert all((o.finish_reason, len(o.token_ids)) == ("length", MAX_TOKENS) for o in outputs.values())
