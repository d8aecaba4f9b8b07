"""nanoinfer.jsonl and the `generate` loop: every bad-input case gets its error record while the other lines
still get results; the OpenAI batch format round-trips; stdin/stdout mode; bounded in-flight requests."""

from __future__ import annotations

import json
import re
import shlex
from collections import deque

import pytest
import torch
from typer.testing import CliRunner

from nanoinfer.cli import app
from nanoinfer.cli import generate as generate_cli
from nanoinfer.engine.engine import StepStats
from nanoinfer.jsonl.lines import NATIVE, LineError, json_depth
from nanoinfer.jsonl.manifest import prepare_resume
from nanoinfer.jsonl.reader import _READ_CHUNK, BatchReader, LineTooLong, iter_lines, scan_input
from nanoinfer.jsonl.records import record_line_number, result_record
from nanoinfer.jsonl.requests import BatchRequest
from nanoinfer.jsonl.writer import RecordWriter, encode_record
from nanoinfer.outputs import CompletionOutput, RequestOutput
from nanoinfer.progress import JobProgress
from nanoinfer.testing.tiny_models import build_tiny_model

runner = CliRunner()
# Small KV cache (a few MB): allocating it is part of every run.
ENGINE_ARGS = shlex.split(
    "--device cpu --max-model-len 256 --kvcache-block-size 256 --cpu-kvcache-space-gib 0.02 "
    "--temperature 0 --max-tokens 4 --quiet"
)
GOOD_1 = b'{"id": "good-1", "prompt": "The quick brown fox"}'
GOOD_2 = b'{"id": "good-2", "messages": [{"role": "user", "content": "Paris is the capital of"}]}'


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    threads = torch.get_num_threads()  # the engine sets torch's thread count; give it back afterwards
    yield str(build_tiny_model("qwen3", tmp_path_factory.mktemp("model") / "qwen3"))
    torch.set_num_threads(threads)


def run_generate(tmp_path, model: str, lines: list[bytes], *extra: str):
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "out.jsonl"
    result = runner.invoke(
        app, ["generate", str(source), "-o", str(out), "--model", model, *ENGINE_ARGS, *extra]
    )
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return result, records


