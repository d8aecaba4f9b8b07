"""Tensor parallelism over gloo on CPU: TP=2 computes what TP=1 computes, and worker processes always end
with the engine (normal exit, an exception in rank 0, a killed worker, Ctrl-C, a killed rank 0).

Lifecycle tests run a driver script (or `nanoinfer generate`) in a subprocess whose environment carries a
unique tag; every process it starts inherits the tag, so "no orphans" means no live process in /proc has it.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from nanoinfer import LLM, SamplingParams
from nanoinfer.engine.scheduler import SchedulerOutput
from nanoinfer.engine.sequence import Request
from nanoinfer.errors import NanoInferError
from nanoinfer.testing.tiny_models import build_tiny_model

NUM_PROMPTS = 16
NUM_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
# 16 prompts x 2 blocks of 256 tokens: room for the longest prompt (300) plus 32 new tokens each.
ENGINE = {"device": "cpu", "dtype": "float32", "max_model_len": 512, "num_kvcache_blocks": 32, "num_threads": 2}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-models")
    return {family: build_tiny_model(family, root / family) for family in TP_FAMILIES}


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Mixed lengths (3..300 tokens): prefills cross the 256-token block boundary."""
    rng = random.Random(seed)
    lengths = [3, 7, 12, 20, 33, 47, 64, 90, 128, 150, 200, 230, 255, 256, 257, 300]
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def first_step(prompts: list[list[int]], block_size: int, loras=None) -> SchedulerOutput:
    """Every prompt's whole prefill in one step, each sequence in its own blocks (under loras[i], if given)."""
    out = SchedulerOutput()
    next_block = 0
    for i, prompt in enumerate(prompts):
        seq = Request(f"p{i}", prompt, GREEDY, lora_request=loras[i] if loras else None).sequences[0]
        num_blocks = -(-len(prompt) // block_size)
        seq.block_table = list(range(next_block, next_block + num_blocks))
        seq.state_slot = i  # a hybrid model's state slot (read only by linear-attention layers)
        next_block += num_blocks
        out.scheduled.append((seq, len(prompt)))
    return out


@pytest.fixture(scope="module")
def sharded_llms(model_dirs):
    """The TP=2 LLM of a family; one at a time, as a process holds one torch.distributed group."""
    current = {}

    def get(family: str, **settings) -> LLM:
        key = (family, *sorted(settings.items()))
        if key not in current:
            for llm in current.values():
                llm.engine.close()
            current.clear()
            current[key] = LLM(str(model_dirs[family]), tensor_parallel_size=2, **ENGINE, **settings)
        return current[key]

    yield get
    for llm in current.values():
        llm.engine.close()


# Gemma 2: soft caps and windows on sharded heads; Phi-3: fused checkpoint projections split per rank; OLMo 2: q/k
# norms over the whole projection, gathered from the ranks; Qwen3-MoE: every expert's intermediate dimension split,
# the weighted sum over experts all-reduced; gpt-oss: attention sinks split with their heads, expert biases added once;
# Qwen3-Next, Qwen3.5: linear-attention key and value heads split with their convolution channels, decays and states
# (Qwen3-Next's projections grouped by key head, Qwen3.5's flat), gated attention heads with their gates.
TP_FAMILIES = ("qwen3", "llama", "gemma2", "phi3", "olmo2", "qwen3_moe", "gpt_oss", "qwen3_next", "qwen3_5")


@pytest.mark.parametrize("family", TP_FAMILIES)
def test_tp2_matches_tp1_logits_and_greedy_tokens(model_dirs, sharded_llms, family):
    single = LLM(str(model_dirs[family]), **ENGINE)
    sharded = sharded_llms(family)
    prompts = make_prompts(single.config.hf_config.vocab_size)
    out = first_step(prompts, single.config.kvcache_block_size)
    expected = single.engine.model_runner.compute_logits(out)
    logits = sharded.engine.model_runner.compute_logits(out)
    assert logits.shape == expected.shape == (NUM_PROMPTS, single.config.hf_config.vocab_size)
    # Only the order of the partial sums differs (all-reduce over two shards).
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)

    want = [o.token_ids for o in single.generate(prompts, GREEDY)]
    got = [o.token_ids for o in sharded.generate(prompts, GREEDY)]
    assert all(len(t) == NUM_TOKENS for t in got)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a == b, f"prompt {i} ({len(prompts[i])} tokens): TP=2 diverged from TP=1"


