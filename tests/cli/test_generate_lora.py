"""`nanoinfer generate` with LoRA adapters: a native line's "lora" and an OpenAI line's body.model select an adapter,
many in one job, and every record equals transformers + PEFT for its adapter (greedy, float32); an unknown name is
that line's error record; `loras:` in the YAML file; check-config reports every bad adapter at once; a job killed
mid-run resumes to the same records, and its manifest refuses a changed adapter."""

from __future__ import annotations

import json
import random
import shlex
import signal

import pytest
import torch
from factories import count_lines, start_generate, wait_for
from transformers import AutoTokenizer
from typer.testing import CliRunner

from nanoinfer.cli import app
from nanoinfer.cli import generate as generate_cli
from nanoinfer.testing.tiny_lora import build_tiny_adapter, peft_greedy
from nanoinfer.testing.tiny_models import build_tiny_model

runner = CliRunner()
NUM_TOKENS = 16
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# name -> (rank, targets): three ranks, every projection adapted by one of them
ADAPTERS = {"support": (8, ("q_proj", "v_proj")), "legal": (16, ALL_TARGETS), "terse": (4, ("o_proj", "down_proj"))}
BASE_NAME = "tiny-llama"  # an OpenAI body.model that names no adapter: the base model
ENGINE_FLAGS = shlex.split(
    f"--device cpu --max-model-len 256 --kvcache-block-size 256 --cpu-kvcache-space-gib 0.05 --max-lora-rank 16 "
    f"--temperature 0 --max-tokens {NUM_TOKENS} --ignore-eos --quiet"
)
CHAT = [{"role": "user", "content": "Paris is the capital of which country?"}]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny llama, three PEFT adapters of it, and the --lora flags naming them."""
    threads = torch.get_num_threads()  # the engine sets torch's thread count; give it back afterwards
    root = tmp_path_factory.mktemp("lora_jobs")
    model = build_tiny_model("llama", root / "llama", seed=0)
    adapters = {
        name: str(build_tiny_adapter(model, root / name, rank=rank, target_modules=targets, seed=seed))
        for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items(), start=1)
    }
    lora_flags = [arg for name, path in adapters.items() for arg in ("--lora", f"{name}={path}")]
    yield {"root": root, "model": str(model), "adapters": adapters, "lora_flags": lora_flags}
    torch.set_num_threads(threads)


def make_prompts(n: int, seed: int, lengths=(5, 9, 17, 40, 70, 120)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def references(setup, prompts: list[list[int]], choice: list[str | None]) -> list[list[int]]:
    """The reference tokens of prompt i under adapter choice[i] (None: the base model)."""
    expected = [None] * len(prompts)
    for name in set(choice):
        rows = [i for i, c in enumerate(choice) if c == name]
        path = setup["adapters"][name] if name is not None else None
        for i, tokens in zip(rows, peft_greedy(setup["model"], path, [prompts[i] for i in rows], NUM_TOKENS)):
            expected[i] = tokens
    return expected


def text_of(setup, token_ids: list[int]) -> str:
    """The text a record carries for these tokens (special tokens skipped, as SamplingParams' default)."""
    return AutoTokenizer.from_pretrained(setup["model"]).decode(token_ids, skip_special_tokens=True)


def write_lines(path, lines: list[dict]) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def generate(source, out, *flags):
    return runner.invoke(app, ["generate", str(source), "-o", str(out), *map(str, flags), *ENGINE_FLAGS])


def by_key(records: list[dict]) -> dict:
    """Records by id (native) or custom_id (OpenAI), without OpenAI's creation time."""
    keyed = {}
    for record in records:
        record = json.loads(json.dumps(record))
        if "custom_id" in record:
            record["response"]["body"].pop("created", None)
            keyed[record["custom_id"]] = record
        else:
            keyed[record["id"]] = record
    return keyed


def native_tokens(record: dict) -> list[int]:
    return [entry["token_id"] for entry in record["logprobs"]]


# ---- every record equals transformers + PEFT for its adapter -------------------------------------------------------
def test_interleaved_adapters_and_base_equal_peft(setup, tmp_path):
    prompts = make_prompts(12, seed=0)
    names = [*ADAPTERS, None]
    native_choice = [names[i % 4] for i in range(len(prompts))]  # support, legal, terse, base, support, ...
    lines = []
    for i, (prompt, name) in enumerate(zip(prompts, native_choice)):
        lines.append({"id": f"n{i}", "prompt_token_ids": prompt, "logprobs": 0} | ({"lora": name} if name else {}))
    # OpenAI completions lines (token-id prompts) and one chat line, interleaved with the native ones
    completions = make_prompts(4, seed=1, lengths=(7, 30, 64, 11))
    completion_models = ["terse", BASE_NAME, "support", "legal"]
    for i, (prompt, model) in enumerate(zip(completions, completion_models)):
        lines.insert(3 * i + 1, {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                 "body": {"model": model, "prompt": prompt}})  # fmt: skip
    lines.append({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "legal", "messages": CHAT}})  # fmt: skip
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(source, lines)

    result = generate(source, out, "--model", setup["model"], *setup["lora_flags"])
    assert result.exit_code == 0, result.output
    records = by_key(read(out))
    assert len(records) == len(lines) and all(r["error"] is None for r in records.values())

    tok = AutoTokenizer.from_pretrained(setup["model"])
    chat_prompt = tok(tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True))["input_ids"]
    choice = [*native_choice, *[m if m in ADAPTERS else None for m in completion_models], "legal"]
    expected = references(setup, [*prompts, *completions, chat_prompt], choice)
    for i, name in enumerate(native_choice):
        record = records[f"n{i}"]
        assert native_tokens(record) == expected[i], (i, name)
        assert record["text"] == text_of(setup, expected[i])
        assert record.get("lora", "absent") == (name or "absent")  # only a line that used an adapter names one
    for i, model in enumerate(completion_models):
        body = records[f"c{i}"]["response"]["body"]
        assert body["choices"][0]["text"] == text_of(setup, expected[len(prompts) + i]), (i, model)
        assert body["model"] == model  # the adapter's name when one ran, else the model the line named
        assert body["usage"]["completion_tokens"] == NUM_TOKENS
    chat = records["chat"]["response"]["body"]
    assert chat["usage"]["prompt_tokens"] == len(chat_prompt)
    assert chat["choices"][0]["message"]["content"] == text_of(setup, expected[-1]) and chat["model"] == "legal"

    # Each adapter changes what the model says: the comparisons above could not pass with adapters ignored.
    base = references(setup, [*prompts, *completions, chat_prompt], [None] * len(choice))
    for name in ADAPTERS:
        assert any(e != b for e, b, c in zip(expected, base, choice) if c == name), name


