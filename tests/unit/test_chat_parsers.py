"""Reasoning and tool-call parsers (nanoinfer.chat) on written outputs: each format, malformed and cut-off calls."""

from __future__ import annotations

import json

import jsonschema
import pytest

from nanoinfer.chat.reasoning import (
    ReasoningSplit,
    prompt_closes_thinking,
    prompt_opens_thinking,
    select_reasoning_parser,
    split_reasoning,
)
from nanoinfer.chat.tool_calls import (
    ToolCall,
    call_id,
    check_tools,
    parse_constrained_calls,
    parse_tool_calls,
    select_tool_call_parser,
    tool_call_schema,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "now"}}
BAD_PATTERN = {"type": "function", "function": {"name": "lookup", "parameters": {  # an unclosed regex class
    "type": "object", "properties": {"id": {"type": "string", "pattern": "(["}}}}}


@pytest.mark.parametrize("text, prompt_opened, expected", [
    ("<think>\nplan\n</think>\n\nThe answer.", False, ReasoningSplit("plan", "The answer.")),
    ("plan</think>The answer.", True, ReasoningSplit("plan", "The answer.")),  # the template opened it
    ("plan</think>The answer.", False, ReasoningSplit("plan", "The answer.")),  # DeepSeek-R1: no opening tag
    ("Just the answer.", False, ReasoningSplit(None, "Just the answer.")),  # thinking off
    ("<think>still thinking when max_tokens", False, ReasoningSplit("still thinking when max_tokens", None, False)),
    ("still thinking", True, ReasoningSplit("still thinking", None, False)),
    ("<think>\n\n</think>\n\nAnswer", False, ReasoningSplit("", "Answer")),  # an empty thought is still one
    ("<think>done</think>", False, ReasoningSplit("done", None)),
])  # fmt: skip
def test_think_parser(text, prompt_opened, expected):
    assert split_reasoning("think", text, prompt_opened) == expected


def test_think_parser_keeps_a_closing_tag_as_content_when_the_prompt_closed_the_thinking():
    text = "Use </think> to end a thought.\nThat is all."  # Qwen3, enable_thinking false: no thought to split off
    assert split_reasoning("think", text, prompt_closed=True) == ReasoningSplit(None, text)
    assert split_reasoning("think", text).reasoning_content == "Use"  # what the prompt's closing tag prevents


def test_harmony_parser_splits_channels_and_reports_an_unfinished_analysis():
    text = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>final<|message|>"
            "Sunny.<|return|>")  # fmt: skip
    assert split_reasoning("harmony", text) == ReasoningSplit("Need the weather.", "Sunny.")
    assert split_reasoning("harmony", "<|channel|>analysis<|message|>Need the") == ReasoningSplit("Need the", None,
                                                                                                   False)  # fmt: skip
    assert split_reasoning("harmony", "plain text") == ReasoningSplit(None, "plain text")


# gpt-oss's output after the prompt's `<|start|>assistant`: a thought, a preamble, a call (recipient after the channel)
HARMONY_CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|>"
                "<|start|>assistant<|channel|>commentary<|message|>Checking Paris.<|end|>")  # fmt: skip
HARMONY_CALL_MESSAGE = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
                        '<|message|>{"city":"Paris"}<|call|>')  # fmt: skip


def test_harmony_parser_keeps_preambles_and_final_text_as_content_in_order():
    text = ("<|channel|>analysis<|message|>Plan.<|end|><|start|>assistant<|channel|>commentary<|message|>Let me look."
            "<|end|><|start|>assistant<|channel|>final<|message|>Sunny.<|return|>")  # fmt: skip
    assert split_reasoning("harmony", text) == ReasoningSplit("Plan.", "Let me look.\nSunny.")
    # A call message is no reasoning: it stays in the content as written, for the tool-call parser to take out.
    split = split_reasoning("harmony", HARMONY_CALL + HARMONY_CALL_MESSAGE)
    assert split == ReasoningSplit("Need the weather.", "Checking Paris.\n" + HARMONY_CALL_MESSAGE)


