"""`nanoinfer bench` on a tiny model and workload: exact token counts, the JSON schema, --compare hf,
random weights for a config-only folder, and the errors a user can fix (exit 2, no traceback)."""

import json
import math
import re

import pytest
from transformers import Qwen3Config
from typer.testing import CliRunner

from nanoinfer.bench import make_workload
from nanoinfer.cli import app
from nanoinfer.testing.tiny_models import build_tiny_model

runner = CliRunner()
WIDE = {"COLUMNS": "200"}  # rich wraps table cells at 80 columns otherwise
# A workload small enough for CI: 5 requests, 3..9 prompt tokens, 2..7 output tokens.
TINY = ["--num-requests", "5", "--input-len", "3", "9", "--output-len", "2", "7", "--seed", "3",
        "--cpu-kvcache-space-gib", "0.01", "--max-model-len", "64", "--device", "cpu"]  # fmt: skip
RUN_KEYS = {"engine", "num_requests", "input_tokens", "output_tokens", "generated_tokens", "seconds",
            "prefill_seconds", "decode_seconds", "load_seconds", "ttft_seconds", "peak_rss_bytes",
            "peak_cuda_bytes", "details", "output_tok_s", "total_tok_s", "dtype"}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(build_tiny_model("qwen3", tmp_path_factory.mktemp("bench") / "tiny-qwen3"))


def bench(*args: str, env: dict | None = None):
    result = runner.invoke(app, ["bench", *args], env={**WIDE, **(env or {})})
    assert "Traceback" not in result.output, result.output
    return result


def expected_workload(vocab_size: int):
    return make_workload(5, (3, 9), (2, 7), seed=3, vocab_size=vocab_size)


def test_workload_is_seeded_and_within_the_ranges():
    a, b = make_workload(50, (3, 9), (2, 7), 1, 100), make_workload(50, (3, 9), (2, 7), 1, 100)
    assert a.prompt_token_ids == b.prompt_token_ids and a.output_lens == b.output_lens
    assert a.prompt_token_ids != make_workload(50, (3, 9), (2, 7), 2, 100).prompt_token_ids
    assert all(3 <= len(p) <= 9 and all(0 <= t < 100 for t in p) for p in a.prompt_token_ids)
    assert all(2 <= n <= 7 for n in a.output_lens)
    assert a.num_output_tokens == sum(a.output_lens) and a.num_input_tokens == sum(map(len, a.prompt_token_ids))