# ---- unknown names -------------------------------------------------------------------------------------------------
def test_unknown_adapter_is_that_lines_error_and_other_lines_run(setup, tmp_path):
    prompts = make_prompts(4, seed=2)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(source, [
        {"id": "ok", "prompt_token_ids": prompts[0], "lora": "support", "logprobs": 0},
        {"id": "typo", "prompt_token_ids": prompts[1], "lora": "suport"},
        {"id": "number", "prompt_token_ids": prompts[1], "lora": 7},
        {"id": "null", "prompt_token_ids": prompts[2], "lora": None, "logprobs": 0},  # null: the base model
        {"custom_id": "other-model", "method": "POST", "url": "/v1/completions",
         "body": {"model": "gpt-4o-mini", "prompt": prompts[3]}},
    ])  # fmt: skip
    result = generate(source, out, "--model", setup["model"], "--lora", f"support={setup['adapters']['support']}",
                      "--lora", f"terse={setup['adapters']['terse']}")  # fmt: skip
    assert result.exit_code == 0, result.output
    records = by_key(read(out))
    typo = records["typo"]["error"]
    assert typo["code"] == "unknown_lora"
    assert typo["message"] == ("line 2: lora 'suport' is not one of this job's LoRA adapters (support, terse). Add it "
                               "with --lora suport=PATH (or under `loras:` in the config file).")  # fmt: skip
    assert records["number"]["error"]["code"] == "invalid_lora" and "got 7" in records["number"]["error"]["message"]
    expected = references(setup, prompts[:4], ["support", None, None, None])
    assert native_tokens(records["ok"]) == expected[0] and records["ok"]["lora"] == "support"
    assert native_tokens(records["null"]) == expected[2] and "lora" not in records["null"]
    body = records["other-model"]["response"]["body"]
    assert body["model"] == "gpt-4o-mini" and body["choices"][0]["text"] == text_of(setup, expected[3])


