"""Structured output in `nanoinfer generate`: every way a line can ask for it (structured_outputs,
response_format, OpenAI bodies with vLLM's guided_* fields), --json-schema as the job's default (a line's own
fields win), bad grammars as per-line error records, and an OpenAI batch file that round-trips through the
official `openai` package's types."""

from __future__ import annotations

import json
import re
import shlex

import jsonschema
import pydantic
import pytest
import torch
from openai.types import Completion
from openai.types.chat import ChatCompletion
from openai.types.chat.completion_create_params import CompletionCreateParamsNonStreaming
from typer.testing import CliRunner

from nanoinfer.cli import app
from nanoinfer.cli import generate as generate_cli
from nanoinfer.testing.tiny_models import build_tiny_model

runner = CliRunner()
ENGINE_ARGS = shlex.split(
    "--device cpu --max-model-len 256 --kvcache-block-size 256 --cpu-kvcache-space-gib 0.02 --max-tokens 120 --quiet"
)
SCHEMA = {
    "type": "object",
    "properties": {"label": {"enum": ["spam", "ham"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["label", "score"],
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    threads = torch.get_num_threads()
    yield str(build_tiny_model("qwen3", tmp_path_factory.mktemp("model") / "qwen3"))
    torch.set_num_threads(threads)


def run(tmp_path, model: str, lines: list[dict], *extra: str) -> tuple[object, dict[str, dict]]:
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = runner.invoke(app, ["generate", str(source), "-o", str(out), "--model", model, *ENGINE_ARGS, *extra])
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return result, {r.get("custom_id") or r["id"]: r for r in records}


def test_every_way_a_line_asks_for_structured_output(tmp_path, tiny_model):
    lines = [
        {"id": "so", "prompt": "a", "temperature": 0, "structured_outputs": {"json": SCHEMA}},
        {"id": "rf", "prompt": "b", "temperature": 0,
         "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}},
        {"id": "regex", "prompt": "c", "seed": 1, "structured_outputs": {"regex": "[0-9]{3}"}},
        {"id": "choice", "prompt": "d", "seed": 2, "structured_outputs": {"choice": ["left", "right"]}},
        {"id": "text", "prompt": "e", "temperature": 0, "max_tokens": 3, "response_format": {"type": "text"}},
        {"id": "two", "prompt": "f", "structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
        {"id": "empty", "prompt": "g", "structured_outputs": {"choice": []}},
        {"id": "kinds", "prompt": "h", "structured_outputs": {"regex": "a", "json": {}}},
        {"id": "bad_schema", "prompt": "i", "structured_outputs": {"json": {"type": "objekt"}}},
        {"id": "bad_regex", "prompt": "j", "structured_outputs": {"regex": "(ab"}},
        {"id": "bad_format", "prompt": "k", "response_format": {"type": "xml"}},
    ]
    result, records = run(tmp_path, tiny_model, lines)
    assert result.exit_code == 0, result.output
    assert len(records) == len(lines)
    for key in ("so", "rf"):
        assert records[key]["finish_reason"] == "stop", records[key]
        jsonschema.validate(json.loads(records[key]["text"]), SCHEMA)
    assert records["so"]["text"] == records["rf"]["text"] and not records["so"]["text"].startswith("{ ")
    assert re.fullmatch("[0-9]{3}", records["regex"]["text"]) and records["choice"]["text"] in ("left", "right")
    assert records["text"]["error"] is None and records["text"]["usage"]["completion_tokens"] >= 1
    for key, words in [("two", "gives structured_outputs and response_format"), ("empty", "choice must be"),
                       ("kinds", "give exactly one of"), ("bad_schema", 'Unsupported type "objekt"'),
                       ("bad_regex", "parenthesis is not closed"), ("bad_format", "response_format must be")]:
        error = records[key]["error"]
        assert error["code"] == "invalid_structured_outputs" and words in error["message"], (key, error)


def test_json_schema_flag_is_the_jobs_default_and_a_lines_own_fields_win(tmp_path, tiny_model):
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    lines = [
        {"id": "default", "prompt": "a", "temperature": 0},
        {"id": "own", "prompt": "b", "temperature": 0, "structured_outputs": {"choice": ["yes", "no"]}},
        {"id": "free", "prompt": "c", "temperature": 0, "max_tokens": 2, "ignore_eos": True,
         "response_format": {"type": "text"}},
    ]
    result, records = run(tmp_path, tiny_model, lines, "--json-schema", str(schema_file))
    assert result.exit_code == 0, result.output
    jsonschema.validate(json.loads(records["default"]["text"]), SCHEMA)
    assert records["own"]["text"] in ("yes", "no")
    assert records["free"]["usage"]["completion_tokens"] == 2 and records["free"]["finish_reason"] == "length"


def test_json_any_whitespace_lets_the_grammar_pad(tmp_path, tiny_model):
    lines = [{"id": "ws", "prompt": "a", "temperature": 0, "structured_outputs": {"json_object": True}}]
    _, compact = run(tmp_path, tiny_model, lines)
    (tmp_path / "out.jsonl").unlink()
    _, loose = run(tmp_path, tiny_model, lines, "--json-any-whitespace")
    # Random weights love whitespace: with it allowed the greedy output changes, without it none appears.
    assert compact["ws"]["text"] != loose["ws"]["text"]
    assert not re.search(r"[\n\t]|  ", compact["ws"]["text"])


@pytest.mark.parametrize("content, words", [("not json", "cannot be read as JSON"), ("[1, 2]", "not a schema object"),
                                            ('{"type": "objekt"}', 'Unsupported type "objekt"')])
def test_a_bad_json_schema_flag_exits_2_before_loading(tmp_path, tiny_model, monkeypatch, content, words):
    monkeypatch.setattr(generate_cli, "load_llm", lambda config: pytest.fail("the model was loaded"))
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(content)
    result, _ = run(tmp_path, tiny_model, [{"prompt": "a"}], "--json-schema", str(schema_file))
    assert result.exit_code == 2 and words in result.output and "Traceback" not in result.output


def test_openai_batch_with_response_format_round_trips_through_openai_types(tmp_path, tiny_model):
    chat = CompletionCreateParamsNonStreaming
    bodies = [
        ("chat-rf", "/v1/chat/completions", {
            "model": "tiny", "messages": [{"role": "user", "content": "Classify"}], "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA, "strict": True}},
        }),
        ("chat-obj", "/v1/chat/completions", {
            "model": "tiny", "messages": [{"role": "user", "content": "Any JSON"}], "seed": 3, "max_tokens": 60,
            "response_format": {"type": "json_object"},
        }),
        ("chat-guided", "/v1/chat/completions", {
            "model": "tiny", "messages": [{"role": "user", "content": "Pick"}], "guided_choice": ["A", "B"],
        }),
        ("cmpl-regex", "/v1/completions", {"model": "tiny", "prompt": "Code:", "guided_regex": "[A-Z]{2}[0-9]"}),
        ("cmpl-json", "/v1/completions", {"model": "tiny", "prompt": "JSON:", "temperature": 0,
                                          "guided_json": SCHEMA}),
        ("cmpl-grammar", "/v1/completions", {"model": "tiny", "prompt": "Sum:", "temperature": 0,
                                             "guided_grammar": 'root ::= [1-9] "+" [1-9]'}),
    ]
    for _, url, body in bodies:
        if url == "/v1/chat/completions" and "guided_choice" not in body:  # vLLM's extras are no OpenAI fields
            pydantic.TypeAdapter(chat).validate_python(body)
    lines = [{"custom_id": c, "method": "POST", "url": u, "body": b} for c, u, b in bodies]
    result, records = run(tmp_path, tiny_model, lines)
    assert result.exit_code == 0, result.output
    for custom_id, url, _ in bodies:
        record = records[custom_id]
        assert record["error"] is None and record["response"]["status_code"] == 200, record
        body = record["response"]["body"]
        if url == "/v1/chat/completions":
            text = ChatCompletion.model_validate(body).choices[0].message.content
        else:
            text = Completion.model_validate(body).choices[0].text
        finish = body["choices"][0]["finish_reason"]
        if custom_id in ("chat-rf", "cmpl-json"):
            assert finish == "stop"
            jsonschema.validate(json.loads(text), SCHEMA)
        elif custom_id == "chat-obj" and finish == "stop":
            assert isinstance(json.loads(text), dict)
        elif custom_id == "chat-guided":
            assert text in ("A", "B")
        elif custom_id == "cmpl-regex":
            assert re.fullmatch("[A-Z]{2}[0-9]", text)
        elif custom_id == "cmpl-grammar":
            assert re.fullmatch("[1-9][+][1-9]", text)