# ---- the bad-input corpus: one test per case, each between two good lines ------------------------------------
BAD_LINES = {
    "bad_json": (b'{"prompt": "hi"', "invalid_json", "is not valid JSON"),
    "not_an_object": (b'["hi", "there"]', "not_an_object", "is a JSON array, not an object"),
    "missing_prompt": (b'{"id": "x", "temperature": 0}', "missing_prompt", "has no prompt"),
    "empty_prompt": (b'{"prompt": ""}', "empty_prompt", "prompt is empty"),
    "invalid_utf8": (b'{"prompt": "caf\xe9"}', "invalid_utf8", "is not valid UTF-8"),
    "out_of_vocabulary_ids": (
        b'{"prompt_token_ids": [1, 99999]}',
        "out_of_vocabulary",
        "outside the vocabulary",
    ),
    "prompt_longer_than_max_model_len": (
        json.dumps({"prompt": "The quick brown fox jumps over the lazy dog. " * 40}).encode(),
        "prompt_too_long",
        "but max_model_len is 256",
    ),
    "bad_sampling_value": (
        b'{"prompt": "hi", "temperature": -1}',
        "invalid_sampling_params",
        "temperature must",
    ),
    "unknown_field": (b'{"prompt": "hi", "max_token": 3}', "unknown_field", "did you mean 'max_tokens'?"),
    "duplicate_id": (b'{"id": "good-1", "prompt": "again"}', "duplicate_id", "'good-1' was already used"),
    # Valid JSON that is not valid Unicode: tokenizers raise TypeError on it, which once ended the job.
    "lone_surrogate": (b'{"id": "s", "prompt": "ok \\ud800 lone"}', "invalid_unicode", "prompt holds a lone "
                       "surrogate '\\ud800' at character 3"),
    "lone_surrogate_in_a_message": (
        b'{"messages": [{"role": "user", "content": "x\\udfff"}]}',
        "invalid_unicode",
        "messages[0].content holds a lone surrogate",
    ),
    "lone_surrogate_in_a_key": (b'{"prompt": "hi", "\\udc00": 1}', "invalid_unicode", "<key> holds"),
    # json.loads recursed until RecursionError, a traceback.
    "deep_nesting": (b'{"prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nesting_too_deep",
                     "100001 levels deep; the limit is 64"),
    "nan": (b'{"prompt": "hi", "temperature": NaN}', "invalid_json", "NaN is not a JSON number"),
    "infinite_float": (b'{"prompt": "hi", "top_p": 1e400}', "invalid_json", "too large for a float"),
    "integer_of_5000_digits": (b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", "invalid_json",
                               "more than 4,300 digits"),
    "n_over_openai_bound": (b'{"prompt": "hi", "n": 100000}', "invalid_sampling_params", "n must be an integer "
                            "in [1, 128], got 100000"),
    "seed_outside_int64": (b'{"prompt": "hi", "seed": 99999999999999999999}', "invalid_sampling_params",
                           "seed must be a 64-bit signed integer"),
    "too_many_stop_strings": (json.dumps({"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}).encode(),
                              "invalid_sampling_params", "stop takes at most 16 strings"),
    "id_too_long": (json.dumps({"id": "x" * 1025, "prompt": "hi"}).encode(), "invalid_id", "the limit is 1024"),
    "many_unknown_fields": (json.dumps({"prompt": "hi", **{f"k{i}": i for i in range(10_000)}}).encode(),
                            "unknown_field", "and 9,995 more"),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_bad_line_gets_error_record_and_other_lines_get_results(tmp_path, tiny_model, case):
    bad, code, words = BAD_LINES[case]
    result, records = run_generate(tmp_path, tiny_model, [GOOD_1, bad, GOOD_2])
    assert result.exit_code == 0, result.output
    assert len(records) == 3  # exactly one record per non-blank line
    by_line = {r["line"]: r for r in records}
    error = by_line[2]
    assert error["finish_reason"] == "error" and error["text"] is None
    assert error["error"]["code"] == code
    assert error["error"]["message"].startswith("line 2: ")
    assert words in error["error"]["message"]
    for line, expected_id in ((1, "good-1"), (3, "good-2")):
        assert by_line[line]["id"] == expected_id
        assert by_line[line]["error"] is None
        assert by_line[line]["usage"]["completion_tokens"] >= 1
    assert "Traceback" not in result.output


def test_a_line_over_the_byte_limit_is_skipped_unread(tmp_path, tiny_model):
    huge = json.dumps({"prompt": "word " * 2000}).encode()
    result, records = run_generate(tmp_path, tiny_model, [GOOD_1, huge, GOOD_2], "--max-line-bytes", "4096")
    assert result.exit_code == 0, result.output
    by_line = {r["line"]: r for r in records}
    assert by_line[2]["error"]["code"] == "line_too_long"
    assert f"is {len(huge) + 1:,} bytes long, over the limit of 4,096" in by_line[2]["error"]["message"]
    assert by_line[1]["error"] is None and by_line[3]["error"] is None


def test_a_prompt_too_long_to_fit_is_refused_before_tokenizing(tmp_path, tiny_model, monkeypatch):
    from nanoinfer.llm import LLM

    encoded = []
    encode = LLM.encode
    monkeypatch.setattr(LLM, "encode", lambda self, text: encoded.append(len(text)) or encode(self, text))
    # the tiny model's longest token is 13 characters: 4 x 13 x 256 = 13,312 characters at most
    huge = json.dumps({"prompt": "x" * 13_313}).encode()
    result, records = run_generate(tmp_path, tiny_model, [GOOD_1, huge, GOOD_2])
    assert result.exit_code == 0, result.output
    error = {r["line"]: r for r in records}[2]["error"]
    assert error["code"] == "prompt_too_long" and "13,313 characters" in error["message"]
    assert 13_313 not in encoded and len(encoded) == 2


def test_an_unexpected_failure_on_one_line_is_its_internal_error_record(tmp_path, tiny_model, monkeypatch):
    """Whatever raises while a line becomes a request ends that line only, with the exception's text."""
    from nanoinfer.llm import LLM

    encode = LLM.encode

    def flaky_encode(self, text):
        if "boom" in text:
            raise ZeroDivisionError("a bug nobody foresaw")
        return encode(self, text)

    monkeypatch.setattr(LLM, "encode", flaky_encode)
    result, records = run_generate(tmp_path, tiny_model, [GOOD_1, b'{"prompt": "boom"}', GOOD_2])
    assert result.exit_code == 0, result.output
    by_line = {r["line"]: r for r in records}
    assert by_line[2]["error"]["code"] == "internal_error"
    assert "ZeroDivisionError: a bug nobody foresaw" in by_line[2]["error"]["message"]
    assert by_line[1]["error"] is None and by_line[3]["error"] is None


def test_every_non_blank_line_gets_exactly_one_record(tmp_path, tiny_model):
    lines = [GOOD_1, b"", b"   ", b'{"prompt": "Once upon a time"}', b"oops", b"", GOOD_2]
    result, records = run_generate(tmp_path, tiny_model, lines)
    assert result.exit_code == 0, result.output
    assert sorted(r["line"] for r in records) == [1, 4, 5, 7]
    assert {r["id"] for r in records} == {"good-1", "line-4", "line-5", "good-2"}
    assert "4 requests, 1 errors" in result.output


def test_line_sampling_fields_override_the_command_defaults(tmp_path, tiny_model):
    lines = [
        b'{"id": "short", "prompt": "Hello", "max_tokens": 2, "ignore_eos": true}',
        b'{"id": "n2", "prompt": "Hello", "n": 2, "ignore_eos": true, "logprobs": 1}',
    ]
    result, records = run_generate(tmp_path, tiny_model, lines, "--max-tokens", "5")
    assert result.exit_code == 0, result.output
    by_id = {r["id"]: r for r in records}
    assert by_id["short"]["usage"]["completion_tokens"] == 2
    assert by_id["short"]["finish_reason"] == "length"
    choices = by_id["n2"]["choices"]
    assert [c["index"] for c in choices] == [0, 1] and "text" not in by_id["n2"]
    assert all(len(c["logprobs"]) == 5 and len(c["logprobs"][0]["top"]) == 1 for c in choices)
    assert by_id["n2"]["usage"]["completion_tokens"] == 10


# ---- OpenAI batch format ---------------------------------------------------------------------------------------
def openai_line(custom_id: str, url: str, body: dict) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}).encode()


def test_openai_batch_file_round_trips(tmp_path, tiny_model):
    chat = {
        "model": "gpt-4o-mini",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Name a capital."}]},
        ],
        "max_tokens": 3,
        "logprobs": True,
        "top_logprobs": 2,
    }
    lines = [
        openai_line("chat-1", "/v1/chat/completions", chat),
        openai_line("cmpl-1", "/v1/completions", {"model": "m", "prompt": "Once upon", "max_tokens": 2}),
        openai_line("cmpl-ids", "/v1/completions", {"model": "m", "prompt": [5, 6, 7], "max_tokens": 2}),
        openai_line("bad-url", "/v1/embeddings", {"model": "m", "input": "x"}),
        openai_line(
            "bad-param", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "functions": []}
        ),
    ]
    result, records = run_generate(tmp_path, tiny_model, lines)
    assert result.exit_code == 0, result.output
    by_id = {r["custom_id"]: r for r in records}
    assert set(by_id) == {"chat-1", "cmpl-1", "cmpl-ids", "bad-url", "bad-param"}
    for record in records:
        assert set(record) == {"id", "custom_id", "response", "error"}
        assert set(record["response"]) == {"status_code", "request_id", "body"}
    chat_out = by_id["chat-1"]
    assert chat_out["error"] is None and chat_out["response"]["status_code"] == 200
    body = chat_out["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == "gpt-4o-mini"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    assert len(choice["logprobs"]["content"][0]["top_logprobs"]) == 2
    assert body["usage"]["completion_tokens"] <= 3
    assert (
        body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    )
    text_body = by_id["cmpl-1"]["response"]["body"]
    assert text_body["object"] == "text_completion" and isinstance(text_body["choices"][0]["text"], str)
    assert by_id["cmpl-ids"]["response"]["body"]["usage"]["prompt_tokens"] == 3
    for bad, code in (("bad-url", "unsupported_url"), ("bad-param", "unsupported_parameter")):
        assert by_id[bad]["response"]["status_code"] == 400
        assert by_id[bad]["error"]["code"] == code
        assert by_id[bad]["response"]["body"]["error"]["code"] == code


def test_openai_line_without_custom_id_is_an_error_in_openai_format(tmp_path, tiny_model):
    line = json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}).encode()
    result, records = run_generate(tmp_path, tiny_model, [line, b"{broken"])
    assert result.exit_code == 0, result.output
    assert [r["error"]["code"] for r in records] == ["missing_custom_id", "invalid_json"]
    assert all(r["custom_id"] is None and r["response"]["status_code"] == 400 for r in records)


