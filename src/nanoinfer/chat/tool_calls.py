"""Tool-call parsers: a chat answer's content into OpenAI's `message.tool_calls` (vLLM's parser names).

- "hermes": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or more (Qwen2.5, Qwen3, Hermes, SmolLM3);
- "llama3_json": the whole answer a JSON object `{"name": ..., "parameters": {...}}` (or several joined by `;`),
  after an optional `<|python_tag|>` (Llama 3.1-3.3);
- "mistral": `[TOOL_CALLS]` then a JSON list of calls, or (newer tokenizers) `name[ARGS]{...}` calls one after another;
- "harmony": gpt-oss's messages to `functions.NAME` (`<|channel|>commentary to=functions.NAME <|constrain|>json
  <|message|>{...}<|call|>`), their bodies the arguments. They live beside the analysis and final channels, not in
  the content split off them, so this parser reads the RAW output (special tokens kept) and returns the content as
  reasoning.split_reasoning("harmony") gives it, less the call messages.
`tool_choice` "required" or a named function holds decoding to tool_call_schema instead, whatever the family: a JSON
list of `{"name", "parameters"}` objects, or the one function's arguments (parse_constrained_calls reads them).

A parser returns the calls and the content left beside them. All or nothing: when any call is not a valid one (cut
off, malformed JSON, no "arguments" / "parameters" key: models write `{}` for a function without any, or a call to a
function the line's tools do not list), the answer has no call and stays content as written ("auto" falls back to it).
Arguments come out as a JSON string, as OpenAI sends them.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Collection
from dataclasses import dataclass

from nanoinfer.chat.reasoning import (
    HARMONY_CHANNEL,
    HARMONY_MESSAGE,
    HarmonyMessage,
    harmony_content,
    harmony_messages,
)

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "harmony")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text

    def to_openai(self, call_id: str) -> dict:
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_id(seed: str, index: int) -> str:
    """An OpenAI-shaped call id, the same on every run of the same line (resume gives the same records)."""
    return "call_" + hashlib.sha256(f"{seed}:{index}".encode()).hexdigest()[:24]


def select_tool_call_parser(vocab: dict[str, int], chat_template: str | None) -> str | None:
    """The parser a model's tokenizer and template call for, or None (a template without tools)."""
    template = chat_template or ""
    if HARMONY_CHANNEL in vocab and HARMONY_MESSAGE in vocab:  # gpt-oss (its template mentions none of the others)
        return "harmony"
    if "<tool_call>" in vocab or "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in vocab:
        return "mistral"
    if "<|python_tag|>" in vocab or "<|python_tag|>" in template:
        return "llama3_json"
    return None


def parse_tool_calls(parser: str, text: str, names: Collection[str] | None = None) -> tuple[list[ToolCall], str | None]:
    """(calls, the content beside them: None when there is none) of an answer's text: the content after the reasoning
    was split off, except for "harmony", which takes the raw output (the module's docstring says why). names: the
    functions the line's tools list; a call to any other makes the answer one without calls (None: any name)."""
    if parser == "harmony":
        return _parse_harmony(text, names)
    if parser == "hermes":
        calls, content = _parse_hermes(text)
    elif parser == "llama3_json":
        calls, content = _parse_llama3_json(text)
    elif parser == "mistral":
        calls, content = _parse_mistral(text)
    else:
        raise ValueError(f"unknown tool-call parser {parser!r}")
    if names is not None and any(call.name not in names for call in calls):
        return [], text
    return calls, content


