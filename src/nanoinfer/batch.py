"""JSONL batch I/O for `nanoinfer generate`: input lines -> BatchRequests, outputs -> records, resume.

Knows nothing about models or the engine: it parses and checks lines (nanoinfer's own format and the
OpenAI batch format), builds output records, writes them crash-safely and keeps the resume manifest.
Tokenizing and running the requests is `line_runner.py`'s job.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from nanoinfer.errors import BatchFileError, OutputWriteError, RequestError, StructuredOutputError
from nanoinfer.errors import short_repr as _short
from nanoinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Used when neither the line nor the command gives max_tokens (SamplingParams' own default, 16, is a
# library default for quick calls; a batch job usually wants whole answers).
DEFAULT_MAX_TOKENS = 256
MANIFEST_VERSION = 1
# Config fields that change what a request produces; a resumed job must keep them. Others (batch sizes,
# cache size, device) only change speed and may differ between runs.
RESULT_FIELDS = ("max_model_len", "dtype", "seed")
# Per-line limits (README "Limits"): a line over MAX_LINE_BYTES is skipped unread with an error record (the
# default fits any prompt a 1M-token context holds); JSON nesting is bounded so that parsing cannot recurse
# without bound (an OpenAI chat body with a nested JSON schema needs about 20 levels).
MAX_LINE_BYTES = 64 << 20
MAX_JSON_DEPTH = 64
MAX_ID_CHARS = 1024  # ids are kept in memory for the whole job to catch duplicates
_READ_CHUNK = 1 << 20

NATIVE, CHAT, COMPLETIONS, EMBEDDINGS = "native", "chat", "completions", "embeddings"
# /v1/embeddings lines are `nanoinfer embed`'s (embed_batch.py parses them); generate answers them with an error.
OPENAI_URLS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETIONS, "/v1/embeddings": EMBEDDINGS}
_PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")
_SAMPLING_KEYS = tuple(SamplingParams.field_names())
# Ways to ask for structured output besides "structured_outputs": OpenAI's, and vLLM's older extra fields.
_GUIDED_KEYS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_NATIVE_KEYS = ("id", *_PROMPT_KEYS, *_SAMPLING_KEYS, "response_format", "lora")
ANY_WHITESPACE_DEFAULT = "json_any_whitespace"  # a sampling default of the job (--json-any-whitespace)
# OpenAI body keys: mapped onto SamplingParams, accepted and ignored, or refused as unsupported.
_OPENAI_COMMON = (
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "user",
    "store",
    "metadata",
    "stream",
    # vLLM's extra sampling parameters, so files written for `vllm run-batch` work too
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "response_format",
    "structured_outputs",
    *_GUIDED_KEYS,
)
_OPENAI_KEYS = {
    CHAT: (*_OPENAI_COMMON, "messages", "max_completion_tokens", "logprobs", "top_logprobs"),
    COMPLETIONS: (*_OPENAI_COMMON, "prompt", "logprobs", "echo", "suffix", "best_of"),
}
_OPENAI_UNSUPPORTED = (
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "logit_bias",
    "audio",
    "modalities",
    "prediction",
    "parallel_tool_calls",
    "reasoning_effort",
    "web_search_options",
)
_OPENAI_ID = re.compile(r"^batch_req_line(\d+)$")


class BadLine(Exception):
    """A line that cannot become a request: `code` for scripts, `message` for people."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class BatchRequest:
    """One parsed input line; `kind` is native, chat or completions (the last two: OpenAI batch format)."""

    line: int
    id: str
    kind: str
    params: SamplingParams
    prompt: str | None = None
    messages: list[dict] | None = None
    prompt_token_ids: list[int] | None = None
    model: str | None = None  # OpenAI body's "model", echoed in the response (an adapter's name selects it)
    lora: str | None = None  # a native line's "lora": the name of the job's adapter it runs with (None: the base model)
    echo: bool = False  # a completions body's echo: each choice's text (and logprobs) start with the prompt's

    @property
    def is_openai(self) -> bool:
        return self.kind != NATIVE


@dataclass
class LineError:
    """A line that got an error record instead of a request."""

    line: int
    id: str | None
    kind: str
    code: str
    message: str


# ---- reading ----------------------------------------------------------------------------------------------
class LineTooLong:
    """Stands in for the bytes of a line longer than the limit, which are skipped, never held in memory."""

    def __init__(self, num_bytes: int):
        self.num_bytes = num_bytes