def test_bench_counts_exactly_the_requested_tokens_and_writes_the_json_schema(tiny_model, tmp_path):
    out = tmp_path / "run.json"
    result = bench("--model", tiny_model, *TINY, "--output-json", str(out))
    assert result.exit_code == 0, result.output
    for text in ("output tok/s", "total tok/s", "prefill time (s)", "decode time (s)", "time to first token",
                 "model load (s)", "peak memory", "nanoinfer"):  # fmt: skip
        assert text in result.output
    assert "hf-transformers" not in result.output

    report = json.loads(out.read_text())
    assert {"schema", "command", "machine", "model", "config", "notes", "workload", "engine",
            "startup_to_first_token_s", "runs", "ratio"} <= set(report)  # fmt: skip
    assert report["schema"] == "nanoinfer-bench/1"
    assert "bench" in report["command"] and "--num-requests 5" in report["command"]
    assert {"cpu", "logical_cpus", "torch_threads", "torch", "transformers", "nanoinfer_revision", "date"} <= set(
        report["machine"]
    )
    assert report["config"]["dtype"] == "float32" and report["ratio"] is None
    plan = report["engine"]["plan"]
    assert plan["num_blocks"] == report["engine"]["num_kvcache_blocks"] and plan["graph_bytes"] == 0  # CPU: none

    workload = expected_workload(report["workload"]["token_ids_below"])
    assert report["workload"]["num_requests"] == 5
    assert report["workload"]["num_input_tokens"] == workload.num_input_tokens
    assert report["workload"]["num_output_tokens"] == workload.num_output_tokens

    [run] = report["runs"]
    assert set(run) == RUN_KEYS and run["engine"] == "nanoinfer"
    assert run["num_requests"] == 5
    assert run["output_tokens"] == run["generated_tokens"] == workload.num_output_tokens  # ignore_eos, exact
    assert run["input_tokens"] == workload.num_input_tokens
    assert run["output_tok_s"] == pytest.approx(run["output_tokens"] / run["seconds"])
    assert run["total_tok_s"] == pytest.approx((run["input_tokens"] + run["output_tokens"]) / run["seconds"])
    # Every step is either prefill or decode; the rest of the wall time is adding requests and detokenizing.
    steps = run["prefill_seconds"] + run["decode_seconds"] + run["details"]["other_seconds"]
    assert steps == pytest.approx(run["seconds"])
    # All 5 prompts fit one step's token budget: one prefill step gives every first token, then the longest
    # request needs max(output_lens) - 1 decode steps.
    assert run["details"]["num_prefill_steps"] == 1
    assert run["details"]["num_decode_steps"] == max(workload.output_lens) - 1
    assert 0 < run["ttft_seconds"] <= run["seconds"]
    assert run["peak_rss_bytes"] > 0 and run["peak_cuda_bytes"] is None

    # The roofline: the same steps by class, every token counted. Each request's prompt is prefilled and each
    # output token but the last is fed back, so the steps carry input + output - requests tokens, and write the
    # KV of each. On CPU both ceilings come from the probe (only their sanity is checked, never their speed).
    assert "Roofline on" in result.output and "% = floor / time" in result.output
    roofline = report["roofline"]
    classes = roofline["classes"]
    assert list(classes)[0] == "prefill" and classes["prefill"]["steps"] == 1
    assert all(name.startswith("decode ") for name in list(classes)[1:])
    steps, shape = roofline["all_steps"], roofline["shape"]
    assert sum(c["steps"] for c in classes.values()) == steps["steps"] == 1 + run["details"]["num_decode_steps"]
    tokens = workload.num_input_tokens + workload.num_output_tokens - 5
    assert steps["tokens"] == tokens and steps["kv_write_bytes"] == tokens * shape["kv_bytes_per_token"]
    assert steps["weights_bytes"] == steps["steps"] * shape["weights_bytes"]
    assert steps["logits_bytes"] == workload.num_output_tokens * shape["logits_bytes_per_row"]  # one row a token
    ceilings = roofline["ceilings"]
    assert ceilings["bandwidth_source"] == ceilings["flops_source"] == "measured (probe)"
    assert 0 < ceilings["bandwidth_gbs"] < math.inf and 0 < ceilings["tflops"] < math.inf
    assert 0 < roofline["all_steps"]["floor_seconds"] and 0 < roofline["run"]["of_floor"]
    assert roofline["all_steps"]["seconds"] == pytest.approx(run["prefill_seconds"] + run["decode_seconds"])


def test_roofline_ceilings_from_flags_and_without_the_roofline(tiny_model, tmp_path):
    """--peak-bandwidth-gbs / --peak-tflops replace the probe (each step's floor is then exact arithmetic on the
    JSON's counts); --no-roofline leaves the section out."""
    out = tmp_path / "flags.json"
    result = bench("--model", tiny_model, *TINY, "--peak-bandwidth-gbs", "2", "--peak-tflops", "0.001",
                   "--output-json", str(out))  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "2.00 GB/s (--peak-bandwidth-gbs), 1.00 GFLOP/s (--peak-tflops)" in result.output
    roofline = json.loads(out.read_text())["roofline"]
    assert (roofline["ceilings"]["bandwidth_gbs"], roofline["ceilings"]["tflops"]) == (2.0, 0.001)
    for totals in (*roofline["classes"].values(), roofline["all_steps"]):
        assert totals["memory_floor_seconds"] == pytest.approx(totals["bytes"] / 2e9)
        assert totals["compute_floor_seconds"] == pytest.approx(totals["flops"] / 1e9)
    prefill = roofline["classes"]["prefill"]  # one step: its floor is the longer of the two
    assert prefill["floor_seconds"] == pytest.approx(max(prefill["memory_floor_seconds"],
                                                         prefill["compute_floor_seconds"]))  # fmt: skip

    out = tmp_path / "none.json"
    result = bench("--model", tiny_model, *TINY, "--no-roofline", "--output-json", str(out))
    assert result.exit_code == 0 and "Roofline" not in result.output
    assert json.loads(out.read_text())["roofline"] is None


