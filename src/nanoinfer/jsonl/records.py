"""Output records: a finished RequestOutput or a LineError -> the record of its line (native shapes here, OpenAI
lines' from openai.py), and back: the input line a written record answers, for resume. Writing is writer.py's.
"""

from __future__ import annotations

from collections.abc import Callable

from nanoinfer.jsonl.lines import NATIVE, LineError
from nanoinfer.jsonl.openai import _OPENAI_ID, _openai_error, _openai_result
from nanoinfer.jsonl.requests import BatchRequest


def result_record(request: BatchRequest, output, decode: Callable[[int], str]) -> dict:
    """The record for a finished RequestOutput (native or OpenAI format)."""
    if request.is_openai:
        return _openai_result(request, output, decode)
    usage = output.usage
    record: dict = {"id": request.id, "line": request.line}
    if output.lora_request is not None:
        record["lora"] = output.lora_request.lora_name
    choices = [
        {"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        | ({"logprobs": _native_logprobs(c.logprobs)} if c.logprobs is not None else {})
        for c in output.outputs
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