def test_structured_output_under_tp2_is_valid_and_equals_tp1(model_dirs, sharded_llms):
    """The grammar mask is applied on rank 0's gathered logits: the same tokens as one rank, all valid."""
    schema = {"type": "object", "properties": {"k": {"enum": ["red", "green"]}, "n": {"type": "integer",
              "minimum": 0, "maximum": 99}}, "required": ["k", "n"]}
    params = [SamplingParams(temperature=t, seed=3, n=2, max_tokens=40, structured_outputs={"json": schema})
              for t in (0.0, 1.0)]
    params.append(SamplingParams(temperature=0, max_tokens=20, structured_outputs={"regex": "[ab]{4}"}))
    single = LLM(str(model_dirs["qwen3"]), **ENGINE)
    prompts = make_prompts(single.config.hf_config.vocab_size)[:3]
    want = single.generate(prompts, params)
    got = sharded_llms("qwen3").generate(prompts, params)
    num_stopped = 0
    for a, b, p in zip(got, want, params):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        for c in a.outputs:
            if c.finish_reason == "stop":
                num_stopped += 1
                if p.structured_outputs.kind == "json":
                    assert json.loads(c.text)["k"] in ("red", "green")
                else:
                    assert re.fullmatch("[ab]{4}", c.text)
    assert num_stopped >= 3


def run_all(llm: LLM, requests) -> list:
    """(prompt, params, prompt_logprobs_start) requests at once; outputs in their order."""
    ids = [llm.add_request(p, params, prompt_logprobs_start=start) for p, params, start in requests]
    outputs = {}
    while llm.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in llm.step()[0])
    return [outputs[i] for i in ids]


def test_prompt_logprobs_under_tp2_equal_tp1_with_shared_context_rows(model_dirs, sharded_llms):
    """Rank 0 reads prompt logprobs from the gathered logits; rows shared inside a block are copied on every rank."""
    single = LLM(str(model_dirs["qwen3"]), **ENGINE)
    sharded = sharded_llms("qwen3")
    prompts = make_prompts(single.config.hf_config.vocab_size, seed=5)
    context, tails = prompts[-1], prompts[:4]
    score = SamplingParams(max_tokens=0, prompt_logprobs=2)
    results = []
    for llm in (single, sharded):
        leader = run_all(llm, [(context + tails[0], score, len(context))])
        results.append(leader + run_all(llm, [(context + t, score, len(context)) for t in tails[1:]]))
    for a, b in zip(*results):
        assert b.num_cached_tokens == a.num_cached_tokens
        for x, y in zip(a.prompt_logprobs[len(context):], b.prompt_logprobs[len(context):]):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-5
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
    assert [o.num_cached_tokens for o in results[1][1:]] == [len(context) - 1] * 3
    # Every logprob of long prompts beside generated tokens: more prompt rows than one chunk of logits (256), read
    # chunk by chunk on rank 0 while the workers' all-gathers pair with its own.
    batch = [(p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1), 1)
             for p in prompts[-3:]]  # fmt: skip
    want, got = run_all(single, batch), run_all(sharded, batch)
    assert sum(len(p) - 1 for p, _, _ in batch) > 256
    for a, b in zip(want, got):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])) < 1e-5


def test_embeddings_under_tp2_equal_tp1(model_dirs, sharded_llms):
    pooling = {"runner": "pooling", "pooling_type": "mean"}
    single = LLM(str(model_dirs["llama"]), **ENGINE, **pooling)
    prompts = make_prompts(single.config.hf_config.vocab_size, seed=6)[::3]
    want = single.embed(prompts)
    got = sharded_llms("llama", **pooling).embed(prompts)
    for a, b in zip(want, got):
        torch.testing.assert_close(torch.tensor(b.outputs.embedding), torch.tensor(a.outputs.embedding),
                                   atol=1e-5, rtol=0)  # fmt: skip