# ---- stdin / stdout ------------------------------------------------------------------------------------------
def test_stdin_to_stdout_writes_only_records_on_stdout(tiny_model):
    data = b"\n".join([GOOD_1, b"not json", GOOD_2]) + b"\n"
    result = runner.invoke(
        app, ["generate", "-", "-o", "-", "--model", tiny_model, *ENGINE_ARGS, "--json"], input=data
    )
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert sorted(r["line"] for r in records) == [1, 2, 3]
    assert json.loads(result.stderr.strip().splitlines()[-1])["requests"] == 3  # --json goes to stderr here


def test_stdout_output_cannot_be_resumed(tmp_path, tiny_model):
    (tmp_path / "in.jsonl").write_bytes(GOOD_1 + b"\n")
    result = runner.invoke(
        app, ["generate", str(tmp_path / "in.jsonl"), "-o", "-", "--resume", "--model", tiny_model]
    )
    assert result.exit_code == 2
    assert "--resume needs an output file" in result.output


# ---- bounded in-flight requests, lazy reading ------------------------------------------------------------------
class _Tokenizer:
    def decode(self, token_ids):
        return "x" * len(token_ids)


class CountingLLM:
    """Stands in for LLM: finishes up to `batch_size` requests per step, counting requests in flight."""

    def __init__(self, config, batch_size: int = 8):
        self.config = config
        self.tokenizer = _Tokenizer()
        self.reasoning_parser = self.tool_call_parser = self.thinking_token_ids = None  # plain-text records
        self.batch_size = batch_size
        self.queue: deque[tuple[str, list[int]]] = deque()
        self.max_in_flight = 0
        self.num_steps = 0
        self.on_first_step = None
        self.max_prompt_chars = 10_000

    def encode(self, text):
        return [1] * len(text.split())

    def check_token_ids(self, token_ids):
        return list(token_ids)

    def apply_chat_template(self, messages):
        return " ".join(m["content"] for m in messages)

    def add_request(self, token_ids, params, request_id, lora_request=None, chat=False):
        self.queue.append((request_id, token_ids))
        self.max_in_flight = max(self.max_in_flight, len(self.queue))

    def has_unfinished_requests(self):
        return bool(self.queue)

    def step(self):
        if self.num_steps == 0 and self.on_first_step is not None:
            self.on_first_step()
        self.num_steps += 1
        outputs = []
        for _ in range(min(self.batch_size, len(self.queue))):
            request_id, token_ids = self.queue.popleft()
            outputs.append(
                RequestOutput(request_id, None, token_ids, [CompletionOutput(0, "ok", [7], "length")])
            )
        return outputs, StepStats(0, len(outputs), 0, 0.0)


