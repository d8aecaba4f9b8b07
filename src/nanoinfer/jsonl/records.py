"""Output records: a finished RequestOutput or a LineError -> the record of its line (native shapes here, OpenAI
lines' from openai.py), and back: the input line a written record answers, for resume. Writing is writer.py's.
"""

from __future__ import annotations

from collections.abc import Callable

from nanoinfer.jsonl.lines import NATIVE, LineError
from nanoinfer.jsonl.openai import _OPENAI_ID, _openai_error, _openai_result
from nanoinfer.jsonl.requests import BatchRequest


def result_record(request: BatchRequest, output, decode: Callable[[int], str], answers: list | None = None) -> dict:
    """The record for a finished RequestOutput (native or OpenAI format). answers: a chat line's completions as
    chat/answer.ChatAnswers (its text the content, the reasoning and tool calls beside it), else None."""
    if request.is_openai:
        return _openai_result(request, output, decode, answers)
    usage = output.usage
    record: dict = {"id": request.id, "line": request.line}
    if output.lora_request is not None:
        record["lora"] = output.lora_request.lora_name
    choices = [
        {"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        | (_native_answer(answers[i]) if answers is not None else {})
        | ({"logprobs": _native_logprobs(c.logprobs)} if c.logprobs is not None else {})
        for i, c in enumerate(output.outputs)
    ]
    if len(choices) == 1:
        record |= {k: v for k, v in choices[0].items() if k != "index"}
    else:
        record["choices"] = choices
    if output.prompt_logprobs is not None:
        record["prompt_logprobs"] = _native_logprobs(output.prompt_logprobs)
    record["usage"] = usage
    record["error"] = None
    return record


def _native_answer(answer) -> dict:
    """A chat answer's fields in a native record: text is its content ("" when it has none: cut off while thinking,
    or only calls), reasoning_content and tool_calls beside it when there are any."""
    fields = {"text": answer.content or "", "finish_reason": answer.finish_reason}
    if answer.reasoning_content is not None:
        fields["reasoning_content"] = answer.reasoning_content
    if answer.tool_calls:
        fields["tool_calls"] = answer.tool_calls
    return fields


def error_record(error: LineError) -> dict:
    if error.kind != NATIVE:
        return _openai_error(error)
    return {
        "id": error.id,
        "line": error.line,
        "text": None,
        "finish_reason": "error",
        "usage": None,
        "error": {"code": error.code, "message": error.message},
    }


def record_line_number(record: dict) -> int | None:
    """The input line a written record answers (native: "line"; OpenAI: encoded in "id")."""
    line = record.get("line")
    if isinstance(line, int) and not isinstance(line, bool):
        return line
    match = _OPENAI_ID.match(str(record.get("id", "")))
    return int(match.group(1)) if match else None


def _native_logprobs(logprobs) -> list[dict | None]:
    return [
        {
            "token_id": lp.token_id,
            "logprob": lp.logprob,
            "top": [{"token_id": t, "logprob": v} for t, v in lp.top],
        }
        if lp is not None
        else None  # a prompt's first token: nothing comes before it
        for lp in logprobs
    ]