def iter_lines(stream: Iterable[bytes], max_line_bytes: int = MAX_LINE_BYTES,
               first_line: int = 1) -> Iterator[tuple[int, bytes]]:
    """Lazily yield (line number from first_line, raw bytes or LineTooLong) for each non-blank line.

    A file object is read with a bounded readline, so one huge line costs at most max_line_bytes of memory.
    """
    for number, raw in enumerate(_bounded_lines(stream, max_line_bytes), start=first_line):
        if isinstance(raw, LineTooLong):
            yield number, raw
            continue
        if number == first_line and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]  # a UTF-8 byte order mark, as some editors write
        if raw.strip():
            yield number, raw


def _bounded_lines(stream, max_line_bytes: int) -> Iterator[bytes | LineTooLong]:
    readline = getattr(stream, "readline", None)
    if readline is None:  # a list or generator of lines (tests, the Python API)
        for raw in stream:
            yield LineTooLong(len(raw)) if len(raw.rstrip(b"\r\n")) > max_line_bytes else raw
        return
    while True:
        raw = readline(max_line_bytes + 2)  # room for the line's own \r\n
        if not raw:
            return
        if len(raw.rstrip(b"\r\n")) <= max_line_bytes:
            yield raw
            continue
        num_bytes = len(raw)
        while not raw.endswith(b"\n"):  # skip the rest of the line a chunk at a time
            raw = readline(_READ_CHUNK)
            if not raw:
                break
            num_bytes += len(raw)
        yield LineTooLong(num_bytes)


class BatchReader:
    """Input lines -> BatchRequest | LineError, in line order, lazily.

    Ids are claimed in line order for every line, also for those skipped because a previous run already
    answered them, so a resumed job makes the same duplicate-id decisions as an uninterrupted one. The set
    of claimed ids is the only state that grows with the input (about 100 bytes per line).

    This is the per-line boundary of a job: nothing a line holds raises out of it. A problem nanoinfer
    knows gets its own code; anything else becomes `internal_error`, logged with its traceback at debug.
    """

    def __init__(self, stream: Iterable[bytes], defaults: dict, done_lines: set[int] = frozenset(),
                 max_line_bytes: int = MAX_LINE_BYTES, first_line: int = 1, parse: Callable | None = None):
        self.stream = stream
        self.defaults = defaults
        # (line number, object, kind, defaults) -> request, raising BadLine: generate's parse_request by default
        self.parse = parse or parse_request
        self.done_lines = done_lines
        self.max_line_bytes = max_line_bytes
        self.first_line = first_line  # the number of the stream's first line (Ray Data numbers rows across batches)
        self.num_skipped = 0
        self._ids: set[str] = set()
        self._last_kind = NATIVE  # an unreadable line is answered in the format of the lines before it

    def __iter__(self) -> Iterator[BatchRequest | LineError]:
        for number, raw in iter_lines(self.stream, self.max_line_bytes, self.first_line):
            item = self._parse(number, raw)
            if number in self.done_lines:
                self.num_skipped += 1
                continue
            yield item

    def _parse(self, number: int, raw: bytes | LineTooLong) -> BatchRequest | LineError:
        requested_id, kind = None, self._last_kind
        try:
            if isinstance(raw, LineTooLong):
                raise BadLine(
                    "line_too_long",
                    f"is {raw.num_bytes:,} bytes long, over the limit of {self.max_line_bytes:,}; it was "
                    "skipped unread. Shorten it, or raise --max-line-bytes.",
                )
            obj = decode_line(raw)
            kind = self._last_kind = CHAT if is_openai_line(obj) else NATIVE  # refined below
            requested_id = request_id_of(obj, kind)
            if _SURROGATE_ESCAPE.search(raw):  # only an escape makes a lone surrogate: strict UTF-8 refuses them
                check_unicode(obj)
            kind = self._last_kind = line_kind(obj)
            request = self.parse(number, obj, kind, self.defaults)
        except BadLine as e:
            return self._error(number, requested_id, kind, e.code, e.message)
        except Exception as e:  # the per-line boundary: a bug here must not end the job
            logger.debug("line %d: unexpected error while parsing", number, exc_info=True)
            return self._error(number, requested_id, kind, "internal_error", internal_error_message(e))
        if request.id in self._ids:
            what = "custom_id" if request.is_openai else "id"
            return LineError(
                number,
                None,
                kind,
                "duplicate_id",
                f"line {number}: {what} {request.id!r} was already used by an earlier line; "
                "ids join output records to input lines, so each must be unique.",
            )
        self._ids.add(request.id)
        return request

    def _error(self, number: int, requested_id: str | None, kind: str, code: str, message: str) -> LineError:
        return LineError(number, self._claim_or_none(number, requested_id, kind), kind, code,
                         f"line {number}: {message}")

    def _claim_or_none(self, number: int, requested_id: str | None, kind: str) -> str | None:
        # The error record carries the line's id when it is readable and still free; an OpenAI line without
        # a custom_id has none, a native one gets the id derived from its line number.
        candidate = (
            requested_id if requested_id is not None else (None if kind != NATIVE else f"line-{number}")
        )
        if candidate is None or candidate in self._ids:
            return None
        self._ids.add(candidate)
        return candidate


