"""JSONL lines and records of `nanoinfer embed`: input lines -> EmbedRequests, embeddings -> records.

Native lines ({"input"}) and OpenAI batch lines for /v1/embeddings; records in the matching format. Reading lines
from a file, resume and writing records are `batch.py`'s (BatchReader takes `parse_embedding`); running the
requests is `jobs/embed_runner.py`'s.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np

from nanoinfer import batch
from nanoinfer.batch import EMBEDDINGS, NATIVE, BadLine, LineError
from nanoinfer.errors import RequestError
from nanoinfer.pooling import PoolingParams

ENCODING_FORMATS = ("float", "base64")  # OpenAI's encoding_format
MAX_INPUTS_PER_LINE = 2048  # OpenAI's limit on the inputs of one /v1/embeddings request
_NATIVE_KEYS = ("id", "input", "dimensions", "normalize", "encoding_format")
# "normalize" is vLLM's extra field; "user" is accepted and ignored, as by vLLM.
_OPENAI_KEYS = ("model", "input", "encoding_format", "dimensions", "user", "normalize")


@dataclass
class EmbedRequest:
    """One parsed line: its inputs (a text or token ids each; several only on an OpenAI line) and how to embed them."""

    line: int
    id: str
    kind: str  # native or embeddings (OpenAI)
    params: PoolingParams
    inputs: list[str | list[int]]
    encoding_format: str = "float"
    model: str | None = None  # OpenAI body's "model", echoed in the response

    @property
    def is_openai(self) -> bool:
        return self.kind != NATIVE


def parse_embedding(number: int, obj: dict, kind: str, defaults: dict) -> EmbedRequest:
    """A decoded line -> EmbedRequest, or BadLine. `defaults`: the job's "dimensions" and "encoding_format"."""
    if kind == NATIVE:
        if "input" not in obj and any(k in obj for k in ("prompt", "messages", "prompt_token_ids")):
            raise BadLine("missing_input", 'gives a generation prompt; an embed line gives its text (or token ids) '
                          'as "input", e.g. {"id": "a", "input": "some text"}.')
        batch._refuse_unknown(obj, _NATIVE_KEYS, "line")
        fields, where = obj, ""
        request_id = batch.request_id_of(obj, NATIVE) or f"line-{number}"
    elif kind == EMBEDDINGS:
        request_id = _openai_id(obj)
        body = obj.get("body")
        if not isinstance(body, dict):
            raise BadLine("invalid_body", f"body must be a JSON object, got {batch._json_type(body)}.")
        batch._refuse_unknown(body, _OPENAI_KEYS, "body")
        fields, where = body, "body."
    else:
        raise BadLine("unsupported_url", f"url {obj.get('url')} asks for generated text, which `nanoinfer generate` "
                      "makes; `nanoinfer embed` answers /v1/embeddings.")
    if "input" not in fields:
        raise BadLine("missing_input", f'{where or "the line "}has no "input": give a text or a list of token ids.')
    inputs = _check_inputs(fields["input"], f"{where}input", several=kind == EMBEDDINGS)
    encoding_format = fields.get("encoding_format") or defaults.get("encoding_format", "float")
    if encoding_format not in ENCODING_FORMATS:
        raise BadLine("invalid_encoding_format", f"{where}encoding_format must be one of {', '.join(ENCODING_FORMATS)}"
                      f", got {batch._short(encoding_format)}.")
    dimensions = fields.get("dimensions", defaults.get("dimensions"))
    try:
        params = PoolingParams(normalize=fields.get("normalize"), dimensions=dimensions)
    except RequestError as e:
        raise BadLine(e.code, f"{e}.") from None
    model = fields.get("model")
    return EmbedRequest(number, request_id, kind, params, inputs, encoding_format,
                        model if isinstance(model, str) else None)


def _openai_id(obj: dict) -> str:
    batch._refuse_unknown(obj, ("custom_id", "method", "url", "body"), "OpenAI batch line")
    custom_id = batch.request_id_of(obj, EMBEDDINGS)
    if custom_id is None:
        raise BadLine("missing_custom_id", "has no custom_id; the OpenAI batch format needs one per line.")
    if obj.get("method", "POST") != "POST":
        raise BadLine("unsupported_method", f"method {batch._short(obj['method'])} is not supported; use POST.")
    return custom_id


def _check_inputs(value, where: str, several: bool) -> list[str | list[int]]:
    """OpenAI's input forms: a text, token ids, or (several=True) a list of texts or of token-id lists."""
    if isinstance(value, str):
        return [_check_text(value, where)]
    if not isinstance(value, list) or not value:
        what = "is empty" if value == [] else f"is a JSON {batch._json_type(value)}"
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


# ---- records ------------------------------------------------------------------------------------------------
def encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    """float: each value as the shortest decimal that reads back as the same float32 (about half the digits of a
    double's, and exact); base64: the little-endian float32 bytes, as OpenAI's API sends them."""
    array = np.asarray(vector, dtype="<f4")
    if encoding_format == "base64":
        return base64.b64encode(array.tobytes()).decode("ascii")
    return [float(text) for text in array.astype(str)]


def sum_usage(outputs) -> dict:
    keys = ("prompt_tokens", "completion_tokens", "total_tokens", "cached_prompt_tokens")
    return {k: sum(output.usage[k] for output in outputs) for k in keys}


def embedding_record(request: EmbedRequest, outputs: list) -> dict:
    """The record of a line whose inputs were all embedded (outputs: EmbeddingRequestOutputs, in input order)."""
    usage = sum_usage(outputs)
    if not request.is_openai:
        embedding = encode_embedding(outputs[0].outputs.embedding, request.encoding_format)
        return {"id": request.id, "line": request.line, "embedding": embedding, "usage": usage, "error": None}
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
    return batch.openai_batch_line(request.line, request.id, body)


def embedding_error_record(error: LineError) -> dict:
    """generate's error record (OpenAI lines: the same batch error line), with "embedding" where it has "text"."""
    if error.kind != NATIVE:
        return batch.error_record(error)
    return {"id": error.id, "line": error.line, "embedding": None, "usage": None,
            "error": {"code": error.code, "message": error.message}}
