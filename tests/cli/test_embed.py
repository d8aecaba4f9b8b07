"""`nanoinfer embed` through Typer's CliRunner: native and OpenAI /v1/embeddings lines against sentence-transformers
for each pooling mode, OpenAI bodies checked with the openai package's own types, bad lines, resume, and the checks
that refuse a job before any model loads."""

from __future__ import annotations

import base64
import itertools
import json
import os
import shlex
import shutil
import signal

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from nanoinfer.cli import app
from nanoinfer.cli import embed as embed_cli
from nanoinfer.jsonl.embed import parse_embedding
from nanoinfer.jsonl.manifest import manifest_path
from nanoinfer.jsonl.openai import encode_embedding
from nanoinfer.jsonl.reader import BatchReader
from nanoinfer.testing.st_folders import make_st_folder
from nanoinfer.testing.tiny_models import build_tiny_model

runner = CliRunner()
ENGINE_ARGS = shlex.split("--device cpu --dtype float32 --max-model-len 256 --cpu-kvcache-space-gib 0.02 --quiet")
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris",
    "A paged KV cache stores keys and values in fixed-size blocks. Continuous batching admits new requests as soon "
    "as old ones finish. Prefix caching reuses the blocks of a shared prompt.",
    "def main(): print(\"hello world\")",
    "Once upon a time there was a small language model",
    "Berlin is the capital of Germany and Rome the capital of Italy.",
]
MODES = {"mean": True, "last": True, "cls": False}  # pooling_type -> the folder has a Normalize module
MIN_COSINE = 0.9999


def openai_line(custom_id: str, body: dict, url: str = "/v1/embeddings") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def input_lines(token_ids: list[int]) -> list[dict | str]:
    """Every kind of line once: native text (float, base64), native token ids, OpenAI single and list inputs, and
    bad lines among them. `token_ids`: TEXTS[3] tokenized."""
    return [
        {"id": "n0", "input": TEXTS[0]},
        {"input": TEXTS[1]},  # id: line-2
        {"id": "n0-base64", "input": TEXTS[0], "encoding_format": "base64"},
        {"id": "tok", "input": token_ids},
        openai_line("o-one", {"model": "tiny-embed", "input": TEXTS[4], "encoding_format": "float"}),
        openai_line("o-list", {"model": "tiny-embed", "input": [TEXTS[5], TEXTS[2]], "encoding_format": "base64"}),
        {"id": "empty", "input": ""},
        "not json",
        openai_line("o-chat", {"messages": [{"role": "user", "content": "hi"}]}, url="/v1/chat/completions"),
        openai_line("o-bad-input", {"input": [TEXTS[0], [10**6]]}),  # its second input is outside the vocabulary
        openai_line("o-ids", {"input": [token_ids, token_ids[:2]]}),
    ]


def write_lines(path, lines) -> None:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))


def read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def invoke(*args):
    return runner.invoke(app, ["embed", *map(str, args)])


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def from_base64(text: str) -> list[float]:
    return np.frombuffer(base64.b64decode(text), dtype="<f4").tolist()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The tiny model, one sentence-transformers folder per pooling mode with its reference embeddings, the input."""
    from sentence_transformers import SentenceTransformer

    threads = torch.get_num_threads()  # the engine sets torch's thread count; give it back afterwards
    root = tmp_path_factory.mktemp("embed-cli")
    model = build_tiny_model("llama", root / "llama")
    folders, references = {}, {}
    for mode, normalize in MODES.items():
        folders[mode] = make_st_folder(model, root / f"st-{mode}", mode, normalize)
        st = SentenceTransformer(str(folders[mode]), device="cpu")
        references[mode] = dict(zip(TEXTS, st.encode(TEXTS, convert_to_numpy=True)))
    token_ids = st.tokenizer(TEXTS[3])["input_ids"]
    source = root / "in.jsonl"
    write_lines(source, input_lines(token_ids))
    yield {"root": root, "model": model, "folders": folders, "references": references, "source": source}
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def outputs(job):
    """Each pooling mode's run of the input: (output path, CliRunner result)."""
    runs = {}
    for mode in MODES:
        out = job["root"] / f"out-{mode}.jsonl"
        runs[mode] = out, invoke(job["source"], "-o", out, "--model", job["folders"][mode], *ENGINE_ARGS, "--json")
    return runs


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(config):
        raise AssertionError("the model was loaded although the job should have been refused first")

    monkeypatch.setattr(embed_cli, "load_llm", refuse)