def _call(obj, argument_keys=("arguments", "parameters")) -> ToolCall | None:
    """A {"name", "arguments" | "parameters"} object as a call, or None when it is not one (no arguments key
    included: `{"name": "Bob", "age": 3}` is data, not a call)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((key for key in argument_keys if key in obj), None)
    if key is None:
        return None
    arguments = obj[key]
    if isinstance(arguments, str):  # some models write the arguments as a JSON string already
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _parse_hermes(text: str) -> tuple[list[ToolCall], str | None]:
    start = text.find("<tool_call>")
    if start < 0:
        return [], text
    calls = [_call(_loads(body)) for body in _HERMES.findall(text[start:])]
    if not calls or None in calls:
        return [], text  # a malformed or cut-off call: the answer stays as written
    return calls, text[:start].strip() or None


def _parse_llama3_json(text: str) -> tuple[list[ToolCall], str | None]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return [], text
    calls = [_call(_loads(part)) for part in _split_top_level(body, ";")]
    if not calls or None in calls:
        return [], text
    return calls, None


def _parse_mistral(text: str) -> tuple[list[ToolCall], str | None]:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return [], text
    content, body = text[:start].strip() or None, text[start + len("[TOOL_CALLS]") :].strip()
    listed = _loads(body)
    if isinstance(listed, list):  # [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
        calls = [_call(item) for item in listed]
    elif isinstance(listed, dict):
        calls = [_call(listed)]
    else:  # name[ARGS]{...}, possibly more, each after its own [TOOL_CALLS]
        calls = []
        for part in body.split("[TOOL_CALLS]"):
            name, sep, arguments = part.partition("[ARGS]")
            if not sep:
                name, arguments = _split_name(part)
            calls.append(_call({"name": name.strip(), "arguments": _loads(arguments.strip())}))
    if not calls or None in calls:
        return [], text
    return calls, content


def _parse_harmony(text: str, names: Collection[str] | None) -> tuple[list[ToolCall], str | None]:
    messages = harmony_messages(text)
    requests = [message for message in messages if message.recipient is not None]
    calls = [_harmony_call(message, names) for message in requests]
    if not calls or None in calls:  # the messages to tools stay in the content, as written
        return [], harmony_content(messages, text)
    return calls, harmony_content(messages, text, keep_calls=False)


def _harmony_call(message: HarmonyMessage, names: Collection[str] | None) -> ToolCall | None:
    """A message to `functions.NAME` with a JSON object body as a call (None for another recipient: a built-in tool
    such as `python` or `browser.search`, which nanoinfer does not run)."""
    namespace, _, name = message.recipient.partition(".")
    if namespace != "functions" or (names is not None and name not in names):
        return None
    return _call({"name": name, "arguments": _loads(message.body.strip())})


def _split_name(part: str) -> tuple[str, str]:
    brace = part.find("{")
    return (part[:brace], part[brace:]) if brace > 0 else (part, "")


def _split_top_level(text: str, separator: str) -> list[str]:
    """`text` cut at `separator` outside JSON strings and brackets."""
    parts, depth, quoted, escaped, start = [], 0, False, False, 0
    for i, char in enumerate(text):
        if quoted:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                quoted = False
            continue
        if char == '"':
            quoted = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
        elif char == separator and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [part.strip() for part in parts if part.strip()]


# ---- tool_choice "required" or a named function: decoding constrained to a valid call ----------------------------


def tool_call_schema(tools: list[dict], tool_choice, parallel_tool_calls: bool = True) -> dict:
    """The JSON schema decoding is held to: a named function's arguments (its parameters schema), or for "required"
    a non-empty list of calls (one, without parallel_tool_calls), each one of the tools with arguments of its schema
    (vLLM's shapes)."""
    functions = {tool["function"]["name"]: tool["function"] for tool in tools}
    if isinstance(tool_choice, dict):
        return _parameters(functions[tool_choice["function"]["name"]])
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                               "parameters": _parameters(function)},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, function in functions.items()]  # fmt: skip
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    return schema if parallel_tool_calls else {**schema, "maxItems": 1}


def check_tools(tools, tool_choice) -> str | None:
    """What is wrong with a chat line's `tools` and `tool_choice` (OpenAI's shapes), or None."""
    if not isinstance(tools, list) or not tools:
        return "tools must be a non-empty list of {\"type\": \"function\", \"function\": {\"name\", \"parameters\"}}."
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            return f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}."
        if not isinstance(function.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", function["name"]):
            return f"tools[{i}].function.name must be 1-64 letters, digits, _ . or - (OpenAI's rule)."
        parameters = function.get("parameters", {})
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            return f"tools[{i}].function.parameters must be a JSON schema of an object."
        names.append(function["name"])
    if len(set(names)) != len(names):
        return "tools name a function twice: give each its own name."
    if tool_choice is None or tool_choice in ("none", "auto"):
        return None
    name = None  # "required": any of the functions
    if tool_choice != "required":
        function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
            return 'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}.'
        if name not in names:
            return f"tool_choice names function {name!r}, which tools do not list ({', '.join(names)})."
    # Decoding will be held to these schemas: one xgrammar refuses would fail the request later, on the engine.
    for i, tool in enumerate(tools):
        if tool_choice == "required" or tool["function"]["name"] == name:
            if (problem := _schema_problem(_parameters(tool["function"]))) is not None:
                return f"tools[{i}].function.parameters is not a JSON schema xgrammar can compile: {problem}"
    return None


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


_XGRAMMAR_PREFIX = re.compile(r"^(\[[^\]]*\]\s*)?(\S+\.(cc|h|cpp):\d+:\s*)?")  # "[time] /project/cpp/file.cc:123: "


def _schema_problem(schema: dict) -> str | None:
    """Why xgrammar cannot compile `schema` (the first line of its error), or None."""
    import xgrammar  # heavy: only lines that hold decoding to a call pay for it

    try:
        xgrammar.Grammar.from_json_schema(json.dumps(schema))
    except RuntimeError as e:  # xgrammar 0.2's C++ errors (unsupported type, bad $ref, bad pattern, ...)
        lines = str(e).strip().splitlines()
        return _XGRAMMAR_PREFIX.sub("", lines[0]) if lines else type(e).__name__
    return None


def parse_constrained_calls(text: str, tool_choice) -> list[ToolCall]:
    """The calls of an answer decoded under tool_call_schema (empty when it was cut off before the JSON closed)."""
    value = _loads(text)
    if isinstance(tool_choice, dict):
        return [ToolCall(tool_choice["function"]["name"], json.dumps(value, ensure_ascii=False))] \
            if isinstance(value, dict) else []
    if not isinstance(value, list):
        return []
    calls = [_call(item, ("parameters",)) if isinstance(item, dict) and "parameters" in item else None
             for item in value]  # fmt: skip
    return [] if None in calls else calls