def internal_error_message(e: BaseException) -> str:
    text = str(e)
    text = text if len(text) <= 500 else text[:497] + "..."
    return (f"nanoinfer failed on this line ({type(e).__name__}: {text}). This is a bug in nanoinfer; the job "
            "went on without the line. Please report it with the line (run with --log-level debug for the "
            "traceback).")


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string, escapes included (linear time)
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_DEPTH_STEP = np.zeros(256, dtype=np.int8)
_DEPTH_STEP[list(b"[{")] = 1
_DEPTH_STEP[list(b"]}")] = -1
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def json_depth(raw: bytes) -> int:
    """How deeply the arrays and objects of a JSON text nest (brackets inside strings do not count)."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return 0  # cannot nest deeper than the limit: skip the scan
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    return int(np.cumsum(_DEPTH_STEP[np.frombuffer(brackets, dtype=np.uint8)], dtype=np.int64).max())


def decode_line(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadLine(
            "invalid_utf8",
            f"is not valid UTF-8 (byte {e.start}: {raw[e.start : e.start + 1]!r}). Save the file as UTF-8.",
        ) from None
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise BadLine(
            "nesting_too_deep",
            f"nests arrays and objects {depth} levels deep; the limit is {MAX_JSON_DEPTH}. Flatten the data.",
        )
    try:
        obj = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except json.JSONDecodeError as e:
        raise BadLine("invalid_json", f"is not valid JSON ({e.msg} at column {e.colno}).") from None
    except _NotJson as e:
        raise BadLine("invalid_json", f"is not valid JSON: {e}") from None
    except ValueError:  # Python reads integers of at most 4,300 digits
        raise BadLine("invalid_json", "holds an integer of more than 4,300 digits; no field takes one.") from None
    except RecursionError:  # a safety net: json_depth bounds nesting far below the recursion limit
        raise BadLine("nesting_too_deep", f"nests arrays and objects too deeply (limit {MAX_JSON_DEPTH}).") from None
    if not isinstance(obj, dict):
        raise BadLine(
            "not_an_object",
            f"is a JSON {_json_type(obj)}, not an object. Write one object per "
            'line, e.g. {"prompt": "Hello"}.',
        )
    return obj


class _NotJson(ValueError):
    pass


def _refuse_constant(name: str):
    raise _NotJson(f"{name} is not a JSON number (RFC 8259); write a finite number or a string.")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _NotJson(f"the number {text[:40]} is too large for a float; write a smaller number.")
    return value


def check_unicode(value, path: str = "") -> None:
    """Refuse a string holding a lone surrogate (valid JSON escapes, not valid Unicode), naming where."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadLine(
                "invalid_unicode",
                f"field {path[:120]} holds a lone surrogate {value[e.start]!r} at character {e.start} (an unpaired "
                "\\uD800-\\uDFFF escape, which is not a character). Pair it or remove it.",
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(key, f"{path}.<key>" if path else "<key>")
            check_unicode(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_unicode(item, f"{path}[{i}]")


def is_openai_line(obj: dict) -> bool:
    return any(k in obj for k in ("custom_id", "method", "url", "body"))


def line_kind(obj: dict) -> str:
    if not is_openai_line(obj):
        return NATIVE
    url = obj.get("url")
    if url not in OPENAI_URLS:
        raise BadLine("unsupported_url", f"url {_short(url)} is not supported; use one of {sorted(OPENAI_URLS)}.")
    return OPENAI_URLS[url]


def request_id_of(obj: dict, kind: str) -> str | None:
    key = "id" if kind == NATIVE else "custom_id"
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        raise BadLine("invalid_id", f"{key} must be a non-empty string or an integer, got {_short(value)}.")
    if isinstance(value, str):
        check_unicode(value, key)
        if len(value) > MAX_ID_CHARS:
            raise BadLine("invalid_id", f"{key} is {len(value):,} characters long; the limit is {MAX_ID_CHARS}.")
    elif value.bit_length() > 63:
        raise BadLine("invalid_id", f"{key} {_short(value)} is outside the 64-bit range; write it as a string.")
    return str(value)


def parse_request(number: int, obj: dict, kind: str, defaults: dict) -> BatchRequest:
    if kind == EMBEDDINGS:
        raise BadLine("unsupported_url", "url /v1/embeddings asks for embeddings, which `nanoinfer embed` makes; "
                      "`nanoinfer generate` answers /v1/chat/completions and /v1/completions.")
    if kind == NATIVE:
        return _parse_native(number, obj, defaults)
    return _parse_openai(number, obj, kind, defaults)


def _parse_native(number: int, obj: dict, defaults: dict) -> BatchRequest:
    _refuse_unknown(obj, _NATIVE_KEYS, "line")
    given = [k for k in _PROMPT_KEYS if k in obj]
    if not given:
        raise BadLine(
            "missing_prompt",
            'has no prompt: give one of "prompt" (text), "messages" (a chat) or "prompt_token_ids".',
        )
    if len(given) > 1:
        raise BadLine("invalid_prompt", f"gives {' and '.join(given)}; give exactly one of them.")
    request_id = request_id_of(obj, NATIVE) or f"line-{number}"
    fields = {k: obj[k] for k in _SAMPLING_KEYS if k in obj}
    _take_structured_outputs(obj, fields, ("structured_outputs", "response_format"))
    request = BatchRequest(number, request_id, NATIVE, make_params(defaults, fields), lora=_check_lora(obj.get("lora")))
    key = given[0]
    if key == "prompt":
        request.prompt = _check_text_prompt(obj[key], "prompt")
    elif key == "messages":
        request.messages = check_messages(obj[key])
    else:
        request.prompt_token_ids = _check_token_ids(obj[key])
    return request


def _parse_openai(number: int, obj: dict, kind: str, defaults: dict) -> BatchRequest:
    _refuse_unknown(obj, ("custom_id", "method", "url", "body"), "OpenAI batch line")
    custom_id = request_id_of(obj, kind)
    if custom_id is None:
        raise BadLine("missing_custom_id", "has no custom_id; the OpenAI batch format needs one per line.")
    if obj.get("method", "POST") != "POST":
        raise BadLine("unsupported_method", f"method {_short(obj['method'])} is not supported; use POST.")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise BadLine("invalid_body", f"body must be a JSON object, got {_json_type(body)}.")
    unsupported = [k for k in body if k in _OPENAI_UNSUPPORTED]
    if unsupported:
        raise BadLine("unsupported_parameter", f"body.{unsupported[0]} is not supported by nanoinfer.")
    _refuse_unknown(body, _OPENAI_KEYS[kind], "body")
    if body.get("stream"):
        raise BadLine("unsupported_parameter", "body.stream must be false: batch results are not streamed.")
    fields = {k: body[k] for k in _SAMPLING_KEYS if k in body and k not in ("logprobs",)}
    _take_structured_outputs(body, fields, ("structured_outputs", "response_format", *_GUIDED_KEYS), "body.")
    if kind == CHAT:
        if body.get("max_completion_tokens") is not None:
            fields["max_tokens"] = body["max_completion_tokens"]
        if body.get("logprobs"):
            fields["logprobs"] = body.get("top_logprobs") or 0
    else:
        if body.get("suffix") is not None:
            raise BadLine("unsupported_parameter", "body.suffix is not supported.")
        if body.get("best_of") not in (None, body.get("n", 1)):
            raise BadLine("unsupported_parameter", "body.best_of must equal n (or be left out).")
        if body.get("logprobs") is not None:
            fields["logprobs"] = body["logprobs"]
            if body.get("echo"):  # the prompt's logprobs too, in the same shape (OpenAI's scoring idiom)
                fields["prompt_logprobs"] = body["logprobs"]
    model = body.get("model")
    echo = body.get("echo", False)
    if kind == COMPLETIONS and not isinstance(echo, bool):
        raise BadLine("invalid_sampling_params", f"body.echo must be true or false, got {_short(echo)}.")
    request = BatchRequest(
        number,
        custom_id,
        kind,
        make_params(defaults, fields),
        model=model if isinstance(model, str) else None,
        echo=kind == COMPLETIONS and echo,
    )
    if kind == CHAT:
        if "messages" not in body:
            raise BadLine("missing_prompt", "body has no messages.")
        request.messages = check_messages(body["messages"])
        return request
    if "prompt" not in body:
        raise BadLine("missing_prompt", "body has no prompt.")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise BadLine(
                "unsupported_parameter",
                f"body.prompt holds {len(prompt)} prompts; nanoinfer takes "
                "one prompt per line. Split them into separate lines.",
            )
        prompt = prompt[0]
    if isinstance(prompt, list):
        request.prompt_token_ids = _check_token_ids(prompt)
    else:
        request.prompt = _check_text_prompt(prompt, "body.prompt")
    return request


def _take_structured_outputs(obj: dict, fields: dict, keys: tuple[str, ...], where: str = "") -> None:
    """The one structured-output request among `keys` -> fields["structured_outputs"] (None: explicitly none)."""
    given = [k for k in keys if k in obj and obj[k] is not None]
    if len(given) > 1:
        raise BadLine("invalid_structured_outputs", f"gives {' and '.join(where + k for k in given)}; give one of "
                      "them (each asks for a structured output).")
    if not given:
        return
    key, value = given[0], obj[given[0]]
    if key == "structured_outputs":
        fields[key] = value
    elif key == "response_format":
        fields["structured_outputs"] = _from_response_format(value, where + key)
    else:
        fields["structured_outputs"] = {_GUIDED_KEYS[key]: value}


def _from_response_format(value, where: str) -> dict | None:
    """OpenAI's response_format -> structured_outputs fields (json_schema, json_object; text: none)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise BadLine("invalid_structured_outputs", f'{where}.json_schema must be an object with a "schema" '
                          '(and optionally "name", "strict", "description").')
        return {"json": spec["schema"]}
    raise BadLine("invalid_structured_outputs", f'{where} must be {{"type": "json_schema", "json_schema": {{...}}}}, '
                  f'{{"type": "json_object"}} or {{"type": "text"}}, got {_short(value)}.')


def make_params(defaults: dict, fields: dict) -> SamplingParams:
    defaults = dict(defaults)
    any_whitespace = defaults.pop(ANY_WHITESPACE_DEFAULT, False)
    structured = fields.get("structured_outputs", defaults.get("structured_outputs"))
    if any_whitespace and isinstance(structured, dict) and "any_whitespace" not in structured:
        fields = {**fields, "structured_outputs": {**structured, "any_whitespace": True}}
    try:
        return SamplingParams(**{**defaults, **fields})
    except StructuredOutputError as e:
        raise BadLine("invalid_structured_outputs", f"{e}.") from None
    except RequestError as e:
        raise BadLine("invalid_sampling_params", f"{e}.") from None
    except TypeError as e:  # e.g. stop given as a number the constructor cannot iterate
        raise BadLine("invalid_sampling_params", f"invalid sampling parameters: {e}.") from None


def _refuse_unknown(obj: dict, allowed: tuple[str, ...], where: str) -> None:
    unknown = [k for k in obj if k not in allowed]
    if not unknown:
        return
    parts = []
    for key in unknown[:5]:  # a line with 100,000 unknown keys gets a message of five
        match = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
        parts.append(_short(key, 60) + (f" (did you mean {match[0]!r}?)" if match else ""))
    more = f" and {len(unknown) - 5:,} more" if len(unknown) > 5 else ""
    raise BadLine(
        "unknown_field",
        f"has unknown field(s) {', '.join(parts)}{more} in the {where}. Valid fields: {', '.join(allowed)}.",
    )


def _check_lora(value) -> str | None:
    """A native line's "lora": an adapter's name (null or left out: the base model). Whether the job has that adapter
    is the line runner's to say."""
    if value is not None and (not isinstance(value, str) or not value):
        raise BadLine("invalid_lora", f'lora must be the name of one of the job\'s LoRA adapters (a non-empty string, '
                      f'or null for the base model), got {_short(value)}.')
    return value


def _check_text_prompt(value, name: str) -> str:
    if not isinstance(value, str):
        raise BadLine("invalid_prompt", f"{name} must be a string, got {_json_type(value)}.")
    if not value:
        raise BadLine("empty_prompt", f"{name} is empty; give some text to continue.")
    return value


def _check_token_ids(value) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise BadLine("invalid_prompt", "prompt_token_ids must be a list of integers.")
    if not value:
        raise BadLine("empty_prompt", "prompt_token_ids is empty; give at least one token id.")
    return value


def check_messages(value) -> list[dict]:
    """A chat as a list of {"role", "content"}; OpenAI content parts of type text are joined into a string."""
    if not isinstance(value, list) or not value:
        raise BadLine(
            "empty_prompt" if value == [] else "invalid_prompt",
            'messages must be a non-empty list of {"role": ..., "content": ...} objects.',
        )
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadLine("invalid_prompt", f'messages[{i}] must be an object with a "role" string.')
        content = message.get("content")
        if isinstance(content, list):
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content
            ):
                raise BadLine(
                    "unsupported_parameter",
                    f"messages[{i}].content has non-text parts; only text is supported.",
                )
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadLine("invalid_prompt", f"messages[{i}].content must be a string.")
        messages.append({**message, "content": content})
    return messages


