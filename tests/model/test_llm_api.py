"""The LLM facade end to end on a tiny model: stop rules, seeds, n, chat, logprobs, bad requests."""

from __future__ import annotations

import pytest

from nanoinfer import LLM, SamplingParams
from nanoinfer.errors import RequestError, UnservableRequestError


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    return LLM(str(tiny_model_dirs["qwen3"]), max_model_len=256, cpu_kvcache_space_gib=0.25)


PROMPTS = ["The quick brown fox", "Paris is the capital of", "Once upon a time there was"]


@pytest.mark.timeout(120)
def test_unservable_request_errors_while_the_rest_complete(llm):
    too_long = list(range(5, 5 + 300))  # 300 tokens > max_model_len 256
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([PROMPTS[0], too_long, PROMPTS[1]], params)
    assert outs[1].finish_reason == "error" and outs[1].error_code == "prompt_too_long"
    assert "max_model_len is 256" in outs[1].error
    assert [o.finish_reason for o in (outs[0], outs[2])] == ["length", "length"]
    assert all(len(o.token_ids) == 8 for o in (outs[0], outs[2]))


def test_add_request_is_the_one_admission_check_and_names_each_refusal(llm, monkeypatch):
    cases = [
        (list(range(5, 5 + 256)), "prompt_too_long", "the prompt has 256 tokens, but max_model_len is 256"),
        ([], "empty_prompt", "the prompt is empty"),
        ("x" * (llm.max_prompt_chars + 1), "prompt_too_long", f"{llm.max_prompt_chars + 1:,} characters"),
    ]
    encoded = []
    encode = type(llm).encode
    monkeypatch.setattr(type(llm), "encode", lambda self, text: encoded.append(len(text)) or encode(self, text))
    for prompt, code, message in cases:
        with pytest.raises(UnservableRequestError, match=message) as excinfo:
            llm.add_request(prompt, SamplingParams(max_tokens=4))
        assert excinfo.value.code == code
    assert encoded == []  # text too long to fit is refused before it is tokenized
    assert not llm.has_unfinished_requests()  # nothing refused reached the engine
    with pytest.raises(RequestError) as excinfo:
        llm.add_request([1, 2, 10**9])
    assert excinfo.value.code == "out_of_vocabulary"
    request_id = llm.add_request(list(range(5, 5 + 255)), SamplingParams(temperature=0, max_tokens=4))
    outputs = []
    while llm.has_unfinished_requests():
        outputs += llm.step()[0]
    assert [(o.request_id, o.finish_reason, len(o.token_ids)) for o in outputs] == [(request_id, "length", 1)]


def test_stop_token_ids_and_stop_strings_end_generation(llm):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    free = llm.generate(PROMPTS[0], greedy)[0]
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                  stop_token_ids=[stop_id]))[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop_id
    assert out.token_ids == free.token_ids[: first + 1]

    stop_text = free.text[len(free.text) // 2:][:3]
    assert stop_text.strip()
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop_text]))[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop_text
    assert stop_text not in out.text and free.text.startswith(out.text)


def test_max_tokens_gives_length(llm):
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_seeded_request_reproduces_alone_and_inside_another_batch(llm):
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=16, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPTS[2], seeded)[0].token_ids
    batch = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1]], [other, seeded, other])
    assert batch[1].token_ids == alone
    assert llm.generate(PROMPTS[2], SamplingParams(temperature=1.0, seed=43, max_tokens=16,
                                                   ignore_eos=True))[0].token_ids != alone


def test_n_sequences_share_the_prompt(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert out.usage["completion_tokens"] == 24


def test_chat_uses_the_template_and_logprobs_are_returned(llm):
    out = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(temperature=0, max_tokens=4, logprobs=2,
                                                                         ignore_eos=True))[0]
    assert out.prompt.startswith("<|im_start|>user\nHello<|im_end|>")
    logprobs = out.outputs[0].logprobs
    assert len(logprobs) == 4
    assert all(lp.token_id == t and lp.top[0][0] == t for lp, t in zip(logprobs, out.token_ids))  # greedy = top-1


