"""Native lines -> BatchRequest, and the field checks that OpenAI bodies share with them: prompts, chat messages,
structured-output requests, sampling parameters (make_params). The OpenAI envelope and bodies are openai.py's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from nanoinfer.chat.tool_calls import check_tools, tool_call_schema
from nanoinfer.errors import RequestError, StructuredOutputError
from nanoinfer.errors import short_repr as _short
from nanoinfer.jsonl.lines import NATIVE, BadLine, _json_type, _refuse_unknown, request_id_of
from nanoinfer.sampling_params import SamplingParams
from nanoinfer.tokenizer import template_kwargs_problem

# Used when neither the line nor the command gives max_tokens (SamplingParams' own default, 16, is a
# library default for quick calls; a batch job usually wants whole answers).
DEFAULT_MAX_TOKENS = 256

_PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")
_SAMPLING_KEYS = tuple(SamplingParams.field_names())
# Ways to ask for structured output besides "structured_outputs": OpenAI's, and vLLM's older extra fields.
_GUIDED_KEYS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# A chat line's own keys (OpenAI's, and vLLM's chat_template_kwargs)
_CHAT_KEYS = ("tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs")
_NATIVE_KEYS = ("id", *_PROMPT_KEYS, *_SAMPLING_KEYS, "response_format", "lora", *_CHAT_KEYS)
ANY_WHITESPACE_DEFAULT = "json_any_whitespace"  # a sampling default of the job (--json-any-whitespace)
CHAT_TEMPLATE_KWARGS_DEFAULT = "chat_template_kwargs"  # a default of the job (--chat-template-kwargs)


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
    # A chat line's OpenAI tools and tool_choice, and the chat template's options (the job's, then the line's)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    chat_template_kwargs: dict | None = None
    # the rendered prompt ends inside <think> / after a closed one (set when the line is admitted)
    prompt_opens_thinking: bool = False
    prompt_closes_thinking: bool = False

    @property
    def is_openai(self) -> bool:
        return self.kind != NATIVE


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
    if given[0] != "messages" and any(k in obj for k in _CHAT_KEYS):
        raise BadLine("invalid_prompt", f"gives {next(k for k in _CHAT_KEYS if k in obj)}, which applies to "
                      '"messages" (a chat) only.')
    chat = take_chat_options(obj, fields, defaults, "")
    request = BatchRequest(number, request_id, NATIVE, make_params(defaults, fields), lora=_check_lora(obj.get("lora")),
                           **chat)  # fmt: skip
    key = given[0]
    if key == "prompt":
        request.prompt = _check_text_prompt(obj[key], "prompt")
    elif key == "messages":
        request.messages = check_messages(obj[key])
    else:
        request.prompt_token_ids = _check_token_ids(obj[key])
    return request


def take_chat_options(obj: dict, fields: dict, defaults: dict, where: str) -> dict:
    """A chat line's tools, tool_choice and chat_template_kwargs, checked, as BatchRequest fields; tool_choice
    "required" or a named function becomes the JSON schema decoding is held to (chat/tool_calls.py)."""
    kwargs = obj.get("chat_template_kwargs")
    if kwargs is not None and (problem := template_kwargs_problem(kwargs)) is not None:
        raise BadLine("invalid_chat_template_kwargs", f"{where}chat_template_kwargs {problem}")
    tools, tool_choice = obj.get("tools"), obj.get("tool_choice")
    if tools is None and tool_choice not in (None, "none", "auto"):
        raise BadLine("invalid_tools", f"{where}tool_choice {_short(tool_choice)} needs {where}tools.")
    if tools is not None and (problem := check_tools(tools, tool_choice)) is not None:
        raise BadLine("invalid_tools", f"{where}{problem}")
    parallel = obj.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise BadLine("invalid_tools", f"{where}parallel_tool_calls must be true or false.")
    if tools is not None and (tool_choice == "required" or isinstance(tool_choice, dict)):
        if fields.get("structured_outputs") is not None:
            raise BadLine("invalid_tools", f"{where}tool_choice {_short(tool_choice)} holds the answer to a tool "
                          "call: it cannot also take a structured output (response_format).")  # fmt: skip
        fields["structured_outputs"] = {"json": tool_call_schema(tools, tool_choice, parallel)}
    template_kwargs = {**defaults.get(CHAT_TEMPLATE_KWARGS_DEFAULT, {}), **(kwargs or {})}
    return {"tools": tools, "tool_choice": tool_choice if tools is not None else None,
            "chat_template_kwargs": template_kwargs or None}  # fmt: skip


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
    defaults.pop(CHAT_TEMPLATE_KWARGS_DEFAULT, None)  # the chat template's, not a sampling parameter
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
        if content is None and message.get("tool_calls"):  # an assistant turn that only called tools
            content = ""
        if not isinstance(content, str):
            raise BadLine("invalid_prompt", f"messages[{i}].content must be a string.")
        messages.append({**message, "content": content, **_template_tool_calls(message, i)})
    return messages


def _template_tool_calls(message: dict, i: int) -> dict:
    """An assistant turn's OpenAI tool_calls with their arguments as objects, as chat templates read them (OpenAI
    sends them as JSON strings); {} without tool calls."""
    calls = message.get("tool_calls")
    if calls is None:
        return {}
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                              for c in calls):  # fmt: skip
        raise BadLine("invalid_prompt", f'messages[{i}].tool_calls must be a list of {{"function": {{"name", '
                      '"arguments"}}} objects.')  # fmt: skip
    converted = []
    for call in calls:
        function = dict(call["function"])
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                raise BadLine("invalid_prompt", f"messages[{i}].tool_calls: arguments are not JSON.") from None
        converted.append({**call, "function": function})
    return {"tool_calls": converted}