def test_compare_hf_runs_the_same_workload_and_reports_the_ratio(tiny_model, tmp_path):
    out = tmp_path / "compare.json"
    result = bench("--model", tiny_model, *TINY, "--compare", "hf", "--hf-batch-size", "2",
                   "--output-json", str(out))  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "hf-transformers" in result.output and "ratio" in result.output

    report = json.loads(out.read_text())
    ours, hf = report["runs"]
    workload = expected_workload(report["workload"]["token_ids_below"])
    assert hf["engine"] == "hf-transformers" and hf["details"]["batch_size"] == 2
    assert hf["output_tokens"] == ours["output_tokens"] == workload.num_output_tokens
    assert hf["input_tokens"] == ours["input_tokens"]
    # Batches of 2 in submission order, each run to its longest output: the extra tokens are not counted.
    lens = workload.output_lens
    padded = sum(len(lens[i : i + 2]) * max(lens[i : i + 2]) for i in range(0, 5, 2))
    assert hf["generated_tokens"] == padded
    assert hf["details"]["wasted_tokens"] == padded - workload.num_output_tokens
    assert hf["prefill_seconds"] + hf["decode_seconds"] == pytest.approx(hf["seconds"])
    assert report["ratio"]["peer"] == "hf-transformers"
    assert report["ratio"]["output_tok_s"] == pytest.approx(ours["output_tok_s"] / hf["output_tok_s"])


def test_hf_dtype_runs_the_peer_in_another_precision_and_says_so(tiny_model, tmp_path):
    """--hf-dtype: nanoinfer in bfloat16 against HF in float32 (issue 8's target is against HF float32)."""
    out = tmp_path / "mixed.json"
    result = bench("--model", tiny_model, *TINY, "--dtype", "bfloat16", "--compare", "hf", "--hf-dtype", "float32",
                   "--output-json", str(out))  # fmt: skip
    assert result.exit_code == 0, result.output
    assert re.search(r"dtype\s*│\s*bfloat16\s*│\s*float32\s*│", result.output), result.output
    ours, hf = json.loads(out.read_text())["runs"]
    assert (ours["dtype"], hf["dtype"]) == ("bfloat16", "float32")


def test_speculation_reports_the_proposed_tokens_kept(tiny_model, tmp_path):
    """--num-speculative-tokens runs the same workload (same exact token counts) and reports how many of
    the proposed tokens the model kept; without it the row says off."""
    out = tmp_path / "run.json"
    args = ["--model", tiny_model, "--num-requests", "6", "--input-len", "3", "9", "--output-len", "40", "60",
            "--seed", "3", "--num-speculative-tokens", "3", "--output-json", str(out)]  # fmt: skip
    result = bench(*args)
    assert result.exit_code == 0, result.output
    [run] = json.loads(out.read_text())["runs"]
    details = run["details"]
    assert details["num_speculative_tokens"] == 3
    assert details["num_draft_tokens"] >= details["num_accepted_tokens"] > 0  # a random tiny model loops
    assert run["generated_tokens"] == run["output_tokens"]
    row = next(line for line in result.output.splitlines() if "speculated tokens kept" in line)
    share = details["num_accepted_tokens"] / details["num_draft_tokens"]
    assert f"{share:.0%} of {details['num_draft_tokens']:,}" in row
    plain = bench("--model", tiny_model, *TINY)
    assert "off" in next(line for line in plain.output.splitlines() if "speculated tokens kept" in line)


