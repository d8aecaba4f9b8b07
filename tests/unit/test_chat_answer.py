"""One chat completion -> content, reasoning_content, tool_calls, finish_reason (nanoinfer.chat.answer)."""

from __future__ import annotations

import json

from nanoinfer.chat.answer import ChatAnswer, ChatParsers, chat_answer

TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
    "zone": {"type": "string"}}}}}]  # fmt: skip
THINK_HERMES = ChatParsers("think", "hermes")


def calls(answer: ChatAnswer) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in answer.tool_calls]


def test_reasoning_then_a_call():
    text = '<think>the user wants the time</think><tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}' \
           '</tool_call>'  # fmt: skip
    answer = chat_answer(text, "stop", THINK_HERMES, tools=TOOLS, tool_choice="auto", seed="line-1:0")
    assert (answer.reasoning_content, answer.content, answer.finish_reason) == ("the user wants the time", None,
                                                                                 "tool_calls")  # fmt: skip
    assert calls(answer) == [("get_time", {"zone": "UTC"})] and answer.tool_calls[0]["id"].startswith("call_")


def test_unfinished_reasoning_gives_no_answer_and_no_call():
    answer = chat_answer('still thinking <tool_call>{"name": "get_time"', "length", THINK_HERMES,
                         prompt_opened=True, tools=TOOLS, tool_choice="auto")  # fmt: skip
    assert answer == ChatAnswer(None, 'still thinking <tool_call>{"name": "get_time"', [], "length")


def test_calls_to_other_functions_and_tool_choice_none_stay_text():
    text = '<tool_call>{"name": "launch", "arguments": {}}</tool_call>'
    answer = chat_answer(text, "stop", THINK_HERMES, tools=TOOLS, tool_choice="auto")
    assert answer == ChatAnswer(text, None, [], "stop")
    good = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert chat_answer(good, "stop", THINK_HERMES, tools=TOOLS, tool_choice="none").tool_calls == []


def test_a_closed_thinking_keeps_the_whole_answer_as_content():
    answer = chat_answer("a </think> in the answer", "stop", THINK_HERMES, prompt_closed=True)
    assert (answer.reasoning_content, answer.content) == (None, "a </think> in the answer")


def test_required_reads_the_constrained_json_and_keeps_a_cut_off_one_as_text():
    answer = chat_answer('[{"name": "get_time", "parameters": {"zone": "CET"}}]', "stop", ChatParsers(),
                         tools=TOOLS, tool_choice="required")  # fmt: skip
    assert calls(answer) == [("get_time", {"zone": "CET"})] and answer.content is None
    assert answer.finish_reason == "stop"  # a forced call keeps the completion's reason, as OpenAI answers it
    cut = chat_answer('[{"name": "get_ti', "length", ChatParsers(), tools=TOOLS, tool_choice="required")
    assert cut == ChatAnswer('[{"name": "get_ti', None, [], "length")


def test_harmony_keeps_preambles_as_content_and_reads_calls_from_their_messages():
    text = ("<|channel|>analysis<|message|>Need the time.<|end|><|start|>assistant<|channel|>commentary<|message|>"
            "Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json"
            '<|message|>{"zone": "UTC"}<|call|>')  # fmt: skip
    answer = chat_answer(text, "stop", ChatParsers("harmony", "harmony"), tools=TOOLS, tool_choice="auto")
    assert (answer.reasoning_content, answer.content) == ("Need the time.", "Checking.")
    assert calls(answer) == [("get_time", {"zone": "UTC"})] and answer.finish_reason == "tool_calls"