@pytest.mark.parametrize("text, calls, content", [
    (HARMONY_CALL + HARMONY_CALL_MESSAGE, [ToolCall("get_weather", '{"city": "Paris"}')], "Checking Paris."),
    # the recipient before the channel, in the first message (the prompt wrote its `<|start|>assistant`)
    (' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>',
     [ToolCall("get_weather", '{"city": "Oslo"}')], None),
    ('<|channel|>analysis<|message|>Two.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json'
     '<|message|>{"city": "Rome"}<|call|><|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>'
     '{}<|call|>', [ToolCall("get_weather", '{"city": "Rome"}'), ToolCall("get_time", "{}")], None),
    (HARMONY_CALL + HARMONY_CALL_MESSAGE.removesuffix("<|call|>"),  # <|call|> left out by the decode: still whole
     [ToolCall("get_weather", '{"city": "Paris"}')], "Checking Paris."),
    ("<|channel|>final<|message|>No call needed.<|return|>", [], "No call needed."),
])  # fmt: skip
def test_harmony_tool_call_parser_reads_calls_from_the_raw_output(text, calls, content):
    assert parse_tool_calls("harmony", text, {"get_weather", "get_time"}) == (calls, content)


@pytest.mark.parametrize("call_message", [
    HARMONY_CALL_MESSAGE.replace('"Paris"}', '"Par'),  # cut off by max_tokens
    HARMONY_CALL_MESSAGE.replace('{"city":"Paris"}', '["Paris"]'),  # arguments not an object
    HARMONY_CALL_MESSAGE.replace("get_weather", "get_news"),  # not among the line's tools
    HARMONY_CALL_MESSAGE.replace("functions.get_weather", "python"),  # a built-in tool nanoinfer does not run
])  # fmt: skip
def test_harmony_tool_call_parser_leaves_an_invalid_call_in_the_content(call_message):
    calls, content = parse_tool_calls("harmony", HARMONY_CALL + call_message, {"get_weather"})
    assert (calls, content) == ([], "Checking Paris.\n" + call_message)


def test_prompt_opens_or_closes_thinking_only_at_its_end():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<think>x</think> then <|im_start|>assistant\n")
    assert prompt_closes_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking false
    assert not prompt_closes_thinking("<think>x</think> then <|im_start|>assistant\n")
    assert not prompt_closes_thinking("<|im_start|>assistant\n<think>\n")


def test_parsers_are_selected_from_the_vocabulary_and_template():
    assert select_reasoning_parser({"<think>": 1, "</think>": 2}, None) == "think"
    assert select_reasoning_parser({"<|channel|>": 1, "<|message|>": 2}, None) == "harmony"
    assert select_reasoning_parser({"a": 1}, "{{ messages }}") is None
    assert select_tool_call_parser({"<tool_call>": 5}, None) == "hermes"
    assert select_tool_call_parser({"[TOOL_CALLS]": 5}, None) == "mistral"
    assert select_tool_call_parser({}, "{% if tools %}<|python_tag|>{% endif %}") == "llama3_json"
    assert select_tool_call_parser({}, "{{ messages }}") is None
    assert select_tool_call_parser({"<|channel|>": 1, "<|message|>": 2, "<|python_tag|>": 3}, None) == "harmony"


@pytest.mark.parametrize("parser, text, calls, content", [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     [ToolCall("get_weather", '{"city": "Paris"}')], "Let me check."),
    ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": '
               '"{\\"x\\": 1}"}</tool_call>', [ToolCall("a", "{}"), ToolCall("b", '{"x": 1}')], None),
    ("hermes", '<tool_call>{"name": "a", "arguments": {"x": 1}}', [ToolCall("a", '{"x": 1}')], None),  # no closing tag
    ("hermes", '<tool_call>{"name": "a", "arguments": {"x": ', [], '<tool_call>{"name": "a", "arguments": {"x": '),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', [], '<tool_call>{"arguments": {}}</tool_call>'),
    ("hermes", "No call here.", [], "No call here."),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo; Bergen"}}',
     [ToolCall("get_weather", '{"city": "Oslo; Bergen"}')], None),
    ("llama3_json", '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"y": [1, 2]}}',
     [ToolCall("a", "{}"), ToolCall("b", '{"y": [1, 2]}')], None),
    ("llama3_json", '{"name": "a", "parameters": {', [], '{"name": "a", "parameters": {'),
    ("llama3_json", "The weather is fine.", [], "The weather is fine."),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]',
     [ToolCall("get_weather", '{"city": "Rome"}')], None),
    ("mistral", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time[ARGS]{}',
     [ToolCall("get_weather", '{"city": "Rome"}'), ToolCall("get_time", "{}")], "Sure."),
    ("mistral", "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"ci", [],
     "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"ci"),
])  # fmt: skip
def test_tool_call_parsers(parser, text, calls, content):
    assert parse_tool_calls(parser, text) == (calls, content)


