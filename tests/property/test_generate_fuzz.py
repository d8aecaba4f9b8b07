"""The input boundary of `nanoinfer generate`, fuzzed: the real command on a tiny model, over files that mix
valid lines with every kind of trouble a line can hold.

Invariants, for every file: exit 0, no traceback, exactly one record per non-blank line, every record parses,
and every valid line is answered as in a clean run of the valid lines alone (greedy, so token for token).
Seeded (derandomized); at least NANOINFER_FUZZ_LINES lines per run (default 2,000; raise it for a longer
hunt, e.g. NANOINFER_FUZZ_LINES=50000).
"""

from __future__ import annotations

import json
import os
import shlex

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from nanoinfer.cli import app
from nanoinfer.jsonl.records import record_line_number
from nanoinfer.testing.tiny_models import build_tiny_model

NUM_LINES = int(os.environ.get("NANOINFER_FUZZ_LINES", "2000"))
LINES_PER_FILE = 100
MAX_LINE_BYTES = 65536  # small enough that the long lines below cross it
ENGINE_ARGS = shlex.split(
    "--device cpu --max-model-len 64 --kvcache-block-size 256 --cpu-kvcache-space-gib 0.02 --max-num-seqs 16 "
    f"--temperature 0 --max-tokens 3 --quiet --max-line-bytes {MAX_LINE_BYTES}"
)
VALID_ID = "valid-7f3a9c-{}"  # no generated line can hold this id by chance
VALID_PROMPTS = [
    {"prompt": "The quick brown fox"},
    {"prompt": "Paris is", "max_tokens": 2},
    {"messages": [{"role": "user", "content": "Hi there"}]},
    {"prompt_token_ids": [1, 2, 3, 4]},
    {"prompt": "emoji \U0001f600 and RTL \u202eabc \u0301e", "ignore_eos": True},
]
runner = CliRunner()

# ---- strategies ------------------------------------------------------------------------------------------
TROUBLE_CHARS = ["\ud800", "\udfff", "\ud83d\ude00", "\x00", "\ufeff", "\u202e", "\u200f", "\u0301", "\U0001f9d1",
                 "\u2028", "\r", "\n", "\\", '"', "\uffff"]
texts = st.one_of(
    st.text(max_size=40),  # hypothesis' text includes lone surrogates
    st.lists(st.sampled_from(TROUBLE_CHARS) | st.text(max_size=3), max_size=12).map("".join),
)
numbers = st.one_of(
    st.integers(-(2**70), 2**70),
    st.integers(-3, 300),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 128, 129, 2**63, -(2**63) - 1, 10**30, 1e-300, 1e308]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4), max_leaves=12
)
SAMPLING_FIELDS = ["temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "stop", "stop_token_ids",
                   "seed", "n", "ignore_eos", "logprobs", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "skip_special_tokens", "best_of", "max_completion_tokens",
                   "structured_outputs", "response_format"]
STRUCTURED = [{"json": {"type": "object"}}, {"regex": "[a-z]+"}, {"choice": ["a", "b"]}, {"choice": []},
              {"json": {"type": "objekt"}}, {"regex": "(ab"}, {"grammar": "root ::= x"}, {"json_object": True},
              {"type": "json_schema", "json_schema": {"schema": {"type": "integer"}}}, {"type": "json_object"},
              {"type": "text"}, {"json": "{not json"}, {"json": {}, "regex": "a"}]
field_values = st.one_of(scalars, st.lists(scalars, max_size=20), json_values, st.sampled_from(STRUCTURED))


@st.composite
def native_lines(draw) -> object:
    line = {}
    kind = draw(st.sampled_from(["prompt", "messages", "prompt_token_ids", "none", "two"]))
    if kind in ("prompt", "two"):
        line["prompt"] = draw(st.one_of(texts, texts, texts, json_values))
    if kind in ("messages", "two"):
        line["messages"] = draw(st.lists(st.fixed_dictionaries({"role": texts | st.just("user"),
                                                                "content": texts | json_values}), max_size=3)
                                | json_values)
    if kind == "prompt_token_ids":
        line["prompt_token_ids"] = draw(st.lists(st.integers(-5, 2**40) | scalars, max_size=8))
    if draw(st.booleans()):
        line["id"] = draw(st.one_of(texts, st.integers(), scalars, json_values))
    names = SAMPLING_FIELDS + (["unknown"] if draw(st.integers(0, 9)) == 0 else [])
    for name in draw(st.lists(st.sampled_from(names), max_size=4, unique=True)):
        line[name] = draw(st.one_of(numbers, numbers, field_values))
    return line


@st.composite
def openai_lines(draw) -> object:
    body = draw(st.one_of(
        json_values,
        st.fixed_dictionaries({"messages": json_values | st.lists(json_values, max_size=2)},
                              optional={"max_tokens": field_values, "n": field_values, "logprobs": field_values,
                                        "top_logprobs": field_values, "response_format": json_values,
                                        "stream": scalars, "model": scalars}),
        st.fixed_dictionaries({"prompt": texts | json_values | st.lists(st.integers(-3, 10**6), max_size=5)},
                              optional={"best_of": field_values, "echo": scalars, "suffix": scalars,
                                        "logprobs": field_values}),
    ))
    line = {"custom_id": draw(scalars), "method": draw(st.sampled_from(["POST", "GET"]) | scalars),
            "url": draw(st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]) | scalars),
            "body": body}
    for key in draw(st.lists(st.sampled_from(["custom_id", "method", "url", "body"]), max_size=2)):
        line.pop(key, None)
    return line


