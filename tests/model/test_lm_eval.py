"""The lm-evaluation-harness backend (nanoinfer.lm_eval) against lm-eval's own `hf` backend on a tiny model.

Same per-sample results as `--model hf` (float32: loglikelihoods within 1e-3, greedy generations equal) for the three
request kinds, through lm_eval.simple_evaluate and through `python -m nanoinfer.lm_eval`; requests sharing a context
compute it once; model_args errors name the fix. Local tasks only (tests/model/lm_eval_tasks): CI has no hub.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("lm_eval")

import lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from nanoinfer.errors import ConfigError  # noqa: E402
from nanoinfer.lm_eval import NanoInferLM, engine_settings, main  # noqa: E402
from nanoinfer.testing.tiny_models import build_tiny_model  # noqa: E402

TASKS_SOURCE = Path(__file__).parent / "lm_eval_tasks"
TASKS = ["nanoinfer_gen", "nanoinfer_mc", "nanoinfer_rolling"]
# 64 tokens: some multiple-choice contexts are left-truncated, the long texts take several rolling windows, and
# generation contexts are cut to 64 - max_gen_toks (24) tokens, on both backends alike.
MAX_LENGTH = 64
NANOINFER_ARGS = f"dtype=float32,max_length={MAX_LENGTH},max_model_len=256,cpu_kvcache_space_gib=0.25,max_num_seqs=8"
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("lm-eval") / "llama")


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """The task YAMLs with their data_files made absolute (the repository's copies are relative to its root)."""
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    for source in TASKS_SOURCE.glob("*.yaml"):
        task = yaml.safe_load(source.read_text())
        data = task["dataset_kwargs"]["data_files"]["test"]
        task["dataset_kwargs"]["data_files"]["test"] = str(TASKS_SOURCE / Path(data).name)
        (folder / source.name).write_text(yaml.safe_dump(task))
    return folder


def evaluate(model: str, model_args: str, task_dir: Path, **kwargs) -> dict:
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS, log_samples=True,
                                   task_manager=TaskManager(include_path=str(task_dir)), **kwargs)  # fmt: skip


@pytest.fixture(scope="module")
def hf_results(model_dir, task_dir):
    # batch_size 1: no padding, so HF's numbers are those of each sequence alone
    return evaluate("hf", f"pretrained={model_dir},dtype=float32,max_length={MAX_LENGTH}", task_dir,
                    device="cpu", batch_size=1)  # fmt: skip


@pytest.fixture(scope="module")
def lm(model_dir):
    return get_model("nanoinfer").create_from_arg_string(f"pretrained={model_dir},{NANOINFER_ARGS}")


def responses(samples: list[dict]) -> dict[int, list]:
    """doc_id -> the response of each of its requests: (logprob, is_greedy), a rolling logprob, or a text."""
    return {sample["doc_id"]: [resp[0] for resp in sample["resps"]] for sample in samples}


def assert_same_responses(ours: dict[str, list[dict]], theirs: dict[str, list[dict]]) -> None:
    for task in TASKS:
        ours_by_doc, theirs_by_doc = responses(ours[task]), responses(theirs[task])
        assert ours_by_doc.keys() == theirs_by_doc.keys(), task
        for doc_id, expected in theirs_by_doc.items():
            for got, want in zip(ours_by_doc[doc_id], expected, strict=True):
                where = f"{task} doc {doc_id}"
                if isinstance(want, str):
                    assert got == want, where
                elif isinstance(want, (list, tuple)):  # a samples file holds the numbers as text: "-5.9", "False"
                    assert abs(float(got[0]) - want[0]) <= TOLERANCE, (where, got, want)
                    assert str(got[1]) == str(want[1]), (where, got, want)
                else:
                    assert abs(float(got) - want) <= TOLERANCE, (where, got, want)


def test_importing_registers_nanoinfer_beside_lm_evals_own_backends():
    assert get_model("nanoinfer") is NanoInferLM
    assert get_model("hf").__name__ == "HFLM"  # registering first must not hide the built-in ones


def test_python_api_gives_hf_backends_per_sample_results(model_dir, task_dir, hf_results):
    ours = evaluate("nanoinfer", f"pretrained={model_dir},{NANOINFER_ARGS}", task_dir)
    assert_same_responses(ours["samples"], hf_results["samples"])
    assert len(ours["samples"]["nanoinfer_mc"]) == 10 and len(ours["samples"]["nanoinfer_rolling"]) == 5
    assert ours["results"]["nanoinfer_mc"]["acc,none"] == hf_results["results"]["nanoinfer_mc"]["acc,none"]