class _Config:
    max_model_len = 256
    loras = {}


def test_in_flight_requests_stay_bounded_on_a_large_input(tmp_path, tiny_model, monkeypatch):
    num_lines = 20_000
    source = tmp_path / "big.jsonl"
    with open(source, "w") as f:
        f.writelines(
            json.dumps({"id": f"r{i}", "prompt": f"prompt number {i}"}) + "\n" for i in range(num_lines)
        )
    fakes = []
    monkeypatch.setattr(
        generate_cli, "load_llm", lambda config: fakes.append(CountingLLM(config)) or fakes[-1]
    )
    out = tmp_path / "out.jsonl"
    result = runner.invoke(
        app,
        ["generate", str(source), "-o", str(out), "--model", tiny_model, "--max-in-flight", "16", "--quiet"],
    )
    assert result.exit_code == 0, result.output
    assert fakes[0].max_in_flight == 16  # the bound was reached and never passed
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert len(ids) == num_lines and len(set(ids)) == num_lines


def test_default_in_flight_bound_is_four_times_max_num_seqs(tmp_path, tiny_model, monkeypatch):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"prompt": f"p {i}"}) + "\n" for i in range(200)))
    fakes = []
    monkeypatch.setattr(
        generate_cli, "load_llm", lambda config: fakes.append(CountingLLM(config)) or fakes[-1]
    )
    result = runner.invoke(
        app,
        [
            "generate",
            str(source),
            "-o",
            str(tmp_path / "o.jsonl"),
            "--model",
            tiny_model,
            "--max-num-seqs",
            "8",
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    assert fakes[0].max_in_flight == 32


def test_input_is_read_lazily(tmp_path):
    consumed = 0

    def lines():
        nonlocal consumed
        for i in range(5_000):
            consumed += 1
            yield json.dumps({"prompt": f"p {i}"}).encode() + b"\n"

    llm = CountingLLM(_Config())
    consumed_at_first_step = []
    llm.on_first_step = lambda: consumed_at_first_step.append(consumed)
    reader = BatchReader(lines(), {"max_tokens": 4})
    writer = RecordWriter(tmp_path / "out.jsonl")
    stopper = generate_cli.Stopper()
    generate_cli.stream_requests(llm, reader, writer, JobProgress(None, plain=True), 10, stopper)
    writer.close()
    assert consumed_at_first_step == [10]  # only what fills the in-flight budget was read before work began
    assert llm.max_in_flight == 10
    assert consumed == 5_000 and writer.num_written == 5_000


# ---- pure parsing and bookkeeping ---------------------------------------------------------------------------
def parse_all(lines: list[bytes], done: set[int] = frozenset()):
    return list(BatchReader(lines, {"max_tokens": 8}, set(done)))


def test_json_depth_ignores_brackets_inside_strings():
    assert json_depth(b'{"a": [[1], {"b": [2]}]}') == 0  # few brackets: not even scanned
    deep = b'{"a": ' + b"[" * 70 + b"]" * 70 + b"}"
    assert json_depth(deep) == 71
    quoted = json.dumps({"prompt": "[" * 500 + '\\"{' * 100}).encode()
    assert json_depth(quoted) == 1


def test_scan_input_counts_lines_that_span_its_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr("nanoinfer.jsonl.reader._READ_CHUNK", 7)
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'\xef\xbb\xbf\n{"prompt": "a long line"}\n   \n\n{"prompt": "b"}')
    digest, num_lines = scan_input(path)
    assert num_lines == 2 == sum(1 for _ in iter_lines(open(path, "rb")))


def test_an_over_long_line_is_read_in_chunks_never_whole(monkeypatch):
    import io

    sizes = []

    class Stream(io.BytesIO):
        def readline(self, size=-1):
            sizes.append(size)
            return super().readline(size)

    data = b'{"prompt": "a"}\n' + b"x" * 5000 + b"\n" + b'{"prompt": "b"}\n'
    lines = list(iter_lines(Stream(data), max_line_bytes=100))
    assert [n for n, _ in lines] == [1, 2, 3]
    assert isinstance(lines[1][1], LineTooLong) and lines[1][1].num_bytes == 5001
    assert lines[2][1] == b'{"prompt": "b"}\n'
    assert all(0 < size <= max(102, _READ_CHUNK) for size in sizes)


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number > 0"),
        ({"n": 129}, "n must be an integer in [1, 128]"),
        ({"logprobs": 21}, "logprobs must be an integer in [0, 20]"),
        ({"seed": 2**63}, "seed must be a 64-bit signed integer"),
        ({"stop": ["x" * 1025]}, "at most 1024 characters"),
        ({"stop_token_ids": list(range(1025))}, "stop_token_ids takes at most 1024 ids"),
    ],
)
def test_sampling_params_bound_what_one_request_may_ask(fields, words):
    from nanoinfer.errors import RequestError
    from nanoinfer.sampling_params import SamplingParams

    with pytest.raises(RequestError, match=re.escape(words)):
        SamplingParams(**fields)