def encode(value, how: int) -> bytes:
    """JSON text in one of several encodings; lone surrogates written raw make invalid UTF-8 bytes."""
    text = json.dumps(value, ensure_ascii=how % 2 == 0, allow_nan=True)
    return text.encode("utf-8", "surrogatepass")


def nested(depth: int) -> bytes:
    return b'{"prompt": "hi", "x": ' + b"[" * depth + b"]" * depth + b"}"


@st.composite
def trouble_lines(draw) -> bytes:
    how = draw(st.integers(0, 3))
    choice = draw(st.integers(0, 9))
    if choice <= 2:
        raw = encode(draw(native_lines()), how)
    elif choice == 3:
        raw = encode(draw(openai_lines()), how)
    elif choice == 4:
        raw = encode(draw(json_values), how)
    elif choice == 5:
        raw = draw(st.binary(max_size=60))
    elif choice == 6:
        raw = nested(draw(st.sampled_from([10, 63, 64, 65, 1000, 100_000])))
    elif choice == 7:  # long lines, on both sides of the byte limit
        size = draw(st.sampled_from([4000, MAX_LINE_BYTES - 40, MAX_LINE_BYTES + 10, 3 * MAX_LINE_BYTES]))
        raw = json.dumps({"prompt": draw(st.sampled_from(["a", "word ", "\u00e9", "["])) * size}).encode()
    elif choice == 8:  # a valid line with one byte cut off, or a prefix of one
        raw = encode(VALID_PROMPTS[draw(st.integers(0, len(VALID_PROMPTS) - 1))], how)
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    else:
        raw = draw(st.sampled_from([b"\xef\xbb\xbf{}", b"NaN", b"-Infinity", b'{"prompt": NaN}', b"\x00", b"{}",
                                    b'{"prompt": "a\x00b"}', b"\xed\xa0\x80", b'"\\ud800"', b"[]", b"null"]))
    return raw + draw(st.sampled_from([b"", b"\r"]))  # CRLF line ends, now and then


@st.composite
def files(draw) -> tuple[bytes, list[int]]:
    """(the file, the valid pool's index of each valid line in order)."""
    parts, valid = [], []
    for _ in range(LINES_PER_FILE):
        if draw(st.integers(0, 3)) == 0:
            index = draw(st.integers(0, len(VALID_PROMPTS) - 1))
            line = {"id": VALID_ID.format(len(valid)), **VALID_PROMPTS[index]}
            valid.append(index)
            parts.append(json.dumps(line).encode() + draw(st.sampled_from([b"", b"\r"])))
        else:
            parts.append(draw(trouble_lines()))
        if draw(st.integers(0, 9)) == 0:
            parts.append(draw(st.sampled_from([b"", b"  ", b"\t\r"])))  # blank lines get no record
    return b"\n".join(parts) + draw(st.sampled_from([b"\n", b""])), valid


# ---- the test ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    threads = torch.get_num_threads()
    yield str(build_tiny_model("qwen3", tmp_path_factory.mktemp("fuzz") / "qwen3"))
    torch.set_num_threads(threads)


def generate(tmp_path, model: str, data: bytes):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(data)
    result = runner.invoke(app, ["generate", str(source), "-o", str(out), "--overwrite", "--model", model,
                                 *ENGINE_ARGS])
    return result, out.read_bytes() if out.exists() else b""


@pytest.fixture(scope="module")
def clean_texts(tiny_model, tmp_path_factory):
    """Each valid prompt's record fields in a clean run of the valid lines alone."""
    data = b"".join(json.dumps({"id": VALID_ID.format(i), **p}).encode() + b"\n" for i, p in enumerate(VALID_PROMPTS))
    result, out = generate(tmp_path_factory.mktemp("clean"), tiny_model, data)
    assert result.exit_code == 0, result.output
    records = {r["id"]: r for r in map(json.loads, out.splitlines())}
    answers = [records[VALID_ID.format(i)] for i in range(len(VALID_PROMPTS))]
    assert all(a["error"] is None for a in answers)
    return [(a["text"], a["usage"]["completion_tokens"]) for a in answers]


def non_blank_line_numbers(data: bytes) -> list[int]:
    """What the reader must answer, counted independently of it: blank = only ASCII whitespace."""
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    if lines and lines[0].startswith(b"\xef\xbb\xbf"):
        lines[0] = lines[0][3:]
    return [i for i, line in enumerate(lines, start=1) if line.strip()]


@settings(max_examples=-(-NUM_LINES // LINES_PER_FILE), derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(case=files())
def test_no_line_can_take_the_job_down(tiny_model, clean_texts, tmp_path_factory, case):
    data, valid = case
    result, out = generate(tmp_path_factory.mktemp("fuzz"), tiny_model, data)
    assert result.exit_code == 0, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    assert out.endswith(b"\n") or not out
    records = [json.loads(line) for line in out.splitlines()]  # every record parses
    lines = sorted(record_line_number(r) for r in records)
    assert lines == non_blank_line_numbers(data)  # exactly one record per non-blank line
    by_id = {r.get("id"): r for r in records}
    for k, index in enumerate(valid):
        record = by_id[VALID_ID.format(k)]
        assert record["error"] is None, record
        assert (record["text"], record["usage"]["completion_tokens"]) == clean_texts[index]
    codes = [r["error"]["code"] for r in records if r.get("error")]
    assert "internal_error" not in codes, [r for r in records if r.get("error", {}) and
                                           r["error"]["code"] == "internal_error"][:3]