def _json_type(value) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


# ---- output records ---------------------------------------------------------------------------------------
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


def encode_record(record: dict) -> bytes:
    # ensure_ascii keeps every record one physical line whatever the text holds (U+2028 included).
    return (json.dumps(record, ensure_ascii=True, separators=(",", ":")) + "\n").encode("ascii")


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


def _openai_result(request: BatchRequest, output, decode: Callable[[int], str]) -> dict:
    created = int(time.time())
    usage = {k: output.usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    choices = []
    for c in output.outputs:
        choice: dict = {"index": c.index}
        if request.kind == CHAT:
            choice["message"] = {"role": "assistant", "content": c.text}
            choice["logprobs"] = _chat_logprobs(c.logprobs, decode) if c.logprobs is not None else None
        elif request.echo:
            prompt = output.prompt if output.prompt is not None else "".join(map(decode, output.prompt_token_ids))
            choice["text"] = prompt + c.text
            if c.logprobs is not None:
                prompt_logprobs = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
                choice["logprobs"] = _completion_logprobs(
                    [*prompt_logprobs, *c.logprobs], decode, [*output.prompt_token_ids, *c.token_ids]
                )
            else:
                choice["logprobs"] = None
        else:
            choice["text"] = c.text
            choice["logprobs"] = _completion_logprobs(c.logprobs, decode) if c.logprobs is not None else None
        choice["finish_reason"] = c.finish_reason
        choice["stop_reason"] = c.stop_reason  # vLLM's extra field: the stop string or token id that matched
        choices.append(choice)
    prefix, obj = ("chatcmpl", "chat.completion") if request.kind == CHAT else ("cmpl", "text_completion")
    body = {
        "id": f"{prefix}-line{request.line}",
        "object": obj,
        "created": created,
        # the adapter that ran, under the name body.model gave it (as vLLM answers), else what the line asked for
        "model": output.lora_request.lora_name if output.lora_request is not None else request.model or "nanoinfer",
        "choices": choices,
        "usage": usage,
    }
    return openai_batch_line(request.line, request.id, body)


def openai_batch_line(line: int, custom_id: str, body: dict) -> dict:
    """The OpenAI batch output line answering input line `line` with a 200 and `body`."""
    return {
        "id": f"batch_req_line{line}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": f"req_line{line}", "body": body},
        "error": None,
    }