# ---- the acceptance: every line kind equals sentence-transformers, for mean, last-token and cls pooling ---------
@pytest.mark.parametrize("mode", list(MODES))
def test_embeddings_equal_sentence_transformers_and_openai_bodies_validate(job, outputs, mode):
    from openai.types import CreateEmbeddingResponse

    out, result = outputs[mode]
    assert result.exit_code == 0, result.output
    reference = job["references"][mode]
    records = {r.get("custom_id", r.get("id")): r for r in read(out)}
    assert len(records) == 11  # one record per line, bad lines included
    native = {key: records[key] for key in ("n0", "line-2", "n0-base64", "tok")}
    for key, text in (("n0", TEXTS[0]), ("line-2", TEXTS[1]), ("tok", TEXTS[3])):
        record = native[key]
        assert set(record) == {"id", "line", "embedding", "usage", "error"} and record["error"] is None
        assert cosine(record["embedding"], reference[text]) >= MIN_COSINE, key
    # the same text on a base64 line: the same vector (bit for bit: test_base64_and_float_are_the_same_float32s)
    np.testing.assert_allclose(from_base64(native["n0-base64"]["embedding"]), native["n0"]["embedding"], rtol=1e-6)
    assert native["n0"]["usage"]["prompt_tokens"] == native["n0"]["usage"]["total_tokens"] > 0
    assert native["n0"]["usage"]["completion_tokens"] == 0
    expected = {"o-one": [TEXTS[4]], "o-list": [TEXTS[5], TEXTS[2]], "o-ids": [TEXTS[3], None]}
    for custom_id, texts in expected.items():
        record = records[custom_id]
        assert record["id"].startswith("batch_req_line") and record["error"] is None
        assert record["response"]["status_code"] == 200
        body = record["response"]["body"]
        if body["data"] and isinstance(body["data"][0]["embedding"], str):  # the openai client decodes base64 so
            body = {**body, "data": [{**d, "embedding": from_base64(d["embedding"])} for d in body["data"]]}
        response = CreateEmbeddingResponse.model_validate(body)
        assert response.object == "list" and [d.index for d in response.data] == list(range(len(texts)))
        assert response.model == ("tiny-embed" if custom_id != "o-ids" else "nanoinfer")
        assert response.usage.total_tokens == response.usage.prompt_tokens > 0
        for data, text in zip(response.data, texts):
            if text is not None:
                assert cosine(data.embedding, reference[text]) >= MIN_COSINE, custom_id
    # token ids embed as their text, whether given on a native line or in an OpenAI list
    assert cosine(records["o-ids"]["response"]["body"]["data"][0]["embedding"], native["tok"]["embedding"]) > 0.99999


def test_bad_lines_get_error_records_and_the_others_are_intact(outputs):
    out, result = outputs["mean"]
    assert result.exit_code == 0, result.output
    records = {r.get("custom_id", r.get("id")): r for r in read(out)}
    assert records["empty"] == {"id": "empty", "line": 7, "embedding": None, "usage": None, "error": {
        "code": "empty_prompt", "message": "line 7: input is an empty text; give some text to embed."}}
    assert records["line-8"]["error"]["code"] == "invalid_json"
    chat = records["o-chat"]
    assert chat["response"]["status_code"] == 400 and chat["error"]["code"] == "unsupported_url"
    assert "`nanoinfer generate` makes" in chat["error"]["message"]
    bad = records["o-bad-input"]  # one input of a line fails: the line is an error, naming the input
    assert bad["response"]["status_code"] == 400 and bad["error"]["code"] == "out_of_vocabulary"
    assert bad["error"]["message"].startswith("line 10: input 1: ")
    summary = json.loads(result.stdout)
    assert summary["requests"] == 11 and summary["errors"] == 4 and summary["output_tokens"] == 0
    assert "done: 11 requests, 4 errors;" in result.stderr and "prompt tok/s" in result.stderr
    assert "Traceback" not in result.output