@pytest.mark.parametrize("parser, text", [
    ("llama3_json", '{"name": "Bob", "age": 3}'),  # an answer that is JSON data, not a call
    ("hermes", '<tool_call>{"name": "get_time"}</tool_call>'),
    ("mistral", '[TOOL_CALLS][{"name": "get_time"}]'),
])  # fmt: skip
def test_an_object_without_arguments_is_no_call(parser, text):
    assert parse_tool_calls(parser, text) == ([], text)


@pytest.mark.parametrize("parser, text", [
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>\n'
               '<tool_call>{"name": "delete_files", "arguments": {}}</tool_call>'),  # one of two unlisted: no call
    ("llama3_json", '{"name": "Bob", "parameters": {"age": 3}}'),
    ("mistral", '[TOOL_CALLS]delete_files[ARGS]{}'),
])  # fmt: skip
def test_a_call_to_a_function_the_tools_do_not_list_is_no_call(parser, text):
    assert parse_tool_calls(parser, text, names=["get_weather", "get_time"]) == ([], text)
    assert parse_tool_calls(parser, text)[0]  # without names, the same answer is a call


def test_constrained_calls_follow_the_schema_decoding_was_held_to():
    tools = [WEATHER, TIME]
    schema = tool_call_schema(tools, "required")
    answer = '[{"name": "get_weather", "parameters": {"city": "Lima", "days": 2}}]'
    jsonschema.validate(json.loads(answer), schema)
    with pytest.raises(jsonschema.ValidationError):  # a tool that is not listed
        jsonschema.validate([{"name": "other", "parameters": {}}], schema)
    assert parse_constrained_calls(answer, "required") == [ToolCall("get_weather", '{"city": "Lima", "days": 2}')]
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert tool_call_schema(tools, named) == WEATHER["function"]["parameters"]
    assert parse_constrained_calls('{"city": "Lima"}', named) == [ToolCall("get_weather", '{"city": "Lima"}')]
    assert parse_constrained_calls('{"city": "Li', named) == []  # cut off by max_tokens: no call
    assert parse_constrained_calls('[{"name": "get_time"}]', "required") == []  # parameters missing


@pytest.mark.parametrize("tools, tool_choice, problem", [
    ([WEATHER, TIME], "auto", None),
    ([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None),
    ([], "auto", "non-empty list"),
    ("get_weather", None, "non-empty list"),
    ([{"type": "retrieval"}], None, "tools[0] must be"),
    ([{"type": "function", "function": {"name": "has space"}}], None, "letters, digits"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None, "object"),
    ([WEATHER, WEATHER], None, "twice"),
    ([WEATHER], "sometimes", "tool_choice must be"),
    ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, "which tools do not list"),
    ([WEATHER], {"type": "function", "function": "get_weather"}, "tool_choice must be"),  # was an AttributeError
    ([WEATHER], {"type": "function"}, "tool_choice must be"),
    ([WEATHER, BAD_PATTERN], "auto", None),  # free text: nothing is compiled
    ([WEATHER, BAD_PATTERN], {"type": "function", "function": {"name": "get_weather"}}, None),
    ([WEATHER, BAD_PATTERN], "required", "tools[1].function.parameters is not a JSON schema xgrammar can compile: "
                                         "Regex parsing error at position 3: Unclosed '['"),
    ([WEATHER, BAD_PATTERN], {"type": "function", "function": {"name": "lookup"}}, "tools[1].function.parameters"),
])  # fmt: skip
def test_check_tools(tools, tool_choice, problem):
    found = check_tools(tools, tool_choice)
    assert (found is None) if problem is None else problem in found


def test_call_ids_repeat_for_the_same_line_and_differ_between_calls():
    assert call_id("line-3", 0) == call_id("line-3", 0) != call_id("line-3", 1) != call_id("line-4", 1)
    assert call_id("x", 0).startswith("call_") and len(call_id("x", 0)) == 29
