"""Every OpenAI batch shape in one place: the line envelope (custom_id, method, url), chat and completions bodies ->
BatchRequest, their response bodies and logprobs, the batch output and error lines, and /v1/embeddings' inputs,
encodings and response body. Native lines and records are requests.py's, records.py's and embed.py's.
"""

from __future__ import annotations

import base64
import re
import time
from collections.abc import Callable

import numpy as np

from nanoinfer.errors import short_repr as _short
from nanoinfer.jsonl.lines import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    NATIVE,
    BadLine,
    LineError,
    _json_type,
    _refuse_unknown,
    request_id_of,
)
from nanoinfer.jsonl.requests import (
    _CHAT_KEYS,
    _GUIDED_KEYS,
    _SAMPLING_KEYS,
    BatchRequest,
    _check_text_prompt,
    _check_token_ids,
    _take_structured_outputs,
    check_messages,
    make_params,
    take_chat_options,
)

# /v1/embeddings lines are `nanoinfer embed`'s (embed.py parses them); generate answers them with an error.
OPENAI_URLS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETIONS, "/v1/embeddings": EMBEDDINGS}

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
    CHAT: (*_OPENAI_COMMON, "messages", "max_completion_tokens", "logprobs", "top_logprobs", *_CHAT_KEYS,
           "max_reasoning_tokens"),
    COMPLETIONS: (*_OPENAI_COMMON, "prompt", "logprobs", "echo", "suffix", "best_of"),
    # "normalize" is vLLM's extra field; "user" is accepted and ignored, as by vLLM.
    EMBEDDINGS: ("model", "input", "encoding_format", "dimensions", "user", "normalize"),
}
_OPENAI_UNSUPPORTED = (
    "functions",
    "function_call",
    "logit_bias",
    "audio",
    "modalities",
    "prediction",
    "reasoning_effort",
    "web_search_options",
)
_OPENAI_ID = re.compile(r"^batch_req_line(\d+)$")

ENCODING_FORMATS = ("float", "base64")  # OpenAI's encoding_format
MAX_INPUTS_PER_LINE = 2048  # OpenAI's limit on the inputs of one /v1/embeddings request


# ---- the line envelope: which endpoint, which custom_id ---------------------------------------------------
def is_openai_line(obj: dict) -> bool:
    return any(k in obj for k in ("custom_id", "method", "url", "body"))


def line_kind(obj: dict) -> str:
    if not is_openai_line(obj):
        return NATIVE
    url = obj.get("url")
    if url not in OPENAI_URLS:
        raise BadLine("unsupported_url", f"url {_short(url)} is not supported; use one of {sorted(OPENAI_URLS)}.")
    return OPENAI_URLS[url]


def _openai_id(obj: dict) -> str:
    _refuse_unknown(obj, ("custom_id", "method", "url", "body"), "OpenAI batch line")
    custom_id = request_id_of(obj, EMBEDDINGS)
    if custom_id is None:
        raise BadLine("missing_custom_id", "has no custom_id; the OpenAI batch format needs one per line.")
    if obj.get("method", "POST") != "POST":
        raise BadLine("unsupported_method", f"method {_short(obj['method'])} is not supported; use POST.")
    return custom_id


# ---- /v1/chat/completions and /v1/completions -------------------------------------------------------------
def _parse_openai(number: int, obj: dict, kind: str, defaults: dict) -> BatchRequest:
    custom_id = _openai_id(obj)
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
    chat = take_chat_options(body, fields, defaults, "body.") if kind == CHAT else {}
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
        **chat,
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


def _openai_result(request: BatchRequest, output, decode: Callable[[int], str], answers: list | None = None) -> dict:
    """The batch output line of a finished completions or chat line (a chat line's `answers`: chat/answer.ChatAnswer
    for each completion, what its message says)."""
    created = int(time.time())
    usage = {k: output.usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    choices = []
    for i, c in enumerate(output.outputs):
        choice: dict = {"index": c.index}
        finish_reason = c.finish_reason
        if request.kind == CHAT:  # content, and reasoning_content / tool_calls (vLLM's shape)
            answer = answers[i]
            choice["message"] = {"role": "assistant", "content": answer.content}
            if answer.reasoning_content is not None:
                choice["message"]["reasoning_content"] = answer.reasoning_content
            if answer.tool_calls:
                choice["message"]["tool_calls"] = answer.tool_calls
            finish_reason = answer.finish_reason
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
        choice["finish_reason"] = finish_reason
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


# ---- /v1/embeddings ---------------------------------------------------------------------------------------
def _check_inputs(value, where: str, several: bool) -> list[str | list[int]]:
    """OpenAI's input forms: a text, token ids, or (several=True) a list of texts or of token-id lists."""
    if isinstance(value, str):
        return [_check_text(value, where)]
    if not isinstance(value, list) or not value:
        what = "is empty" if value == [] else f"is a JSON {_json_type(value)}"
        raise BadLine("empty_prompt" if value == [] else "invalid_input",
                      f"{where} {what}; give a text or a list of token ids.")
    if all(_is_int(t) for t in value):
        return [value]
    if not all(isinstance(v, (str, list)) for v in value):
        raise BadLine("invalid_input", f"{where} must be a text, a list of token ids, or a list of texts; it mixes "
                      "other values in.")
    if not several:
        raise BadLine("invalid_input", f"{where} holds {len(value)} inputs; a native line embeds one. Give each its "
                      "own line, or use OpenAI batch lines (url /v1/embeddings), which take a list.")
    if len(value) > MAX_INPUTS_PER_LINE:
        raise BadLine("too_many_inputs", f"{where} holds {len(value):,} inputs; the limit is {MAX_INPUTS_PER_LINE:,} "
                      "a line (as OpenAI's). Split it over several lines.")
    inputs = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            inputs.append(_check_text(item, f"{where}[{i}]"))
        elif item and all(_is_int(t) for t in item):
            inputs.append(item)
        else:
            raise BadLine("empty_prompt" if item == [] else "invalid_input",
                          f"{where}[{i}] must be a non-empty text or list of token ids.")
    return inputs


def _check_text(value: str, where: str) -> str:
    if not value:
        raise BadLine("empty_prompt", f"{where} is an empty text; give some text to embed.")
    return value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    """float: each value as the shortest decimal that reads back as the same float32 (about half the digits of a
    double's, and exact); base64: the little-endian float32 bytes, as OpenAI's API sends them."""
    array = np.asarray(vector, dtype="<f4")
    if encoding_format == "base64":
        return base64.b64encode(array.tobytes()).decode("ascii")
    return [float(text) for text in array.astype(str)]


def _openai_embedding_result(request, outputs: list, usage: dict) -> dict:
    """The OpenAI batch line of an embeddings line whose inputs were all embedded (outputs in input order)."""
    data = [
        {"object": "embedding", "index": i, "embedding": encode_embedding(o.outputs.embedding, request.encoding_format)}
        for i, o in enumerate(outputs)
    ]
    body = {
        "object": "list",
        "data": data,
        "model": request.model or "nanoinfer",
        "usage": {"prompt_tokens": usage["prompt_tokens"], "total_tokens": usage["total_tokens"]},
    }
    return openai_batch_line(request.line, request.id, body)