def test_lora_in_a_job_without_adapters_says_how_to_add_one(setup, tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(source, [{"id": "a", "prompt": "Hello", "lora": "support"}, {"id": "b", "prompt": "Hello"}])
    result = generate(source, out, "--model", setup["model"])
    assert result.exit_code == 0, result.output
    records = by_key(read(out))
    assert records["a"]["error"]["code"] == "unknown_lora"
    assert "this job has none" in records["a"]["error"]["message"]
    assert "--lora support=PATH" in records["a"]["error"]["message"]
    assert records["b"]["error"] is None and records["b"]["usage"]["completion_tokens"] == NUM_TOKENS


# ---- the YAML file -------------------------------------------------------------------------------------------------
def test_yaml_loras_select_adapters_as_the_flag_does(setup, tmp_path):
    prompts = make_prompts(3, seed=3)
    source = tmp_path / "in.jsonl"
    write_lines(source, [{"id": f"p{i}", "prompt_token_ids": p, "lora": name, "logprobs": 0}
                         for i, (p, name) in enumerate(zip(prompts, ["terse", "legal", "terse"]))])  # fmt: skip
    config = tmp_path / "engine.yaml"
    config.write_text("loras:\n" + "".join(f"  {name}: {path}\n" for name, path in setup["adapters"].items()))
    result = generate(source, tmp_path / "out.jsonl", "--model", setup["model"], "--config", config)
    assert result.exit_code == 0, result.output
    records = by_key(read(tmp_path / "out.jsonl"))
    expected = references(setup, prompts, ["terse", "legal", "terse"])
    assert [native_tokens(records[f"p{i}"]) for i in range(3)] == expected
    assert [records[f"p{i}"]["lora"] for i in range(3)] == ["terse", "legal", "terse"]


# ---- check-config --------------------------------------------------------------------------------------------------
def test_check_config_reports_every_bad_adapter_at_once(setup, tmp_path):
    missing = tmp_path / "no-such-adapter"
    flags = ["--model", setup["model"], "--device", "cpu", "--max-lora-rank", "8",
             "--lora", f"support={setup['adapters']['support']}",  # rank 8: fine
             "--lora", f"legal={setup['adapters']['legal']}",  # rank 16, over --max-lora-rank 8
             "--lora", f"gone={missing}"]  # fmt: skip
    result = runner.invoke(app, ["check-config", *flags], env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert "2 problem(s) in the configuration" in result.output
    assert f"{missing} is not a folder" in result.output
    assert "rank 16, over max_lora_rank 8" in result.output and "--max-lora-rank 16" in result.output
    assert "Traceback" not in result.output

    result = runner.invoke(app, ["check-config", *flags, "--json"])
    assert result.exit_code == 2
    report = json.loads(result.output)
    assert [(p["field"], p["value"]) for p in report["problems"]] == [
        ("loras", {"legal": setup["adapters"]["legal"]}), ("loras", {"gone": str(missing)})]
    assert [(a["name"], len(a["problems"])) for a in report["loras"]] == [("support", 0), ("legal", 1), ("gone", 1)]


def test_check_config_lists_the_adapters_it_checked(setup):
    flags = ["--model", setup["model"], "--device", "cpu", *setup["lora_flags"]]
    result = runner.invoke(app, ["check-config", *flags], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "LoRA adapters (3, each checked against the model):" in result.output
    assert f"legal: rank 16, adapts down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj " \
           f"({setup['adapters']['legal']})" in result.output
    result = runner.invoke(app, ["check-config", *flags, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert [(a["name"], a["rank"], a["targets"], a["problems"]) for a in report["loras"]] == [
        ("support", 8, ["q_proj", "v_proj"], []),
        ("legal", 16, sorted(ALL_TARGETS), []),
        ("terse", 4, ["down_proj", "o_proj"], []),
    ]


# ---- resume --------------------------------------------------------------------------------------------------------
def resume_job(setup, root):
    """An input of 40 lines over three adapters and the base model (native and OpenAI), and its flags."""
    prompts = make_prompts(40, seed=4, lengths=(6, 13, 29))
    names = [*ADAPTERS, None]
    lines = []
    for i, prompt in enumerate(prompts):
        name = names[i % 4]
        if i % 5 == 4:
            lines.append({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                          "body": {"model": name or BASE_NAME, "prompt": prompt}})  # fmt: skip
        else:
            lines.append({"id": f"n{i}", "prompt_token_ids": prompt} | ({"lora": name} if name else {}))
    source = root / "in.jsonl"
    write_lines(source, lines)
    # max_num_seqs 2 keeps records coming out steadily, so the kill lands mid-job.
    flags = ["--model", setup["model"], *setup["lora_flags"], "--max-num-seqs", "2", "--num-threads", "1"]
    return source, flags


def test_killed_job_resumes_to_the_uninterrupted_records(setup, tmp_path):
    source, flags = resume_job(setup, tmp_path)
    reference = tmp_path / "reference.jsonl"
    result = generate(source, reference, *flags)
    assert result.exit_code == 0, result.output
    expected = by_key(read(reference))
    asked = {line["id"]: line["lora"] for line in read(source) if "lora" in line}
    assert len(expected) == 40 and {key: r["lora"] for key, r in expected.items() if "lora" in r} == asked

    out = tmp_path / "out.jsonl"
    proc = start_generate(source, out, *flags, *ENGINE_FLAGS)
    wait_for(proc, lambda: count_lines(out) >= 6)
    proc.kill()
    assert proc.wait() == -signal.SIGKILL, proc.stderr.read().decode()
    assert 6 <= count_lines(out) < 40  # killed mid-job

    result = generate(source, out, *flags, "--resume")
    assert result.exit_code == 0, result.output
    records = read(out)
    assert len(records) == 40  # each line answered once
    assert by_key(records) == expected


def test_resume_refuses_a_changed_adapter(setup, tmp_path, monkeypatch):
    source, flags = resume_job(setup, tmp_path)
    source.write_text(source.read_text().splitlines()[0] + "\n")
    out = tmp_path / "out.jsonl"
    assert generate(source, out, *flags).exit_code == 0

    def refuse(config):
        raise AssertionError("the model was loaded although the job should have been refused first")

    monkeypatch.setattr(generate_cli, "load_llm", refuse)
    swapped = [f.replace(setup["adapters"]["support"], setup["adapters"]["terse"]) if f.startswith("support=") else f
               for f in flags]  # fmt: skip
    result = generate(source, out, *swapped, "--resume")
    assert result.exit_code == 2, result.output
    assert f"LoRA adapter support changed: the output was started with {setup['adapters']['support']}" in result.output
    dropped = flags[: flags.index("--lora")] + flags[flags.index("--lora") + 2 :]  # support left out
    result = generate(source, out, *dropped, "--resume")
    assert result.exit_code == 2
    assert "were named when the output was started and are not now (pass --lora support=" in result.output
