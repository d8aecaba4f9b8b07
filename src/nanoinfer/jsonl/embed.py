"""JSONL lines and records of `nanoinfer embed`: input lines -> EmbedRequests, embeddings -> records.

Native lines ({"input"}) here, OpenAI /v1/embeddings shapes in openai.py. Reading lines, writing records and resume
are reader.py's (BatchReader takes `parse_embedding`), writer.py's and manifest.py's; running the requests is
`jobs/embed_runner.py`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoinfer.errors import RequestError
from nanoinfer.errors import short_repr as _short
from nanoinfer.jsonl.lines import EMBEDDINGS, NATIVE, BadLine, LineError, _json_type, _refuse_unknown, request_id_of
from nanoinfer.jsonl.openai import (
    _OPENAI_KEYS,
    ENCODING_FORMATS,
    _check_inputs,
    _openai_embedding_result,
    _openai_id,
    encode_embedding,
)
from nanoinfer.jsonl.records import error_record
from nanoinfer.pooling import PoolingParams

_NATIVE_KEYS = ("id", "input", "dimensions", "normalize", "encoding_format")


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
        _refuse_unknown(obj, _NATIVE_KEYS, "line")
        fields, where = obj, ""
        request_id = request_id_of(obj, NATIVE) or f"line-{number}"
    elif kind == EMBEDDINGS:
        request_id = _openai_id(obj)
        body = obj.get("body")
        if not isinstance(body, dict):
            raise BadLine("invalid_body", f"body must be a JSON object, got {_json_type(body)}.")
        _refuse_unknown(body, _OPENAI_KEYS[EMBEDDINGS], "body")
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
                      f", got {_short(encoding_format)}.")
    dimensions = fields.get("dimensions", defaults.get("dimensions"))
    try:
        params = PoolingParams(normalize=fields.get("normalize"), dimensions=dimensions)
    except RequestError as e:
        raise BadLine(e.code, f"{e}.") from None
    model = fields.get("model")
    return EmbedRequest(number, request_id, kind, params, inputs, encoding_format,
                        model if isinstance(model, str) else None)


def sum_usage(outputs) -> dict:
    keys = ("prompt_tokens", "completion_tokens", "total_tokens", "cached_prompt_tokens")
    return {k: sum(output.usage[k] for output in outputs) for k in keys}


def embedding_record(request: EmbedRequest, outputs: list) -> dict:
    """The record of a line whose inputs were all embedded (outputs: EmbeddingRequestOutputs, in input order)."""
    usage = sum_usage(outputs)
    if not request.is_openai:
        embedding = encode_embedding(outputs[0].outputs.embedding, request.encoding_format)
        return {"id": request.id, "line": request.line, "embedding": embedding, "usage": usage, "error": None}
    return _openai_embedding_result(request, outputs, usage)


def embedding_error_record(error: LineError) -> dict:
    """generate's error record (OpenAI lines: the same batch error line), with "embedding" where it has "text"."""
    if error.kind != NATIVE:
        return error_record(error)
    return {"id": error.id, "line": error.line, "embedding": None, "usage": None,
            "error": {"code": error.code, "message": error.message}}