def test_a_huge_max_tokens_is_accepted_since_max_model_len_ends_the_sequence():
    from nanoinfer.sampling_params import SamplingParams

    assert SamplingParams(max_tokens=10**400).max_tokens == 10**400


def test_seeds_at_the_ends_of_int64_sample(tiny_model):
    from nanoinfer.llm import LLM
    from nanoinfer.sampling_params import SamplingParams

    llm = LLM(tiny_model, device="cpu", max_model_len=64, cpu_kvcache_space_gib=0.02)
    for seed in (-(2**63), 2**63 - 1):
        outs = llm.generate(["Hello"], SamplingParams(n=3, seed=seed, max_tokens=2, temperature=1.0))
        assert [len(c.token_ids) for c in outs[0].outputs] == [2, 2, 2]
    tiny = llm.generate(["Hello"], SamplingParams(temperature=1e-300, max_tokens=3))[0].outputs[0].token_ids
    greedy = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].token_ids
    assert tiny == greedy  # below GREEDY_TEMPERATURE: greedy, not logits divided into infinities


def test_ids_default_to_the_line_number_and_blank_lines_count():
    items = parse_all([b'{"prompt": "a"}\n', b"\n", b'{"prompt": "b", "id": 7}\n'])
    assert [(i.line, i.id) for i in items] == [(1, "line-1"), (3, "7")]