def test_config_only_model_folder_gets_random_weights_once(tmp_path):
    folder = tmp_path / "shape-only"
    Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=300,
                max_position_embeddings=256).save_pretrained(folder)  # fmt: skip
    env = {"NANOINFER_CACHE_DIR": str(tmp_path / "cache")}
    first = bench("--model", str(folder), *TINY, env=env)
    assert first.exit_code == 0, first.output
    assert "has no weights: using random float32 weights" in first.output
    [built] = (tmp_path / "cache" / "random-models").iterdir()
    assert (built / ".complete").is_file() and any(built.glob("*.safetensors"))
    assert json.loads((built / "config.json").read_text())["vocab_size"] == 300  # the shipped config, as is
    again = bench("--model", str(folder), *TINY, env=env)
    assert again.exit_code == 0 and "Building random" not in again.output
    assert list((tmp_path / "cache" / "random-models").iterdir()) == [built]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--input-len", "9", "3"], "--input-len 9 3 must be two lengths with 1 <= min <= max"),
        (["--num-requests", "0"], "--num-requests must be at least 1"),
        (["--output-len", "60", "60"], "Raise --max-model-len or lower --input-len / --output-len"),
        (["--compare", "vllm"], "--compare vllm is not a known peer. Use one of: hf"),
        (["--hf-batch-size", "0"], "--hf-batch-size must be at least 1"),
        (["--compare", "hf", "--hf-dtype", "int8"], "--hf-dtype int8 is not a dtype HF runs here"),
        (["--hf-dtype", "float32"], "give it with --compare hf"),
        (["--peak-tflops", "0"], "--peak-tflops must be a positive number, got 0.0"),
        (["--peak-bandwidth-gbs", "-5"], "--peak-bandwidth-gbs must be a positive number, got -5.0"),
    ],
)
def test_bad_bench_flags_exit_2_with_the_fix(tiny_model, args, message):
    result = bench("--model", tiny_model, *TINY, *args)
    assert result.exit_code == 2
    assert message in result.output
    assert "running nanoinfer" not in result.output  # checked before any model loads


def test_nanoinfer_run_frees_its_engine_before_the_peer_loads(tiny_model):
    # An engine left in a reference cycle
    # (and its KV cache) would count in the peer's peak memory. gc.get_objects() still lists uncollected
    # cycles, so this fails unless run_nanoinfer itself released the engine.
    import gc

    from nanoinfer.bench import run_nanoinfer
    from nanoinfer.config import Config
    from nanoinfer.llm import LLM

    def engines():
        return [obj for obj in gc.get_objects() if isinstance(obj, LLM)]

    before = engines()  # other tests' engines, if any (held here so their ids stay unique)
    config = Config(model=tiny_model, device="cpu", cpu_kvcache_space_gib=0.01, max_model_len=64)
    run_nanoinfer(config, make_workload(2, (3, 5), (2, 3), seed=0, vocab_size=100), warmup=False)
    assert not [obj for obj in engines() if not any(obj is old for old in before)]


def test_bench_waits_for_the_cpu_kernels_unless_told_otherwise(tiny_model):
    from nanoinfer.cli.bench import _build_config
    from nanoinfer.cli.engine_options import EngineOptions

    config, _ = _build_config(EngineOptions(None, {"model": tiny_model, "device": "cpu"}))
    assert config.cpu_kernels == "wait"  # bench measures the kernels
    config, _ = _build_config(EngineOptions(None, {"model": tiny_model, "device": "cpu", "cpu_kernels": "off"}))
    assert config.cpu_kernels == "off"