def _openai_error(error: LineError) -> dict:
    body = {
        "error": {
            "message": error.message,
            "type": "invalid_request_error",
            "param": None,
            "code": error.code,
        }
    }
    return {
        "id": f"batch_req_line{error.line}",
        "custom_id": error.id,
        "response": {"status_code": 400, "request_id": f"req_line{error.line}", "body": body},
        "error": {"code": error.code, "message": error.message},
    }


def _token_entry(token_id: int, logprob: float, decode) -> dict:
    token = decode(token_id)
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def _chat_logprobs(logprobs, decode) -> dict:
    return {
        "content": [
            _token_entry(lp.token_id, lp.logprob, decode)
            | {"top_logprobs": [_token_entry(t, v, decode) for t, v in lp.top]}
            for lp in logprobs
        ]
    }


def _completion_logprobs(logprobs, decode, token_ids: list[int] | None = None) -> dict:
    """The legacy completions shape. With echo, `logprobs` starts with the prompt's (None for its first token, which
    has no logprob: token_logprobs and top_logprobs hold null there) and token_ids names every token."""
    token_ids = token_ids if token_ids is not None else [lp.token_id for lp in logprobs]
    tokens = [decode(t) for t in token_ids]
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob if lp is not None else None for lp in logprobs],
        "top_logprobs": [{decode(t): v for t, v in lp.top} if lp is not None else None for lp in logprobs],
        "text_offset": offsets,
    }


