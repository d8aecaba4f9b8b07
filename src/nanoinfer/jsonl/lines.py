"""One JSONL line's checks before its fields mean anything: bounded JSON decoding (nesting depth, finite numbers,
valid Unicode), its id and unknown fields; BadLine and LineError say what was wrong. What the fields mean is
requests.py's (native lines) and openai.py's (OpenAI batch lines).
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass

import numpy as np

from nanoinfer.errors import short_repr as _short

# JSON nesting is bounded so that parsing cannot recurse without bound (README "Limits"; an OpenAI chat body
# with a nested JSON schema needs about 20 levels).
MAX_JSON_DEPTH = 64
MAX_ID_CHARS = 1024  # ids are kept in memory for the whole job to catch duplicates

NATIVE, CHAT, COMPLETIONS, EMBEDDINGS = "native", "chat", "completions", "embeddings"


class BadLine(Exception):
    """A line that cannot become a request: `code` for scripts, `message` for people."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class LineError:
    """A line that got an error record instead of a request."""

    line: int
    id: str | None
    kind: str
    code: str
    message: str


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


def _json_type(value) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")
