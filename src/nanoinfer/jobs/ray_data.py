"""NanoinferPredictor: nanoinfer as a Ray Data `map_batches` class, for pipelines already on Ray.

A row holds the fields of a `nanoinfer generate` input line and comes back holding the fields of its output
record; a bad row comes back as an error record, never as an exception. Parsing and records are
`nanoinfer.jsonl`'s, the engine loop is `LineRunner`'s. Nothing here imports Ray: Ray Data builds the class.
"""

from __future__ import annotations

import json
import math

import numpy as np

from nanoinfer.jobs.line_runner import FinishedLine, LineRunner
from nanoinfer.jsonl.lines import NATIVE, BadLine, LineError
from nanoinfer.jsonl.reader import MAX_LINE_BYTES, BatchReader
from nanoinfer.jsonl.records import error_record
from nanoinfer.jsonl.requests import DEFAULT_MAX_TOKENS, make_params

# Every field a record can have (native, n > 1, OpenAI batch format): each output batch has all of them as
# columns, None where a record has no such field, so that Ray Data sees one schema.
RECORD_FIELDS = ("id", "custom_id", "line", "lora", "text", "choices", "finish_reason", "stop_reason", "logprobs",
                 "usage", "response", "error")


class NanoinferPredictor:
    """A callable class for `ds.map_batches(NanoinferPredictor, fn_constructor_kwargs={...}, ...)`.

    Rows hold what a JSONL line holds: "prompt", "messages" or "prompt_token_ids", an optional "id" and
    sampling fields, or the OpenAI batch fields ("custom_id", "method", "url", "body"). A missing or null
    field is left out (Ray Data gives a row null for a column only other rows have). Use
    `batch_format="pyarrow"` to keep integers exact; numpy batches turn an integer column with gaps into
    floats, which are read back as integers when they are whole. Give rows an "id": "line" numbers the rows
    one replica has seen, and duplicate ids are only caught within a batch.

    Args:
        model: a model folder, a GGUF file, the built-in default (None) or a hub id, as for LLM.
        sampling: sampling defaults for every row, as `generate`'s flags (a row's own fields win);
            max_tokens defaults to 256, as in `generate`.
        max_in_flight: most rows in the engine at once (default 4 x max_num_seqs).
        **settings: Config fields (max_model_len, dtype, num_threads, ...).
    """

    def __init__(self, model: str | None = None, *, sampling: dict | None = None, max_in_flight: int | None = None,
                 max_line_bytes: int = MAX_LINE_BYTES, **settings):
        from nanoinfer.errors import RequestError
        from nanoinfer.llm import LLM

        self.defaults = {"max_tokens": DEFAULT_MAX_TOKENS, **(sampling or {})}
        try:
            make_params(self.defaults, {})
        except BadLine as e:
            raise RequestError(f"NanoinferPredictor's sampling defaults are invalid: {e.message}") from None
        self.llm = LLM(model, **settings)
        self.runner = LineRunner(self.llm)
        self.max_in_flight = max_in_flight or min(4 * self.llm.config.max_num_seqs, 4096)
        self.max_line_bytes = max_line_bytes
        self.num_rows = 0  # rows seen so far: the next batch's lines are numbered on from here

    def __call__(self, rows) -> dict[str, np.ndarray]:
        """A batch of rows (a pyarrow Table, a pandas DataFrame or a dict of numpy columns) -> record columns."""
        rows = _to_rows(rows)
        first_line = self.num_rows + 1
        self.num_rows += len(rows)
        lines, unreadable = [], {}
        for number, row in enumerate(rows, start=first_line):
            try:
                lines.append(json.dumps(_plain(row), ensure_ascii=False, allow_nan=False).encode() + b"\n")
            except Exception as e:  # a value JSON has no form for (bytes, an object, nesting too deep, ...)
                lines.append(b"\n")  # a blank line keeps the numbering; the row gets its error record here
                unreadable[number] = LineError(
                    number, None, NATIVE, "invalid_row",
                    f"line {number}: the row cannot be read as a JSON line ({e}). Give plain values only.")
        reader = BatchReader(lines, self.defaults, max_line_bytes=self.max_line_bytes, first_line=first_line)
        records = {number: error_record(error) for number, error in unreadable.items()}
        for event in self.runner.run(reader, self.max_in_flight):
            if isinstance(event, FinishedLine):
                records[event.line] = event.record
        ordered = [records[number] for number in range(first_line, first_line + len(rows))]
        return {name: _column([record.get(name) for record in ordered]) for name in RECORD_FIELDS}


def _to_rows(rows) -> list[dict]:
    if hasattr(rows, "to_pylist"):  # pyarrow.Table: exact Python values, None where a row has no value
        return rows.to_pylist()
    if hasattr(rows, "to_dict") and hasattr(rows, "columns"):  # pandas.DataFrame
        return rows.to_dict("records")
    columns = {name: list(values) for name, values in rows.items()}
    num_rows = len(next(iter(columns.values()), []))
    return [{name: values[i] for name, values in columns.items()} for i in range(num_rows)]


def _plain(value):
    """Python values JSON can write: numpy arrays and scalars unwrapped, null and NaN fields left out, whole
    floats (numpy's form of an integer column with gaps) back to int."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items() if not _is_missing(v)}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _is_missing(value) -> bool:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return True
    return type(value).__name__ == "NAType"  # pandas.NA, without importing pandas


def _column(values: list) -> np.ndarray:
    column = np.empty(len(values), dtype=object)  # filled one by one: np.array would stack equal-length lists
    for i, value in enumerate(values):
        column[i] = value
    return column