def test_resume_keeps_duplicate_decisions_of_skipped_lines():
    lines = [b'{"id": "a", "prompt": "x"}\n', b'{"id": "a", "prompt": "y"}\n']
    items = parse_all(lines, done={1})
    assert len(items) == 1 and isinstance(items[0], LineError) and items[0].code == "duplicate_id"


def test_prompt_fields_must_be_exactly_one():
    (item,) = parse_all([b'{"prompt": "a", "prompt_token_ids": [1]}\n'])
    assert item.code == "invalid_prompt" and "exactly one" in item.message


def test_record_is_one_ascii_line_whatever_the_text():
    request = BatchRequest(1, "x", NATIVE, params=None)
    output = RequestOutput("1", None, [1], [CompletionOutput(0, "a\u2028b\nc\u00e9", [1, 2], "length")])
    data = encode_record(result_record(request, output, str))
    assert data.count(b"\n") == 1 and data.endswith(b"\n")
    assert json.loads(data)["text"] == "a\u2028b\nc\u00e9"


def test_prepare_resume_cuts_a_torn_last_line(tmp_path):
    out = tmp_path / "out.jsonl"
    good = b'{"id":"a","line":1}\n{"id":"b","line":2}\n'
    out.write_bytes(good + b'{"id":"c","li')
    state = prepare_resume(out)
    assert state.done_lines == {1, 2} and state.num_cut_bytes == len(b'{"id":"c","li')
    assert out.read_bytes() == good


def test_prepare_resume_drops_everything_after_garbage(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"id":"a","line":1}\n\x00\x00\x00\n{"id":"c","line":3}\n')
    state = prepare_resume(out)
    assert state.done_lines == {1} and state.num_dropped_records == 1
    assert out.read_bytes() == b'{"id":"a","line":1}\n'


def test_openai_records_carry_their_line_in_the_id():
    assert record_line_number({"id": "batch_req_line42", "custom_id": "x"}) == 42
    assert record_line_number({"id": "x", "line": 3}) == 3
    assert record_line_number({"id": "x"}) is None