@pytest.mark.parametrize("family, targets", [
    ("llama", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    ("phi3", ("qkv_proj", "gate_up_proj", "o_proj", "down_proj")),  # fused targets: one A, B split by rows per rank
])  # fmt: skip
def test_lora_under_tp2_equals_tp1(model_dirs, sharded_llms, tmp_path, family, targets):
    """Column-parallel layers shard B by output rows, row-parallel ones A by input columns (their partial deltas join
    the base output's all-reduce): logits and greedy tokens of a mixed batch equal one rank's."""
    from nanoinfer import LoRARequest
    from nanoinfer.testing.tiny_lora import build_tiny_adapter

    model = model_dirs[family]
    loras = [None] + [LoRARequest(f"a{i}", i, str(build_tiny_adapter(model, tmp_path / f"a{i}", rank=4 * i,
                                                                     target_modules=targets, seed=i)))
                      for i in (1, 2)]  # fmt: skip
    lora_settings = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
    single = LLM(str(model), **ENGINE, **lora_settings)
    sharded = sharded_llms(family, **lora_settings)
    prompts = make_prompts(single.config.hf_config.vocab_size, seed=4)
    choice = [loras[i % 3] for i in range(len(prompts))]
    out = first_step(prompts, single.config.kvcache_block_size, choice)
    expected = single.engine.model_runner.compute_logits(out)
    torch.testing.assert_close(sharded.engine.model_runner.compute_logits(out), expected, atol=1e-5, rtol=0)
    want = [o.token_ids for o in single.generate(prompts, GREEDY, lora_request=choice)]
    assert [o.token_ids for o in sharded.generate(prompts, GREEDY, lora_request=choice)] == want
    base = [o.token_ids for o in single.generate(prompts, GREEDY)]
    assert all(w != b for w, b, c in zip(want, base, choice) if c is not None)


def test_warm_up_and_reallocation_of_a_hybrid_model_reach_every_rank(sharded_llms):
    """What CUDA memory planning does, on a hybrid model's TP=2 executor: a warm-up pass (one state slot a
    warm-up sequence), then a cache of other sizes, state slots included, on every rank."""
    sharded = sharded_llms("qwen3_5")
    before = sharded.generate("The capital of France is", GREEDY)[0].token_ids
    executor = sharded.engine.model_runner
    executor.warmup()
    # A cache of another size; as many slots as the engine's block manager hands out (it was planned with them).
    num_slots = sharded.engine.block_manager.num_state_slots
    executor.allocate_kv_cache(40, num_slots)
    assert (executor.num_blocks, executor.num_state_slots) == (40, num_slots)
    assert sharded.generate("The capital of France is", GREEDY)[0].token_ids == before


def test_kv_cache_reallocation_reaches_every_rank(sharded_llms):
    sharded = sharded_llms("llama")
    before = sharded.generate("The capital of France is", GREEDY)[0].token_ids
    sharded.engine.model_runner.allocate_kv_cache(40)  # what CUDA memory planning does after warm-up
    assert sharded.engine.model_runner.num_blocks == 40
    assert sharded.generate("The capital of France is", GREEDY)[0].token_ids == before


def test_exception_in_rank0_mid_step_stops_the_workers(sharded_llms, monkeypatch):
    # The workers are then blocked in a collective that rank 0 will never join: the engine must stop them.
    sharded = sharded_llms("llama")
    executor = sharded.engine.model_runner
    pids = executor.worker_pids

    def broken_mlp(x):
        raise ValueError("bug in rank 0")

    monkeypatch.setattr(executor.model.model.layers[1].mlp, "forward", broken_mlp)
    with pytest.raises(ValueError, match="bug in rank 0"):
        sharded.generate("The capital of France is", GREEDY)
    assert not [pid for pid in pids if _is_alive(pid)]
    with pytest.raises(NanoInferError, match="closed"):
        executor.compute_logits(first_step([[1, 2, 3]], 256))


# ---- lifecycle ----------------------------------------------------------------------------------------------
# Generates once, then idles until the test creates ./go (so waiting drivers leave the CPU to the others),
# then generates until it is stopped.
DRIVER = """
import json, os, signal, sys, time
# A terminal's process has the default Ctrl-C handler; a child of pytest inherits whatever pytest's SIGINT
# disposition was at Popen time (SIG_IGN survives exec), which once made this driver deaf to SIGINT in a
# full run. Set it before nanoinfer is imported, so anything nanoinfer does to it still shows.
signal.signal(signal.SIGINT, signal.default_int_handler)
from nanoinfer import LLM, SamplingParams
from nanoinfer.errors import NanoInferError

llm = LLM(sys.argv[1], tensor_parallel_size=2, **json.loads(sys.argv[2]))
print("PIDS", *llm.engine.model_runner.worker_pids, flush=True)
params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
try:
    for i in range(100_000):
        llm.generate(["The capital of France is"] * 4, params)
        print("STEP", i, flush=True)
        while not os.path.exists("go"):
            time.sleep(0.05)
except NanoInferError as e:  # what the CLI does: the message, no traceback, exit 2
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
"""
NUM_CLI_LINES = 8
CLI_FLAGS = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "512", "--num-kvcache-blocks", "32",
             "--temperature", "0", "--max-tokens", "8", "--ignore-eos", "--quiet"]