# ---- writing --------------------------------------------------------------------------------------------
class RecordWriter:
    """Appends records, each as one write() of a whole line, and fsyncs at least every `sync_seconds`.

    A record is in the kernel as soon as write() returns (no user-space buffer), so kill -9 loses nothing
    written; fsync covers power loss. On stdout there is nothing to fsync: each record is flushed.

    A failed write or fsync (disk full, I/O error, closed stdout) raises OutputWriteError once the file is
    cut back to its last whole record, so the output holds nothing torn; every later call is refused.
    """

    def __init__(self, path: Path | None, sync_seconds: float = 1.0, stdout: BinaryIO | None = None):
        self.path = path
        self.stdout = stdout
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path is not None else None
        self.sync_seconds = sync_seconds
        self.num_written = 0
        self.failure: OutputWriteError | None = None
        self._size = os.fstat(self.fd).st_size if self.fd is not None else 0  # bytes of whole records
        self._dirty = False
        self._last_sync = time.monotonic()

    def write(self, record: dict) -> None:
        if self.failure is not None:
            raise self.failure
        data = encode_record(record)
        try:
            if self.fd is None:
                self.stdout.write(data)
                self.stdout.flush()
            else:
                view = memoryview(data)
                while view:  # a regular file takes it in one go; loop only if the disk is short of space
                    view = view[os.write(self.fd, view) :]
                self._size += len(data)
                self._dirty = True
        except OSError as e:
            raise self._fail(e, "writing a record to") from None
        self.num_written += 1
        self.sync_if_due()

    def sync_if_due(self) -> None:
        if self._dirty and time.monotonic() - self._last_sync >= self.sync_seconds:
            self.sync()

    def sync(self) -> None:
        if self.failure is not None:
            raise self.failure
        if self.fd is not None and self._dirty:
            try:
                os.fsync(self.fd)
            except OSError as e:
                raise self._fail(e, "flushing records to") from None
        self._dirty = False
        self._last_sync = time.monotonic()

    def close(self) -> None:
        try:
            if self.failure is None:
                self.sync()
        finally:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None

    def _fail(self, e: OSError, doing: str) -> OutputWriteError:
        where = "stdout" if self.path is None else str(self.path)
        if self.fd is not None:
            with contextlib.suppress(OSError):  # cutting a file needs no free space
                os.ftruncate(self.fd, self._size)
                os.fsync(self.fd)
        closed = isinstance(e, BrokenPipeError) or e.errno == errno.EPIPE
        self.failure = OutputWriteError(
            f"{doing} {where} failed: {e.strerror or e} (errno {e.errno}).",
            errno=e.errno,
            closed_pipe=closed and self.path is None,
        )
        return self.failure


