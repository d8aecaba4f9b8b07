"""`nanoinfer generate` through Typer's CliRunner: file-level problems exit 2 before any model loads, the
resume manifest refuses a changed job, --overwrite / --resume / --json, progress output, signals."""

from __future__ import annotations

import io
import json
import os
import shlex
import signal
from collections import deque

import pytest
import torch
from typer.testing import CliRunner

from nanoinfer.cli import app
from nanoinfer.cli import generate as generate_cli
from nanoinfer.engine.engine import StepStats
from nanoinfer.outputs import CompletionOutput, RequestOutput
from nanoinfer.progress import JobProgress
from nanoinfer.testing.tiny_models import build_tiny_model

runner = CliRunner()
ENGINE_ARGS = shlex.split(
    "--device cpu --max-model-len 256 --kvcache-block-size 256 --cpu-kvcache-space-gib 0.02 "
    "--temperature 0 --max-tokens 3 --quiet"
)
PROMPTS = [
    {"id": f"q{i}", "prompt": p} for i, p in enumerate(["Hello", "Paris is", "Once upon a time", "def"])
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    threads = torch.get_num_threads()  # the engine sets torch's thread count; give it back afterwards
    yield str(build_tiny_model("qwen3", tmp_path_factory.mktemp("model") / "qwen3"))
    torch.set_num_threads(threads)


@pytest.fixture
def files(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return source, tmp_path / "out.jsonl"


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(config):
        raise AssertionError("the model was loaded although the job should have been refused first")

    monkeypatch.setattr(generate_cli, "load_llm", refuse)


def invoke(*args: str):
    return runner.invoke(app, ["generate", *map(str, args)])


def read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---- file-level problems: exit 2, a clear message, no model loaded, nothing written -------------------------------
def assert_refused(result, *words: str) -> None:
    assert result.exit_code == 2, result.output
    for word in words:
        assert word in result.output
    assert "Traceback" not in result.output


def test_missing_input_exits_2_before_loading(tmp_path, tiny_model, no_model_load):
    result = invoke(tmp_path / "nope.jsonl", "-o", tmp_path / "out.jsonl", "--model", tiny_model)
    assert_refused(result, "nope.jsonl does not exist")
    assert not (tmp_path / "out.jsonl").exists()


def test_output_equal_to_input_exits_2(files, tiny_model, no_model_load):
    source, _ = files
    for flag in ([], ["--overwrite"]):
        assert_refused(invoke(source, "-o", source, "--model", tiny_model, *flag), "is the input file")
    assert len(read(source)) == len(PROMPTS)  # the prompts are untouched


def test_existing_output_needs_resume_or_overwrite(files, tiny_model, no_model_load):
    source, out = files
    out.write_text("precious\n")
    assert_refused(
        invoke(source, "-o", out, "--model", tiny_model), "already exists", "--resume", "--overwrite"
    )
    assert out.read_text() == "precious\n"


@pytest.mark.parametrize("yaml, words", [
    ("max_num_seqs: 0\ngpu_memory_utilisation: 0.5\n", ("max_num_seqs", "gpu_memory_utilisation")),  # every one
    ("runner: pooling\npooling_type: mean\n", ("runner", "nanoinfer embed")),  # an embedding config
])  # fmt: skip
def test_invalid_config_exits_2_with_every_problem(files, tiny_model, no_model_load, yaml, words):
    source, out = files
    config = source.parent / "engine.yaml"
    config.write_text(yaml)
    result = invoke(source, "-o", out, "--config", config, "--model", tiny_model)
    assert_refused(result, *words)
    assert not out.exists()


def test_bad_sampling_flag_exits_2(files, tiny_model, no_model_load):
    source, out = files
    assert_refused(
        invoke(source, "-o", out, "--model", tiny_model, "--temperature", "-1"), "temperature must"
    )


def test_resume_and_overwrite_together_exit_2(files, tiny_model, no_model_load):
    source, out = files
    assert_refused(invoke(source, "-o", out, "--model", tiny_model, "--resume", "--overwrite"), "contradict")


def test_missing_output_folder_exits_2(files, tiny_model, no_model_load):
    source, out = files
    assert_refused(
        invoke(source, "-o", out.parent / "nope" / "out.jsonl", "--model", tiny_model), "does not exist"
    )


def test_resume_without_manifest_is_refused(files, tiny_model, no_model_load):
    source, out = files
    out.write_text('{"id": "q0", "line": 1}\n')
    assert_refused(invoke(source, "-o", out, "--model", tiny_model, "--resume"), "manifest", "--overwrite")


# ---- resume and overwrite ---------------------------------------------------------------------------------------
def test_a_large_job_waits_for_the_cpu_kernels_unless_cpu_kernels_is_set(tmp_path, tiny_model, monkeypatch):
    configs = []

    def capture(config):
        configs.append(config)
        raise KeyboardInterrupt  # stop before anything is generated: only the Config is looked at

    monkeypatch.setattr(generate_cli, "load_llm", capture)
    source = tmp_path / "in.jsonl"
    # 64 non-blank lines x the default max_tokens 256 = 16,384 output tokens: large. Blank lines do not count.
    source.write_text("".join(json.dumps({"prompt": f"p {i}"}) + "\n\n" for i in range(64)))
    (tmp_path / "kernels.yaml").write_text(f"model: {tiny_model}\ncpu_kernels: auto\n")
    cases = [
        ([], "wait"),
        (["--max-tokens", "255"], "auto"),  # 64 x 255 < 16,384
        (["--cpu-kernels", "off"], "off"),
        (["--config", tmp_path / "kernels.yaml"], "auto"),
    ]
    for args, expected in cases:
        result = invoke(source, "-o", "-", "--model", tiny_model, "--device", "cpu", *args)
        assert result.exit_code == 130, result.output
        assert configs[-1].cpu_kernels == expected, args
    assert generate_cli.engine_defaults(None, 10_000) == {}  # stdin: not counted in advance
    assert generate_cli.engine_defaults(64, 256) == {"cpu_kernels": "wait"}


def test_cpu_kernels_is_checked_with_the_other_settings(files, tiny_model, no_model_load):
    source, out = files
    result = invoke(source, "-o", out, "--model", tiny_model, "--cpu-kernels", "fast")
    assert_refused(result, "cpu_kernels = 'fast': must be one of auto, wait, off")


def test_resume_refuses_a_changed_input_model_or_setting(files, tiny_model, tmp_path):
    source, out = files
    assert invoke(source, "-o", out, "--model", tiny_model, *ENGINE_ARGS).exit_code == 0
    before = out.read_bytes()
    other_model = str(build_tiny_model("llama", tmp_path / "llama"))
    result = invoke(
        source, "-o", out, "--resume", "--model", tiny_model, *ENGINE_ARGS, "--max-model-len", "128"
    )
    assert_refused(result, "max_model_len was 256", "is 128", "--max-model-len 256")
    result = invoke(source, "-o", out, "--resume", "--model", other_model, *ENGINE_ARGS)
    assert_refused(result, "the model changed")
    result = invoke(source, "-o", out, "--resume", "--model", tiny_model, *ENGINE_ARGS, "--top-k", "5")
    assert_refused(result, "sampling defaults changed")
    with open(source, "a") as f:
        f.write(json.dumps({"prompt": "one more"}) + "\n")
    result = invoke(source, "-o", out, "--resume", "--model", tiny_model, *ENGINE_ARGS)
    assert_refused(result, "the input changed", "sha256")
    assert out.read_bytes() == before  # a refused resume touches nothing


def test_resume_may_change_speed_settings(files, tiny_model):
    source, out = files
    assert invoke(source, "-o", out, "--model", tiny_model, *ENGINE_ARGS).exit_code == 0
    result = invoke(source, "-o", out, "--resume", "--model", tiny_model, *ENGINE_ARGS, "--max-num-seqs", "2")
    assert result.exit_code == 0, result.output
    assert "0 requests (+4 from an earlier run)" in result.output
    assert len(read(out)) == len(PROMPTS)


def test_resume_cuts_a_torn_line_and_finishes_without_duplicates(files, tiny_model):
    source, out = files
    assert invoke(source, "-o", out, "--model", tiny_model, *ENGINE_ARGS).exit_code == 0
    complete = read(out)
    data = out.read_bytes()
    first_two = data.split(b"\n", 2)
    out.write_bytes(first_two[0] + b"\n" + first_two[1] + b"\n" + first_two[2][:17])  # kill -9 mid-line
    result = invoke(source, "-o", out, "--resume", "--model", tiny_model, *ENGINE_ARGS)
    assert result.exit_code == 0, result.output
    assert "cut 17 bytes" in result.output
    resumed = read(out)
    assert sorted(r["id"] for r in resumed) == sorted(p["id"] for p in PROMPTS)
    assert {r["id"]: r["text"] for r in resumed} == {r["id"]: r["text"] for r in complete}


def test_resume_of_a_missing_output_starts_the_job(files, tiny_model):
    source, out = files
    result = invoke(source, "-o", out, "--resume", "--model", tiny_model, *ENGINE_ARGS)
    assert result.exit_code == 0, result.output
    assert len(read(out)) == len(PROMPTS)


def test_overwrite_replaces_the_output_and_its_manifest(files, tiny_model):
    source, out = files
    out.write_text('{"id": "stale", "line": 99}\n')
    result = invoke(source, "-o", out, "--overwrite", "--model", tiny_model, *ENGINE_ARGS)
    assert result.exit_code == 0, result.output
    assert "stale" not in out.read_text() and len(read(out)) == len(PROMPTS)
    manifest = json.loads((out.parent / "out.jsonl.manifest.json").read_text())
    assert manifest["input"]["num_lines"] == len(PROMPTS)
    assert manifest["result_fields"] == {"max_model_len": 256, "dtype": "float32", "seed": 0,
                                         "reasoning_parser": "auto", "tool_call_parser": "auto"}


# ---- summary and progress --------------------------------------------------------------------------------------
def test_json_summary_goes_to_stdout(files, tiny_model):
    source, out = files
    result = invoke(source, "-o", out, "--model", tiny_model, *ENGINE_ARGS, "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["requests"] == len(PROMPTS) and summary["errors"] == 0 and summary["total"] == len(PROMPTS)
    assert summary["output_tokens"] == sum(r["usage"]["completion_tokens"] for r in read(out))
    assert summary["output"] == str(out)
    assert "done: 4 requests, 0 errors" in result.stderr


def test_speculation_writes_the_same_records_and_says_how_much_it_kept(files, tiny_model, tmp_path):
    """--num-speculative-tokens: the same texts as plain greedy decoding; the summary counts the proposed
    tokens and the kept ones (a random tiny model loops, so proposals happen)."""
    source, out = files
    args = [*ENGINE_ARGS[:-3], "--max-tokens", "40", "--ignore-eos", "--quiet"]  # greedy, 40 tokens each
    plain = invoke(source, "-o", out, "--model", tiny_model, *args, "--json")
    assert plain.exit_code == 0, plain.output
    speculated_out = tmp_path / "speculated.jsonl"
    result = invoke(source, "-o", speculated_out, "--model", tiny_model, *args, "--num-speculative-tokens", "3",
                    "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    texts = {r["id"]: r["text"] for r in read(out)}  # records come in the order requests finish
    assert {r["id"]: r["text"] for r in read(speculated_out)} == texts and len(texts) == len(PROMPTS)
    summary = json.loads(result.stdout)
    assert summary["speculative_tokens_proposed"] >= summary["speculative_tokens_kept"] > 0
    assert json.loads(plain.stdout)["speculative_tokens_proposed"] == 0
    assert f"speculation kept {summary['speculative_tokens_kept']:,} of" in result.stderr


def test_plain_progress_logs_periodic_lines():
    stream = io.StringIO()
    with JobProgress(total=10, num_skipped=2, plain=True, stream=stream, log_seconds=0) as progress:
        progress.on_step(num_prefill_tokens=40, num_decode_tokens=0)
        progress.on_record({"prompt_tokens": 5, "completion_tokens": 3}, is_error=False)
        progress.on_record(None, is_error=True)
    lines = stream.getvalue().splitlines()
    assert lines[-1].startswith("generate: 4/10 requests, 1 errors, out ")
    assert "prefill" in lines[-1] and "ETA" in lines[-1]
    assert "\x1b[" not in stream.getvalue()  # no terminal control codes
    assert progress.summary()["output_tokens"] == 3 and progress.summary()["skipped"] == 2


def test_progress_bar_renders_requests_and_rates():
    stream = io.StringIO()
    with JobProgress(total=4, plain=False, stream=stream) as progress:
        progress.on_step(num_prefill_tokens=12, num_decode_tokens=4)
        progress.on_record({"prompt_tokens": 3, "completion_tokens": 4}, is_error=False)
    text = stream.getvalue()
    assert "1/4" in text and "tok/s" in text and "prefill" in text


# ---- signals ----------------------------------------------------------------------------------------------------
class SignallingLLM:
    """Stands in for LLM: one request finishes per step; sends itself `signum` during step `at_step`."""

    def __init__(self, config, signum: int | None = None, at_step: int = 3):
        self.config = config
        self.tokenizer = None
        self.reasoning_parser = self.tool_call_parser = self.thinking_token_ids = None  # plain-text records
        self.queue: deque[tuple[str, list[int]]] = deque()
        self.signum, self.at_step, self.num_steps = signum, at_step, 0
        self.max_prompt_chars = 10_000

    def encode(self, text):
        return [1, 2]

    def add_request(self, token_ids, params, request_id, lora_request=None, chat=False):
        self.queue.append((request_id, token_ids))

    def step(self):
        self.num_steps += 1
        if self.num_steps == self.at_step and self.signum is not None:
            os.kill(os.getpid(), self.signum)
        request_id, token_ids = self.queue.popleft()
        output = RequestOutput(request_id, None, token_ids, [CompletionOutput(0, "ok", [3], "length")])
        return [output], StepStats(0, 1, 0, 0.0)


def test_sigterm_stops_admitting_flushes_and_exits_143(files, tiny_model, monkeypatch):
    source, out = files
    monkeypatch.setattr(
        generate_cli, "load_llm", lambda config: SignallingLLM(config, signal.SIGTERM, at_step=2)
    )
    result = invoke(source, "-o", out, "--model", tiny_model, "--quiet")
    assert result.exit_code == 143, result.output
    assert "SIGTERM: stopped. 2 of 4 records" in result.output and "--resume" in result.output
    assert [r["id"] for r in read(out)] == ["q0", "q1"]  # the step under way finished and was written
    monkeypatch.setattr(generate_cli, "load_llm", lambda config: SignallingLLM(config))
    result = invoke(source, "-o", out, "--model", tiny_model, "--quiet", "--resume")
    assert result.exit_code == 0, result.output
    assert [r["id"] for r in read(out)] == ["q0", "q1", "q2", "q3"]


def test_second_interrupt_exits_at_once(monkeypatch):
    exits = []
    monkeypatch.setattr(generate_cli.os, "_exit", exits.append)
    stopper = generate_cli.Stopper()
    stopper.started = True
    stopper._handle(signal.SIGINT, None)
    assert stopper.stopping and stopper.exit_code == 130 and exits == []
    stopper._handle(signal.SIGINT, None)
    assert exits == [130]


def test_interrupt_while_loading_exits_130_without_output(files, tiny_model, monkeypatch):
    source, out = files

    def interrupted_load(config):
        os.kill(os.getpid(), signal.SIGINT)
        raise AssertionError("the handler should have raised")

    monkeypatch.setattr(generate_cli, "load_llm", interrupted_load)
    result = invoke(source, "-o", out, "--model", tiny_model)
    assert result.exit_code == 130
    assert "interrupted before generation started" in result.output
    assert not out.exists()


def test_help_documents_formats_resume_and_exit_codes():
    result = runner.invoke(app, ["generate", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for words in ("prompt_token_ids", "custom_id", "--resume", "max_tokens defaults to 256", "130/143"):
        assert words in result.output