class Scenario:
    """A subprocess whose environment carries a unique tag, with its output in files (no pipe to fill up)."""

    def __init__(self, folder: Path, argv: list[str]):
        folder.mkdir()
        self.folder = folder
        self.tag = uuid.uuid4().hex
        self.stdout_path, self.stderr_path = folder / "stdout.txt", folder / "stderr.txt"
        env = {**os.environ, "NANOINFER_TEST_TAG": self.tag}
        with open(self.stdout_path, "w") as out, open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env, cwd=folder)

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text()

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def wait_for(self, text: str, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.stdout:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"never printed {text!r}; stderr:\n{self.stderr}")
            time.sleep(0.1)

    def run(self) -> None:
        """Let a driver loop, and return once it is busy generating."""
        self.wait_for("STEP 0")
        (self.folder / "go").touch()
        self.wait_for("STEP 2")

    def worker_pids(self) -> list[int]:
        self.wait_for("PIDS")
        line = next(line for line in self.stdout.splitlines() if line.startswith("PIDS"))
        return [int(pid) for pid in line.split()[1:]]

    def wait(self, timeout: float = 300.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"still running after {timeout} s; stderr:\n{self.stderr}")

    def assert_no_processes_left(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while (left := _tagged_processes(self.tag)) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in left:  # do not leak them into the rest of the session
            os.kill(pid, signal.SIGKILL)
        assert not left, f"processes left behind: {left}"


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory, model_dirs):
    """All subprocesses, started together: each spends most of its time importing torch and spawning its
    worker, which overlaps well on 2 cores (one after another, this file takes a minute longer)."""
    root = tmp_path_factory.mktemp("scenarios")
    model = str(model_dirs["qwen3"])
    driver = [sys.executable, "-c", DRIVER, model, json.dumps(ENGINE)]
    (root / "prompts.jsonl").write_text("".join(
        json.dumps({"prompt": f"The capital of country {i} is"}) + "\n" for i in range(NUM_CLI_LINES)
    ))
    cli = [sys.executable, "-m", "nanoinfer", "generate", str(root / "prompts.jsonl"), "-o", "out.jsonl",
           "--model", model, "--tensor-parallel-size", "2", *CLI_FLAGS]
    started = {name: Scenario(root / name, argv) for name, argv in (
        ("kill_rank0", driver), ("sigint", driver), ("kill_worker", driver), ("cli", cli),
    )}
    yield started
    for scenario in started.values():
        if scenario.proc.poll() is None:
            scenario.proc.kill()
            scenario.proc.wait()


def test_killed_rank0_leaves_no_processes(scenarios):
    s = scenarios["kill_rank0"]
    s.run()
    s.proc.kill()  # no atexit, no close(): the workers' watchdog must notice on its own
    s.wait()
    s.assert_no_processes_left()


def test_sigint_on_rank0_leaves_no_processes(scenarios):
    s = scenarios["sigint"]
    s.run()
    s.proc.send_signal(signal.SIGINT)
    assert s.wait() != 0
    assert "KeyboardInterrupt" in s.stderr
    s.assert_no_processes_left()


def test_killed_worker_makes_rank0_fail_within_seconds_with_message(scenarios):
    s = scenarios["kill_worker"]
    (worker,) = s.worker_pids()
    s.run()
    os.kill(worker, signal.SIGKILL)
    start = time.monotonic()
    code = s.wait()
    assert time.monotonic() - start < 10
    assert code == 2
    assert f"tensor-parallel worker rank 1 (pid {worker}) was killed by signal SIGKILL during a step" in s.stderr
    assert "Traceback" not in s.stderr
    s.assert_no_processes_left()


def test_cli_generate_with_tensor_parallel_size_2_end_to_end(scenarios):
    s = scenarios["cli"]
    assert s.wait() == 0, s.stderr
    records = [json.loads(line) for line in (s.folder / "out.jsonl").read_text().splitlines()]
    assert len(records) == NUM_CLI_LINES
    assert all(r["error"] is None and r["usage"]["completion_tokens"] == 8 for r in records)
    s.assert_no_processes_left()  # a normal exit: atexit closes the executor


def _is_alive(pid: int) -> bool:
    """True for a running process; a zombie (exited, not yet reaped) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _tagged_processes(tag: str) -> list[int]:
    needle = f"NANOINFER_TEST_TAG={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0") and _is_alive(int(entry.name)):
            found.append(int(entry.name))
    return found
