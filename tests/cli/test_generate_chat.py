"""Chat batches as users send them (issue 49): OpenAI chat lines with tools and every tool_choice on the default model
(answers validate as openai's ChatCompletion, forced calls' arguments as their function's schema), and reasoning on a
tiny model whose template opens <think>: reasoning_content apart from content, unfinished reasoning, a thinking budget,
a schema applied after the thinking, chat_template_kwargs per line and per job."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai.types.chat import ChatCompletion
from typer.testing import CliRunner

from nanoinfer.cli import app
from nanoinfer.testing.tiny_models import build_tiny_model

runner = CliRunner()
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                           "days": {"type": "integer", "enum": [1, 2, 3]}},
                          "required": ["city", "days"], "additionalProperties": False}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}  # fmt: skip
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris tomorrow?"}]


def chat_line(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": ASK, "max_tokens": 64, "temperature": 0, **body}}  # fmt: skip


def run(tmp_path, lines: list[dict], *flags) -> dict:
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = runner.invoke(app, ["generate", str(source), "-o", str(out), "--quiet", *flags])
    assert result.exit_code == 0, result.output
    return {record.get("custom_id", record.get("id")): record for record in map(json.loads, out.open())}


def test_tool_choice_on_the_default_model_gives_valid_chat_completions(tmp_path, default_model_dir):
    named = {"type": "function", "function": {"name": "get_time"}}
    lines = [
        chat_line("required", tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False),
        chat_line("named", tools=[WEATHER, TIME], tool_choice=named),
        chat_line("auto", tools=[WEATHER, TIME], tool_choice="auto"),
        chat_line("none", tools=[WEATHER, TIME], tool_choice="none"),
        chat_line("bad-tools", tools=[{"type": "function", "function": {"name": "no spaces allowed"}}]),
        chat_line("bad-choice", tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_time"}}),
    ]
    records = run(tmp_path, lines, "--model", str(default_model_dir))
    for custom_id in ("required", "named", "auto", "none"):
        completion = ChatCompletion.model_validate(records[custom_id]["response"]["body"])  # OpenAI's own type
        message = completion.choices[0].message
        if custom_id in ("required", "named"):
            assert completion.choices[0].finish_reason == "stop" and message.content is None  # forced: OpenAI's
            assert len(message.tool_calls) == 1 and message.tool_calls[0].id.startswith("call_")
            call = message.tool_calls[0].function
            assert call.name == "get_time" if custom_id == "named" else call.name in SCHEMAS
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        else:  # the default model's template has no tool format: auto finds no call in what it wrote, none never looks
            assert not message.tool_calls and message.content
    for custom_id, fragment in (("bad-tools", "letters, digits"), ("bad-choice", "which tools do not list")):
        error = records[custom_id]["error"]
        assert error["code"] == "invalid_tools" and fragment in error["message"]


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory):
    return build_tiny_model("qwen3", tmp_path_factory.mktemp("thinking") / "qwen3", thinking=True)


def native(line_id: str, **fields) -> dict:
    return {"id": line_id, "messages": ASK, "temperature": 0, "ignore_eos": True, **fields}


def test_reasoning_comes_apart_from_the_answer(tmp_path, thinking_model):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 100}}, "required": ["a"]}
    lines = [
        native("budget", max_tokens=16, max_reasoning_tokens=4),
        native("unfinished", max_tokens=5),
        native("schema", max_tokens=48, max_reasoning_tokens=3, ignore_eos=False, structured_outputs={"json": schema}),
        native("no-thinking", max_tokens=48, ignore_eos=False, structured_outputs={"json": schema},
               chat_template_kwargs={"enable_thinking": False}),
        chat_line("openai", max_tokens=16, max_reasoning_tokens=4, ignore_eos=True),
    ]
    records = run(tmp_path, lines, "--model", str(thinking_model))
    budget = records["budget"]
    assert budget["reasoning_content"] and budget["finish_reason"] == "length" and "</think>" not in budget["text"]
    unfinished = records["unfinished"]  # cut off while thinking: reported as reasoning, no content
    assert unfinished["reasoning_content"] and unfinished["text"] == "" and unfinished["finish_reason"] == "length"
    jsonschema.validate(json.loads(records["schema"]["text"]), schema)
    assert records["schema"]["reasoning_content"]
    jsonschema.validate(json.loads(records["no-thinking"]["text"]), schema)
    assert "reasoning_content" not in records["no-thinking"]
    message = ChatCompletion.model_validate(records["openai"]["response"]["body"]).choices[0].message
    assert message.reasoning_content == budget["reasoning_content"] and message.content == budget["text"]


def test_chat_template_kwargs_for_the_job_and_a_line(tmp_path, thinking_model):
    lines = [native("job", max_tokens=8), native("line", max_tokens=8, chat_template_kwargs={"enable_thinking": True})]
    records = run(tmp_path, lines, "--model", str(thinking_model), "--chat-template-kwargs",
                  '{"enable_thinking": false}')  # fmt: skip
    assert "reasoning_content" not in records["job"]  # the job's template option closed the thinking
    assert "reasoning_content" in records["line"]  # the line's own option wins
    result = runner.invoke(app, ["generate", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "x.jsonl"),
                                 "--chat-template-kwargs", "[1]", "--model", str(thinking_model)])  # fmt: skip
    assert result.exit_code == 2 and "must be a JSON object" in result.output


def test_auto_parses_a_hermes_call_the_model_wrote(tmp_path, thinking_model):
    """The thinking tokenizer has <tool_call>: hermes is chosen. A regex steers the answer into a call (after a
    thinking cut at once by its budget); "auto" parses it, and a call to a function the line does not list is text."""
    call = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    other = '<tool_call>{"name": "launch", "arguments": {}}</tool_call>'
    steer = {"max_tokens": 64, "max_reasoning_tokens": 0, "ignore_eos": False}
    lines = [chat_line("auto", tools=[WEATHER, TIME], tool_choice="auto", guided_regex=call.replace("{", "\\{")
                       .replace("}", "\\}"), **steer),
             chat_line("unknown", tools=[WEATHER, TIME], tool_choice="auto", guided_regex=other.replace("{", "\\{")
                       .replace("}", "\\}"), **steer)]  # fmt: skip
    records = run(tmp_path, lines, "--model", str(thinking_model))
    completion = ChatCompletion.model_validate(records["auto"]["response"]["body"])
    assert completion.choices[0].finish_reason == "tool_calls" and completion.choices[0].message.content is None
    (parsed,) = completion.choices[0].message.tool_calls
    assert (parsed.function.name, json.loads(parsed.function.arguments)) == ("get_time", {"zone": "UTC"})
    message = ChatCompletion.model_validate(records["unknown"]["response"]["body"]).choices[0].message
    assert not message.tool_calls and message.content == other


def test_special_thinking_tokens_still_split(tmp_path):
    """A tokenizer that marks <think> and </think> special: decoded text leaves them out, so the answer is read from
    the output decoded with them."""
    model = build_tiny_model("qwen3", tmp_path / "special", thinking="special")
    budget = run(tmp_path, [native("budget", max_tokens=10, max_reasoning_tokens=3)], "--model", str(model))["budget"]
    assert budget["reasoning_content"] and budget["text"]
    assert "think>" not in budget["text"] + budget["reasoning_content"]
    (tmp_path / "none").mkdir()
    refused = run(tmp_path / "none", [native("budget", max_tokens=10, max_reasoning_tokens=3)], "--model", str(model),
                  "--reasoning-parser", "none")["budget"]  # fmt: skip
    assert refused["error"]["code"] == "invalid_sampling_params"  # a budget needs the think parser