def test_out_of_vocabulary_token_ids_are_rejected(llm):
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llm.generate([[1, 2, 10**9]])


def test_speculation_keeps_texts_stops_and_sampled_requests_as_without(tiny_model_dirs, llm):
    """num_speculative_tokens on a mixed batch: greedy requests with stop strings and stop ids end where plain
    decoding ends them, a sampled request (never speculated) draws the same seeded tokens, a logprobs request
    gets the same log-probabilities."""
    speculating = LLM(str(tiny_model_dirs["qwen3"]), max_model_len=256, cpu_kvcache_space_gib=0.25,
                      num_speculative_tokens=3)  # fmt: skip
    free = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    stop_text = free.text[len(free.text) // 2 :][:3]
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop_text]),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[free.token_ids[20]]),
        SamplingParams(temperature=0.9, max_tokens=30, seed=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
    ]
    prompts = [PROMPTS[0]] * 3 + PROMPTS[1:]
    plain = llm.generate(prompts, params)
    speculated = speculating.generate(prompts, params)
    for a, b in zip(plain, speculated):
        assert (a.token_ids, a.text, a.finish_reason, a.outputs[0].stop_reason) == (
            b.token_ids, b.text, b.finish_reason, b.outputs[0].stop_reason
        )
    ours, theirs = plain[4].outputs[0].logprobs, speculated[4].outputs[0].logprobs
    if llm.engine.platform.name == "cpu":
        # The C++ kernels compute each decode row alone, whatever else the batch holds: the same bits.
        assert ours == theirs
    else:
        # Plain torch attends a step's decode rows as one padded batch, so a row's float32 sums depend on the
        # batch (a speculated step has more rows): the same tokens, log-probabilities within float32 rounding of
        # logits of magnitude ~10 (1e-4 is 100x float32's relative epsilon at that size, with margin).
        def ids(entries):
            return [(e.token_id, [t for t, _ in e.top]) for e in entries]

        assert ids(ours) == ids(theirs)
        for a, b in zip(ours, theirs):
            assert abs(a.logprob - b.logprob) < 1e-4
            assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a.top, b.top))
    assert speculated[1].finish_reason == "stop" and speculated[2].finish_reason == "stop"
    assert speculating.engine.scheduler.num_accepted_tokens > 0


def test_vllm_speculative_config_sets_the_speculation_fields_or_says_what_is_wrong(tiny_model_dirs):
    from nanoinfer.errors import ConfigError

    model = str(tiny_model_dirs["qwen3"])
    llm = LLM(model, max_model_len=256, cpu_kvcache_space_gib=0.25,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4})  # fmt: skip
    assert (llm.config.num_speculative_tokens, llm.config.prompt_lookup_min, llm.config.prompt_lookup_max) == (2, 1, 4)
    bad = [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle' is not supported"),
        ({"method": "ngram"}, "needs \"num_speculative_tokens\""),
        ({"num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "draft_tensor_parallel_size"),
        ([("method", "ngram")], "must be a dict"),
    ]
    for spec, message in bad:
        with pytest.raises(ConfigError, match=message):
            LLM(model, speculative_config=spec)
    with pytest.raises(ConfigError, match="give it once"):
        LLM(model, num_speculative_tokens=3, speculative_config={"num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="num_speculative_tokens"):  # Config's own range check still applies
        LLM(model, speculative_config={"num_speculative_tokens": 40})


def test_a_config_and_other_settings_together_are_refused_naming_them(tiny_model_dirs):
    """LLM(config=...) used to drop the other settings silently; a user who wrote both meant them both."""
    from nanoinfer.config import Config
    from nanoinfer.errors import NanoInferError

    config = Config(model=str(tiny_model_dirs["llama"]), max_model_len=256)
    with pytest.raises(NanoInferError, match=r"takes no other settings, but got max_num_seqs, seed"):
        LLM(config=config, seed=3, max_num_seqs=2)
    with pytest.raises(NanoInferError, match=r"but got model"):
        LLM(str(tiny_model_dirs["llama"]), config=config)