def test_flags_set_the_defaults_and_a_line_wins(job, tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(source, [
        {"id": "flags", "input": TEXTS[0]},
        {"id": "own", "input": TEXTS[0], "encoding_format": "float", "dimensions": 8, "normalize": False},
        openai_line("o", {"input": TEXTS[0], "encoding_format": "float"}),
    ])
    result = invoke(source, "-o", out, "--model", job["model"], *ENGINE_ARGS, "--pooling", "mean", "--no-normalize",
                    "--embedding-format", "base64", "--dimensions", "16")
    assert result.exit_code == 0, result.output
    records = {r.get("custom_id", r.get("id")): r for r in read(out)}
    flags = from_base64(records["flags"]["embedding"])
    assert len(flags) == 16 and abs(np.linalg.norm(flags) - 1) > 1e-3  # --no-normalize
    reference = job["references"]["mean"][TEXTS[0]]  # normalized and full length
    assert cosine(flags, reference[:16]) >= MIN_COSINE
    assert records["own"]["embedding"] == pytest.approx(flags[:8], rel=1e-5)
    assert len(records["o"]["response"]["body"]["data"][0]["embedding"]) == 16


# ---- resume -----------------------------------------------------------------------------------------------------
def by_key(records) -> dict:
    return {r.get("custom_id", r.get("id")): r for r in records}


def assert_same_records(resumed: list[dict], reference: list[dict]) -> None:
    resumed, reference = by_key(resumed), by_key(reference)
    assert set(resumed) == set(reference) and len(resumed) == len(reference)
    for key, record in reference.items():
        if "embedding" in record and record["embedding"] is not None and isinstance(record["embedding"], list):
            assert cosine(resumed[key]["embedding"], record["embedding"]) >= MIN_COSINE
        assert resumed[key]["error"] == record["error"], key


def test_resume_cuts_a_torn_line_and_finishes_without_duplicates(job, outputs, tmp_path):
    reference_out, _ = outputs["mean"]
    out = tmp_path / "out.jsonl"
    whole = reference_out.read_bytes().split(b"\n")
    out.write_bytes(b"\n".join(whole[:3]) + b"\n" + whole[3][:17])  # three records, then a write cut short
    shutil.copy(manifest_path(reference_out), manifest_path(out))
    result = invoke(job["source"], "-o", out, "--resume", "--model", job["folders"]["mean"], *ENGINE_ARGS)
    assert result.exit_code == 0, result.output
    assert "resuming" in result.output and "cut 17 bytes" in result.output
    assert "(+3 from an earlier run)" in result.output
    assert_same_records(read(out), read(reference_out))


def test_sigterm_stops_cleanly_and_resume_completes(job, outputs, tmp_path, monkeypatch):
    reference_out, _ = outputs["mean"]
    out = tmp_path / "out.jsonl"
    load = embed_cli.load_llm

    def stopped_at_the_third_step(config):
        llm = load(config)
        step, steps = llm.step, itertools.count(1)

        def step_then_maybe_signal():
            if next(steps) == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # the job finishes this step, writes its records, stops
            return step()

        llm.step = step_then_maybe_signal
        return llm

    monkeypatch.setattr(embed_cli, "load_llm", stopped_at_the_third_step)
    # One request in the engine at a time: each step finishes at most one line.
    args = ["--model", job["folders"]["mean"], *ENGINE_ARGS, "--max-in-flight", "1"]
    result = invoke(job["source"], "-o", out, *args)
    assert result.exit_code == 143, result.output
    assert "SIGTERM: stopped." in result.output and "--resume" in result.output
    written = read(out)  # no torn line
    assert 3 <= len(written) < 11
    monkeypatch.setattr(embed_cli, "load_llm", load)
    result = invoke(job["source"], "-o", out, "--resume", *args)
    assert result.exit_code == 0, result.output
    assert f"(+{len(written)} from an earlier run)" in result.output
    assert_same_records(read(out), read(reference_out))


def test_resume_refuses_another_pooling_or_input(job, outputs, tmp_path, no_model_load):
    reference_out, _ = outputs["mean"]
    out = tmp_path / "out.jsonl"
    shutil.copy(reference_out, out)
    shutil.copy(manifest_path(reference_out), manifest_path(out))
    result = invoke(job["source"], "-o", out, "--resume", "--model", job["folders"]["mean"], *ENGINE_ARGS,
                    "--pooling", "cls")
    assert result.exit_code == 2 and "'pooling_type': 'mean'" in result.output and "'cls'" in result.output
    other = tmp_path / "in.jsonl"
    write_lines(other, [{"input": "another"}])
    result = invoke(other, "-o", out, "--resume", "--model", job["folders"]["mean"], *ENGINE_ARGS)
    assert result.exit_code == 2 and "the input changed" in result.output
    assert "Traceback" not in result.output


# ---- refused before any model loads -----------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["--embedding-format", "hex"], "--embedding-format must be one of float, base64, got 'hex'"),
    (["--dimensions", "0"], "--dimensions must be >= 1"),
    (["--dimensions", "65"], "--dimensions 65 is more than the 64 dimensions"),
    (["--pooling", "max"], "pooling_type = 'max'"),
    (["--resume", "--overwrite"], "contradict"),
    (["--max-line-bytes", "0"], "--max-line-bytes must be >= 1"),
])
def test_bad_flags_exit_2_before_loading(job, tmp_path, no_model_load, args, message):
    out = tmp_path / "out.jsonl"
    result = invoke(job["source"], "-o", out, "--model", job["model"], *ENGINE_ARGS, *args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not out.exists()


def test_embed_always_runs_the_pooling_runner_with_the_folders_pooling(job, tmp_path, monkeypatch):
    configs = []

    def capture(config):
        configs.append(config)
        raise KeyboardInterrupt  # only the Config is looked at

    monkeypatch.setattr(embed_cli, "load_llm", capture)
    (tmp_path / "engine.yaml").write_text("runner: generate\n")
    result = invoke(job["source"], "-o", tmp_path / "out.jsonl", "--model", job["folders"]["cls"], *ENGINE_ARGS,
                    "--config", tmp_path / "engine.yaml")
    assert result.exit_code == 130 and "interrupted before embedding started" in result.output
    assert (configs[0].runner, configs[0].pooling_type, configs[0].normalize) == ("pooling", "cls", False)
    assert invoke(job["source"], "-o", "-", "--runner", "generate").exit_code == 2  # not a flag of embed


# ---- lines, without a model ---------------------------------------------------------------------------------------
def parse(*lines, defaults=None):
    raw = [(line if isinstance(line, str) else json.dumps(line)).encode() for line in lines]
    defaults = defaults or {"dimensions": None, "encoding_format": "float"}
    return list(BatchReader(raw, defaults, parse=parse_embedding))


def test_line_problems_get_their_own_codes():
    items = parse(
        {"prompt": "a generation line"},
        {"input": ["two", "texts"]},
        {"input": "x", "dimensions": 0},
        {"input": "x", "encoding_format": "hex"},
        {"input": "x", "temperature": 0},
        openai_line("o1", {"input": []}),
        openai_line("o2", {"input": ["x"] * 2049}),
        openai_line("o3", {"input": "x", "stream": True}),
        {"custom_id": "o4", "method": "GET", "url": "/v1/embeddings", "body": {"input": "x"}},
        openai_line("o5", {"input": ["x", 3]}),
    )
    codes = [item.code for item in items]
    assert codes == ["missing_input", "invalid_input", "invalid_pooling_params", "invalid_encoding_format",
                     "unknown_field", "empty_prompt", "too_many_inputs", "unknown_field", "unsupported_method",
                     "invalid_input"]
    assert '"input"' in items[0].message and "OpenAI batch lines" in items[1].message


def test_lines_become_requests_with_the_job_defaults_and_their_own_fields():
    native, openai = parse({"input": [1, 2, 3], "normalize": False},
                           openai_line("o", {"input": ["a", [4, 5]], "dimensions": 4, "model": "m"}),
                           defaults={"dimensions": 8, "encoding_format": "base64"})
    assert (native.id, native.inputs, native.encoding_format) == ("line-1", [[1, 2, 3]], "base64")
    assert (native.params.dimensions, native.params.normalize) == (8, False)
    assert (openai.id, openai.inputs, openai.params.dimensions, openai.model) == ("o", ["a", [4, 5]], 4, "m")


def test_base64_and_float_are_the_same_float32s():
    vector = torch.randn(64, generator=torch.Generator().manual_seed(0)).tolist()
    floats, text = encode_embedding(vector, "float"), encode_embedding(vector, "base64")
    exact = np.asarray(vector, dtype="<f4")
    assert np.array_equal(np.frombuffer(base64.b64decode(text), dtype="<f4"), exact)
    assert np.array_equal(np.asarray(json.loads(json.dumps(floats)), dtype="<f4"), exact)  # through JSON text
    assert max(len(repr(f)) for f in floats) <= 16  # a float32's shortest decimal, not a double's 17+ digits


def test_generate_points_embeddings_lines_at_embed():
    raw = [json.dumps(openai_line("e", {"input": "x"})).encode()]
    (error,) = BatchReader(raw, {"max_tokens": 4})
    assert error.code == "unsupported_url" and "`nanoinfer embed`" in error.message


def test_help_documents_formats_defaults_and_exit_codes():
    result = runner.invoke(app, ["embed", "--help"], terminal_width=200)
    assert result.exit_code == 0
    for words in ('"input"', "/v1/embeddings", "--pooling", "--normalize", "--embedding-format", "--dimensions",
                  "sentence-transformers config", "--resume", "130/143"):
        assert words in result.output, words
    assert "--runner" not in result.output