# ---- prompt logprobs: native records and OpenAI's echo -------------------------------------------------------
def _reference_logprobs(model: str, token_ids: list[int]) -> torch.Tensor:
    from nanoinfer.testing.hf_reference import hf_model

    with torch.no_grad():
        logits = hf_model(model)(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(token_ids[1:])[:, None]).squeeze(1)


def test_prompt_logprobs_on_a_native_line_score_the_prompt(tmp_path, tiny_model):
    prompt = [5, 9, 33, 80, 7, 12]
    lines = [json.dumps({"id": "s", "prompt_token_ids": prompt, "prompt_logprobs": 2, "max_tokens": 0}).encode(),
             json.dumps({"id": "g", "prompt": "The quick brown fox", "prompt_logprobs": 0}).encode()]
    result, records = run_generate(tmp_path, tiny_model, lines)
    assert result.exit_code == 0, result.output
    by_id = {r["id"]: r for r in records}
    scored = by_id["s"]
    assert scored["text"] == "" and scored["finish_reason"] == "length" and scored["usage"]["completion_tokens"] == 0
    entries = scored["prompt_logprobs"]
    assert entries[0] is None and [e["token_id"] for e in entries[1:]] == prompt[1:]
    assert all(len(e["top"]) == 2 for e in entries[1:])
    expected = _reference_logprobs(tiny_model, prompt)
    assert max(abs(e["logprob"] - r) for e, r in zip(entries[1:], expected.tolist())) < 1e-4
    assert by_id["g"]["usage"]["completion_tokens"] == 4 and by_id["g"]["prompt_logprobs"][1]["top"] == []


def test_openai_completions_echo_returns_the_prompts_logprobs(tmp_path, tiny_model):
    from openai.types import Completion
    from pydantic import ValidationError

    prompt = [5, 9, 33, 80, 7, 12]
    lines = [openai_line("score", "/v1/completions", {"model": "m", "prompt": prompt, "echo": True, "logprobs": 1,
                                                      "max_tokens": 0}),
             openai_line("both", "/v1/completions", {"model": "m", "prompt": "Once upon", "echo": True,
                                                     "logprobs": 0, "max_tokens": 2}),
             openai_line("text", "/v1/completions", {"model": "m", "prompt": "Once upon", "echo": True,
                                                     "max_tokens": 2}),
             openai_line("bad", "/v1/completions", {"model": "m", "prompt": "x", "echo": "yes"})]
    result, records = run_generate(tmp_path, tiny_model, lines)
    assert result.exit_code == 0, result.output
    by_id = {r["custom_id"]: r for r in records}
    score = by_id["score"]["response"]["body"]
    logprobs = score["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(prompt) and score["usage"]["completion_tokens"] == 0
    assert "".join(logprobs["tokens"]) == score["choices"][0]["text"]
    # The first token has no logprob: null, as OpenAI's API and vLLM send it. openai-python's Logprobs declares plain
    # floats, so those two nulls are the only thing its validation refuses.
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    with pytest.raises(ValidationError) as refused:
        Completion.model_validate(score)
    assert {e["loc"][-1] for e in refused.value.errors()} == {0} and len(refused.value.errors()) == 2
    first = dict(logprobs, token_logprobs=[0.0, *logprobs["token_logprobs"][1:]],
                 top_logprobs=[{}, *logprobs["top_logprobs"][1:]])
    Completion.model_validate(dict(score, choices=[dict(score["choices"][0], logprobs=first)]))
    expected = _reference_logprobs(tiny_model, prompt)
    assert max(abs(a - b) for a, b in zip(logprobs["token_logprobs"][1:], expected.tolist())) < 1e-4
    both = by_id["both"]["response"]["body"]["choices"][0]
    assert both["text"].startswith("Once upon") and len(both["logprobs"]["tokens"]) == \
        by_id["both"]["response"]["body"]["usage"]["total_tokens"]
    assert all(v is not None for v in both["logprobs"]["token_logprobs"][1:])
    text = by_id["text"]["response"]["body"]
    Completion.model_validate(text)
    assert text["choices"][0]["text"].startswith("Once upon") and text["choices"][0]["logprobs"] is None
    assert by_id["bad"]["error"]["code"] == "invalid_sampling_params"