@pytest.mark.timeout(180)
def test_command_line_gives_hf_backends_per_sample_results(model_dir, task_dir, hf_results, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    command = [sys.executable, "-m", "nanoinfer.lm_eval", "--model", "nanoinfer",
               "--model_args", f"pretrained={model_dir},{NANOINFER_ARGS}", "--tasks", ",".join(TASKS),
               "--include_path", str(task_dir), "--output_path", str(tmp_path / "out"), "--log_samples"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=170)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "prompt tokens submitted" in result.stderr  # our logger's line about the prefix cache
    ours = {}
    for task in TASKS:
        (path,) = (tmp_path / "out").rglob(f"samples_{task}_*.jsonl")
        ours[task] = [json.loads(line) for line in path.read_text().splitlines()]
    assert_same_responses(ours, hf_results["samples"])


def test_apply_chat_template_gives_hf_backends_prompts_and_results(model_dir, task_dir, lm):
    kwargs = dict(apply_chat_template=True, limit=3)
    ours = evaluate(lm, None, task_dir, **kwargs)
    theirs = evaluate("hf", f"pretrained={model_dir},dtype=float32,max_length={MAX_LENGTH}", task_dir,
                      device="cpu", batch_size=1, **kwargs)  # fmt: skip
    for task in ("nanoinfer_gen", "nanoinfer_mc"):
        prompts = [s["arguments"][0][0] for s in ours["samples"][task]]
        assert all(p.startswith("<|im_start|>user\n") for p in prompts), prompts
        assert prompts == [s["arguments"][0][0] for s in theirs["samples"][task]]
    assert_same_responses({t: ours["samples"][t] for t in TASKS}, theirs["samples"])
    assert lm.tokenizer_name and lm.chat_template(True) == lm.tokenizer.chat_template


def test_continuing_the_last_message_cuts_after_its_text(lm):
    """lm-eval asks add_generation_prompt=False for an assistant prefix (gen_prefix): transformers'
    continue_final_message, which nanoinfer's tokenizer leaves to us."""
    chat = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "The answer is"}]
    assert lm.apply_chat_template(chat, add_generation_prompt=False).endswith("<|im_start|>assistant\nThe answer is")
    assert lm.apply_chat_template(chat[:1]).endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_requests_sharing_a_context_compute_it_once(model_dir):
    words = "the quick brown fox jumps over lazy dog paris capital france berlin germany rome italy".split()
    shared = "Answer the question. " + " ".join(words)  # every context starts alike: one partial-block key
    requests = []
    for g in range(8):
        context = f"{shared}\nQuestion {g}: is {words[g]} {words[-g - 1]} or {words[g + 3]}?\nAnswer:"
        requests += [Instance("loglikelihood", {}, (context, f" {w}"), 0) for w in words[g : g + 4]]
    args = dict(pretrained=str(model_dir), dtype="float32", max_model_len=512, cpu_kvcache_space_gib=0.25,
                max_num_seqs=16)  # fmt: skip
    shared_lm = NanoInferLM(**args)
    unshared_lm = NanoInferLM(**args, enable_prefix_caching="false")  # a string, as lm-eval may hand it over
    got, expected = shared_lm.loglikelihood(requests), unshared_lm.loglikelihood(requests)
    for (logprob, is_greedy), (want_logprob, want_greedy) in zip(got, expected, strict=True):
        assert abs(logprob - want_logprob) <= 1e-4 and is_greedy == want_greedy
    counts = shared_lm.last_token_counts
    assert unshared_lm.last_token_counts == {**counts, "computed": counts["submitted"]}
    # Each context once (its leader), then each continuation and the context's last token again (its logits score
    # the continuation's first token). Leaders may take more from each other's shared start.
    pairs = [shared_lm._encode_pair(*r.args) for r in requests]
    contexts = {tuple(context) for context, _ in pairs}
    at_most = sum(map(len, contexts)) + sum(len(continuation) + 1 for _, continuation in pairs)
    assert counts["requests"] == 32 and counts["computed"] <= at_most < counts["submitted"] / 2