# ---- resume -----------------------------------------------------------------------------------------------
def manifest_path(output: Path) -> Path:
    return output.with_name(output.name + ".manifest.json")


@dataclass
class ResumeState:
    done_lines: set[int] = field(default_factory=set)
    num_cut_bytes: int = 0  # a torn last line (or an unreadable tail) removed from the output
    num_dropped_records: int = 0  # whole records after an unreadable line, dropped to be recomputed


def prepare_resume(output: Path) -> ResumeState:
    """Cut a torn or unreadable tail off `output` and return the input lines it already answers."""
    state = ResumeState()
    keep = 0  # bytes of whole, readable records
    with open(output, "rb") as f:
        for raw in f:
            line = record_line_number(_loads_or_none(raw) or {}) if raw.endswith(b"\n") else None
            if line is None:
                # A torn last line (a write cut short by a full disk or a machine crash) or garbage left
                # by power loss: keep only the records before it; the rest is recomputed.
                state.num_dropped_records = sum(1 for rest in f if rest.endswith(b"\n"))
                break
            state.done_lines.add(line)
            keep += len(raw)
        size = f.seek(0, os.SEEK_END)
    state.num_cut_bytes = size - keep
    if state.num_cut_bytes:
        with open(output, "r+b") as f:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
    return state


def _loads_or_none(raw: bytes) -> dict | None:
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def scan_input(path: Path) -> tuple[str, int]:
    """(sha256 of the file, number of non-blank lines), reading it once in fixed-size chunks (a line of any
    length costs no more memory than a chunk)."""
    digest = hashlib.sha256()
    num_lines, open_line_has_text, first = 0, False, True
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            digest.update(chunk)
            text = chunk[3:] if first and chunk.startswith(b"\xef\xbb\xbf") else chunk  # as iter_lines
            first = False
            *whole, rest = text.split(b"\n")
            for part in whole:
                num_lines += open_line_has_text or bool(part.strip())
                open_line_has_text = False
            open_line_has_text = open_line_has_text or bool(rest.strip())
    return digest.hexdigest(), num_lines + open_line_has_text


