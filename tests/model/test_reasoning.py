"""Reasoning in the engine, on a tiny model with a Qwen3 / DeepSeek-R1 style template (its generation prompt opens
`<think>`; enable_thinking false closes an empty one): the thinking budget ends the reasoning with `</think>`, a
grammar holds the answer after the thinking (not the thinking), unfinished reasoning stays reasoning."""

from __future__ import annotations

import json

import jsonschema
import pytest

from nanoinfer import LLM, SamplingParams
from nanoinfer.chat.reasoning import ReasoningSplit, prompt_opens_thinking, split_reasoning
from nanoinfer.errors import RequestError
from nanoinfer.testing.tiny_models import build_tiny_model

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 100}}, "required": ["a"]}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(build_tiny_model("qwen3", tmp_path_factory.mktemp("thinking") / "qwen3", thinking=True))


def thinking_tokens(llm, text: str) -> int:
    return len(llm.encode(text.split("</think>")[0]))


@pytest.mark.parametrize("budget", [0, 5, 12])
def test_the_thinking_budget_ends_the_reasoning(llm, budget):
    prompt = llm.apply_chat_template(MESSAGES)
    assert llm.reasoning_parser == "think" and prompt_opens_thinking(prompt)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=budget + 8, ignore_eos=True,
                                                max_reasoning_tokens=budget))[0]  # fmt: skip
    end = llm.encode("</think>")
    assert out.token_ids[budget : budget + 1] == end  # the budget's tokens, then the end of the thinking
    assert end[0] not in out.token_ids[:budget]
    split = split_reasoning("think", out.text, prompt_opened=True)
    assert split.finished and split.content is not None


def test_without_a_budget_a_cut_off_reasoning_is_reported_unfinished(llm):
    out = llm.generate([llm.apply_chat_template(MESSAGES)], SamplingParams(temperature=0, max_tokens=6,
                                                                            ignore_eos=True))[0]  # fmt: skip
    assert "</think>" not in out.text  # this tiny model does not end its thinking within 6 tokens
    assert split_reasoning("think", out.text, prompt_opened=True) == ReasoningSplit(out.text.strip(), None, False)


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_a_schema_holds_the_answer_after_the_thinking(llm, enable_thinking):
    prompt = llm.apply_chat_template(MESSAGES, chat_template_kwargs={"enable_thinking": enable_thinking})
    params = SamplingParams(temperature=0, max_tokens=60, max_reasoning_tokens=3, structured_outputs={"json": SCHEMA})
    out = llm.generate([prompt], params)[0]
    assert out.finish_reason == "stop"  # the grammar's end
    split = split_reasoning("think", out.text, prompt_opened=prompt_opens_thinking(prompt))
    jsonschema.validate(json.loads(split.content), SCHEMA)
    if enable_thinking:  # three tokens of thinking, unconstrained, then the JSON
        assert split.reasoning_content and thinking_tokens(llm, out.text) == 3
    else:  # the template closed the thinking: the JSON is the whole answer
        assert split.reasoning_content is None and out.text == split.content


def test_a_budget_on_a_model_that_does_not_think_is_refused(tmp_path):
    plain = LLM(build_tiny_model("qwen3", tmp_path / "plain"))
    assert plain.reasoning_parser is None
    with pytest.raises(RequestError, match="max_reasoning_tokens needs a model that thinks"):
        plain.generate(["Hello"], SamplingParams(max_reasoning_tokens=4))


def test_llm_chat_passes_tools_and_template_options(llm):
    tools = [{"type": "function", "function": {"name": "get_time"}}]
    out = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=4), tools=tools,
                   chat_template_kwargs={"enable_thinking": False})[0]  # fmt: skip
    assert '"name": "get_time"' in out.prompt and out.prompt.endswith("<think>\n\n</think>\n\n")


def test_a_plain_prompt_keeps_its_grammar_from_the_first_token(llm):
    """Not a chat: the grammar holds the whole output, <think> or not (the answer is not split)."""
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": SCHEMA})
    for prompt in ("Answer in JSON.", llm.apply_chat_template(MESSAGES)):  # even one that ends inside <think>
        out = llm.generate([prompt], params)[0]
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_a_chat_whose_template_leaves_thinking_open_may_think_then_answers_to_the_schema(llm):
    """A template that neither opens nor closes <think>: the first token may open the thinking (allowed beside the
    grammar's tokens), else the grammar holds the answer from the first token."""
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    params = SamplingParams(temperature=0, max_tokens=40, max_reasoning_tokens=2, structured_outputs={"json": SCHEMA})
    llm.add_request(prompt, params, request_id="open", chat=True)
    (out,) = [o for o in _drain(llm) if o.request_id == "open"]
    split = split_reasoning("think", out.text)
    jsonschema.validate(json.loads(split.content), SCHEMA)


def test_the_forced_end_of_thinking_is_the_token_logprobs_describe(llm):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, max_reasoning_tokens=3, logprobs=2)
    out = llm.generate([llm.apply_chat_template(MESSAGES)], params)[0]
    assert [lp.token_id for lp in out.outputs[0].logprobs] == out.token_ids
    assert out.outputs[0].logprobs[3].logprob == 0.0  # the only token the budget allowed


def test_a_refused_budget_in_a_list_queues_none_of_the_prompts(tmp_path):
    plain = LLM(build_tiny_model("qwen3", tmp_path / "plain"))
    with pytest.raises(RequestError):
        plain.generate(["a", "b"], [SamplingParams(max_tokens=2), SamplingParams(max_reasoning_tokens=1)])
    assert not plain.has_unfinished_requests()


def _drain(llm) -> list:
    outs = []
    while llm.has_unfinished_requests():
        outs += llm.step()[0]
    return outs