def test_generation_kwargs_map_as_lm_evals_hf_backend(lm):
    params, until = lm._sampling_params({"until": "Q:", "do_sample": False, "temperature": 0.7, "max_gen_toks": 5},
                                        "<|im_end|>")  # fmt: skip
    assert (params.temperature, params.max_tokens, params.stop, until) == (0.0, 5, ["Q:", "<|im_end|>"],
                                                                            ["Q:", "<|im_end|>"])  # fmt: skip
    params, _ = lm._sampling_params({"temperature": 0.5}, "")  # no do_sample: a temperature samples
    assert (params.temperature, params.max_tokens) == (0.5, 256)
    params, _ = lm._sampling_params({"do_sample": True, "temperature": 0.8, "top_p": 0.9, "top_k": 10, "seed": 3,
                                     "max_new_tokens": 7}, "")  # fmt: skip
    assert (params.temperature, params.top_p, params.top_k, params.seed, params.max_tokens) == (0.8, 0.9, 10, 3, 7)


def test_until_cuts_the_greedy_text_at_its_first_occurrence(lm):
    context = "Q: What is the capital of France?\nA:"
    (free,) = lm.generate_until([Instance("generate_until", {}, (context, {"until": [], "max_gen_toks": 16}), 0)])
    assert len(free) > 4
    stop = free[3:5]  # occurs in the text, perhaps earlier than at 3 too
    (cut,) = lm.generate_until([Instance("generate_until", {}, (context, {"until": [stop], "max_gen_toks": 16}), 0)])
    assert cut == free[: free.index(stop)]


def test_seeded_sampling_repeats(lm):
    kwargs = {"do_sample": True, "temperature": 1.0, "seed": 7, "max_gen_toks": 12, "until": []}
    requests = [Instance("generate_until", {}, ("Once upon a time", kwargs), 0) for _ in range(2)]
    first, second = lm.generate_until(requests)
    assert first == second and first


def test_unknown_model_arg_is_a_config_error_naming_the_valid_keys(model_dir, task_dir, capsys):
    model_args = f"pretrained={model_dir},max_num_seq=4"
    with pytest.raises(ConfigError) as excinfo:
        evaluate("nanoinfer", model_args, task_dir)
    message = str(excinfo.value)
    assert "unknown --model_args key(s) max_num_seq (did you mean max_num_seqs?)" in message
    assert "Valid keys: pretrained, max_length" in message and "max_model_len" in message
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "nanoinfer", "--model_args", model_args, "--tasks", "nanoinfer_mc",
              "--include_path", str(task_dir)])  # fmt: skip
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "did you mean max_num_seqs?" in err and "Traceback" not in err


def test_model_args_are_parsed_into_config_types_and_checked():
    values = engine_settings("m", "cuda:0", None, {"max_num_seqs": "8", "enable_prefix_caching": "false",
                                                   "cpu_kvcache_space_gib": 1, "dtype": "float32"})  # fmt: skip
    expected = {"max_num_seqs": 8, "enable_prefix_caching": False, "cpu_kvcache_space_gib": 1.0, "dtype": "float32",
                "model": "m"}  # fmt: skip
    import torch

    assert values == {**expected, "device": "cuda" if torch.cuda.is_available() else "auto"}
    with pytest.raises(ConfigError, match="tokenizer = 'x': is not supported"):
        engine_settings("m", None, "x", {})
    with pytest.raises(ConfigError, match="must be cpu, cuda or cuda:0"):
        engine_settings("m", "cuda:3", None, {})


def test_a_max_length_the_engine_cannot_hold_names_the_fix(model_dir):
    with pytest.raises(ConfigError, match="raise max_model_len to 302"):
        NanoInferLM(pretrained=str(model_dir), max_model_len=256, max_length=300)


def test_peft_adapter_gives_hf_backends_per_sample_results(model_dir, task_dir, tmp_path):
    """`peft=FOLDER` (HFLM's model_arg): every request under the adapter, as lm-eval's hf backend with PEFT runs it."""
    from nanoinfer.testing.tiny_lora import build_tiny_adapter

    adapter = build_tiny_adapter(model_dir, tmp_path / "adapter", rank=8, seed=3,
                                 target_modules=("q_proj", "v_proj", "gate_proj", "down_proj"))  # fmt: skip
    theirs = evaluate("hf", f"pretrained={model_dir},peft={adapter},dtype=float32,max_length={MAX_LENGTH}",
                      task_dir, device="cpu", batch_size=1)  # fmt: skip
    ours = evaluate("nanoinfer", f"pretrained={model_dir},peft={adapter},{NANOINFER_ARGS}", task_dir)
    assert_same_responses(ours["samples"], theirs["samples"])
    base = evaluate("nanoinfer", f"pretrained={model_dir},{NANOINFER_ARGS}", task_dir)
    assert responses(base["samples"]["nanoinfer_rolling"]) != responses(ours["samples"]["nanoinfer_rolling"])