def model_fingerprint(model_dir: str) -> str:
    """sha256 over config.json and the names and sizes of the weight files (cheap, no weights read)."""
    root = Path(model_dir)
    digest = hashlib.sha256()
    config = root / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if path.suffix in (".safetensors", ".gguf", ".bin"):
            digest.update(f"{path.name}:{path.stat().st_size}\n".encode())
    return digest.hexdigest()


def adapter_fingerprint(adapter_dir: str) -> str:
    """sha256 over a PEFT adapter's adapter_config.json and weights, read whole: an adapter is small next to its
    model, and one retrained into the same folder has the same config and file sizes."""
    digest = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        digest.update(f"{name}\n".encode())
        with contextlib.suppress(OSError), open(Path(adapter_dir) / name, "rb") as f:
            while chunk := f.read(_READ_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def make_manifest(
    input_path: Path, input_sha256: str, num_lines: int, config, sampling_defaults: dict
) -> dict:
    return {
        "version": MANIFEST_VERSION,
        "input": {"path": str(input_path), "sha256": input_sha256, "num_lines": num_lines},
        "model": {"path": config.model, "fingerprint": model_fingerprint(config.model)},
        "result_fields": {name: getattr(config, name) for name in RESULT_FIELDS},
        # the job's adapters by the names lines select them with (a changed adapter changes its lines' results)
        "loras": {name: {"path": str(path), "fingerprint": adapter_fingerprint(path)}
                  for name, path in config.loras.items()},
        "sampling_defaults": sampling_defaults,
        "config": {
            k: v for k, v in config.to_dict().items() if isinstance(v, (int, float, str, bool, type(None)))
        },
    }


def write_manifest(path: Path, manifest: dict) -> None:
    """Atomically: write a temporary file, fsync it, rename it over the old one, fsync the folder."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BatchFileError(
            f"the resume manifest {path} cannot be read ({e}). Pass --overwrite to start the job over."
        ) from None
    if not isinstance(manifest, dict) or manifest.get("version") != MANIFEST_VERSION:
        raise BatchFileError(
            f"the resume manifest {path} was not written by this version of nanoinfer. "
            "Pass --overwrite to start the job over."
        )
    return manifest


def manifest_differences(old: dict, new: dict) -> list[str]:
    """What changed between the run that started the output and this one, in words."""
    problems = []
    if old.get("input", {}).get("sha256") != new["input"]["sha256"]:
        problems.append(
            f"the input changed: {new['input']['path']} is not the file the output was started "
            f"from ({old.get('input', {}).get('path')}, {old.get('input', {}).get('num_lines')} "
            "lines); its sha256 differs"
        )
    if old.get("model", {}).get("fingerprint") != new["model"]["fingerprint"]:
        problems.append(
            f"the model changed: the output was started with {old.get('model', {}).get('path')}, "
            f"this run uses {new['model']['path']} (config.json or weight files differ)"
        )
    for name in RESULT_FIELDS:
        before, now = old.get("result_fields", {}).get(name), new["result_fields"][name]
        if before != now:
            problems.append(
                f"{name} was {before!r} when the output was started and is {now!r} now "
                f"(pass --{name.replace('_', '-')} {before})"
            )
    old_loras = old.get("loras") or {}  # a manifest from before LoRA: none
    if not isinstance(old_loras, dict) or not all(isinstance(v, dict) for v in old_loras.values()):
        problems.append("the manifest's LoRA adapters are unreadable (edited by hand?): start over with --overwrite")
    else:
        problems += _lora_differences(old_loras, new["loras"])
    before, now = old.get("sampling_defaults"), new["sampling_defaults"]
    if before != now:
        problems.append(f"the sampling defaults changed: {before} then, {now} now")
    return problems


def _lora_differences(old: dict, new: dict) -> list[str]:
    """The adapters' changes, by name: a line naming an adapter (or an OpenAI line whose body.model does) would get
    another answer, or an error record, from another set. Their folders may move; their contents may not."""
    problems = []
    removed = [name for name in old if name not in new]
    if removed:
        flags = " ".join(f"--lora {name}={old[name].get('path')}" for name in removed)
        problems.append(f"LoRA adapter(s) {', '.join(removed)} were named when the output was started and are not "
                        f"now (pass {flags})")
    added = [name for name in new if name not in old]
    if added:
        problems.append(f"LoRA adapter(s) {', '.join(added)} are named now but were not when the output was started "
                        "(leave them out)")
    for name in new:
        if name in old and old[name].get("fingerprint") != new[name]["fingerprint"]:
            problems.append(f"LoRA adapter {name} changed: the output was started with {old[name].get('path')}, this "
                            f"run uses {new[name]['path']} (adapter_config.json or its weights differ)")
    return problems
