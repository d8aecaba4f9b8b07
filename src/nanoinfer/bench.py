"""Throughput benchmark: nano-vllm's bench.py workload run through nanoinfer and, for comparison, through
Hugging Face transformers' batched `generate` on the identical requests in the same process.

Owns the workload (random prompt ids, per-request output lengths), the two timed runs, peak memory and
machine facts. Flags, tables and JSON files are `nanoinfer.cli.bench`'s job.

Fairness rules (the same as benchmarks/README.md's peer comparisons):
- Both sides get the same prompts, greedy decoding, EOS ignored, one untimed warm-up, model load excluded.
- Throughput counts *requested* output tokens only: useful output tok/s = sum(output_lens) / wall time.
- HF batch `generate` takes one `max_new_tokens` per call, so each chunk of `hf_batch_size` requests
  (in submission order, left-padded) generates max(output_lens of the chunk) tokens with
  min_new_tokens = max_new_tokens; tokens past a request's own length are computed but not counted.
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import json
import os
import platform
import random
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from nanoinfer.errors import NanoInferError

SCHEMA = "nanoinfer-bench/1"
WARMUP_PROMPT_LEN = 16
WARMUP_OUTPUT_LEN = 8


@dataclass
class Workload:
    """N requests: random prompt token ids and how many tokens each must generate (EOS ignored)."""

    prompt_token_ids: list[list[int]]
    output_lens: list[int]
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    seed: int
    vocab_size: int

    @property
    def num_requests(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_input_tokens(self) -> int:
        return sum(map(len, self.prompt_token_ids))

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def max_seq_len(self) -> int:
        return max(len(p) + n for p, n in zip(self.prompt_token_ids, self.output_lens))

    def summary(self) -> dict:
        return {
            "num_requests": self.num_requests, "input_len": list(self.input_len),
            "output_len": list(self.output_len), "seed": self.seed, "token_ids_below": self.vocab_size,
            "num_input_tokens": self.num_input_tokens, "num_output_tokens": self.num_output_tokens,
        }  # fmt: skip


def make_workload(
    num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int, vocab_size: int
) -> Workload:
    """nano-vllm's workload: prompt lengths uniform in input_len, ids uniform below vocab_size, output
    lengths uniform in output_len (both ranges inclusive), all from one seeded generator."""
    problems = []
    if num_requests < 1:
        problems.append(f"--num-requests must be at least 1, got {num_requests}.")
    for flag, (low, high) in (("--input-len", input_len), ("--output-len", output_len)):
        if not 1 <= low <= high:
            problems.append(f"{flag} {low} {high} must be two lengths with 1 <= min <= max, e.g. {flag} 32 256.")
    if problems:
        raise NanoInferError(" ".join(problems))
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab_size) for _ in range(rng.randint(*input_len))] for _ in range(num_requests)]
    outputs = [rng.randint(*output_len) for _ in range(num_requests)]
    return Workload(prompts, outputs, tuple(input_len), tuple(output_len), seed, vocab_size)


@dataclass
class RunResult:
    """One engine's timed pass over a workload. Seconds are wall-clock; throughput excludes model load."""

    engine: str
    num_requests: int
    input_tokens: int
    output_tokens: int  # requested output tokens (the ones counted)
    generated_tokens: int  # tokens the engine actually produced (HF: includes padding-length waste)
    seconds: float
    prefill_seconds: float
    decode_seconds: float
    load_seconds: float
    ttft_seconds: float | None  # timed-run start -> the first request's first token
    peak_rss_bytes: int | None
    peak_cuda_bytes: int | None = None
    details: dict = field(default_factory=dict)
    dtype: str | None = None  # the weights' and activations' dtype the engine ran in

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tok_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.seconds

    def to_dict(self) -> dict:
        return {**asdict(self), "output_tok_s": self.output_tok_s, "total_tok_s": self.total_tok_s}


# ---- peak memory ---------------------------------------------------------------------------------------
def reset_peak_memory(device: str) -> None:
    """Start a fresh peak for the next run: VmHWM via /proc/self/clear_refs (Linux), CUDA allocator stats."""
    gc.collect()  # a previous engine's tensors in reference cycles would count as this run's memory
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # "5" resets the peak RSS (VmHWM) to the current RSS
    except OSError:
        pass  # elsewhere ru_maxrss is the peak since process start: the later run's figure is an upper bound
    if device == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats()


def peak_memory(device: str) -> tuple[int | None, int | None]:
    """(peak RSS bytes since the last reset, peak CUDA bytes allocated by torch or None)."""
    rss = None
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    rss = int(line.split()[1]) * 1024
    except OSError:
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        rss = maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes on macOS, KiB on Linux
    cuda = None
    if device == "cuda":
        import torch

        cuda = torch.cuda.max_memory_allocated()
    return rss, cuda


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


# ---- nanoinfer ------------------------------------------------------------------------------------------
def run_nanoinfer(config, workload: Workload, warmup: bool = True, on_step=None) -> tuple[RunResult, dict]:
    """Load nanoinfer with `config`, warm up, then time add_request + step() until every request is done.

    Returns the result and facts about the engine (KV-cache plan, threads, the bytes of weights a step reads).
    Steps that process any prompt tokens (mixed prefill + decode steps included) count as prefill time, pure
    decode steps as decode time; the rest of the wall time (adding requests, detokenizing) is in
    `details["other_seconds"]`. on_step, if given, gets each timed step's StepStats (the roofline's input).
    With adapters in config.loras, request i runs with the (i mod n)-th: the requests spread evenly over them (each
    adapter read and put in a slot by the warm-up, untimed).
    """
    import torch

    from nanoinfer.llm import LLM
    from nanoinfer.lora_request import lora_requests
    from nanoinfer.sampling_params import SamplingParams

    device = config.device
    reset_peak_memory(device)
    start = time.perf_counter()
    llm = LLM(config=config)
    load_seconds = time.perf_counter() - start
    plan = llm.engine.plan
    engine_info = {"kv_cache": plan.summary_line(), "num_kvcache_blocks": plan.num_blocks,
                   "torch_threads": torch.get_num_threads(), "ready_since_process_start_s": process_age(),
                   "plan": asdict(plan)}  # where the memory went: weights, activations, graphs  # fmt: skip
    if config.tensor_parallel_size == 1:  # else rank 0 holds a shard: the roofline counts from the config
        from nanoinfer.roofline import expert_bytes, weights_read_bytes

        engine_info["weights_read_bytes"] = weights_read_bytes(llm.engine.model_runner.model)
        engine_info["expert_bytes"] = expert_bytes(llm.engine.model_runner.model)
    loras = list(lora_requests(config.loras).values())
    if warmup:
        warm = loras or [None]
        llm.generate([[0] * WARMUP_PROMPT_LEN] * len(warm), _greedy(SamplingParams, WARMUP_OUTPUT_LEN), warm)
    params = [_greedy(SamplingParams, n) for n in workload.output_lens]

    _sync(device)
    start = time.perf_counter()
    for i, (prompt, sp) in enumerate(zip(workload.prompt_token_ids, params)):
        llm.add_request(prompt, sp, lora_request=loras[i % len(loras)] if loras else None)
    outputs, ttft = [], None
    seconds = {"prefill": 0.0, "decode": 0.0}
    steps = {"prefill": 0, "decode": 0}
    num_preempted = num_draft = num_accepted = 0
    scheduler = llm.engine.scheduler
    while llm.has_unfinished_requests():
        finished, stats = llm.step()
        kind = "prefill" if stats.num_prefill_tokens else "decode"
        seconds[kind] += stats.seconds
        steps[kind] += 1
        num_preempted += stats.num_preempted
        num_draft += stats.num_draft_tokens
        num_accepted += stats.num_accepted_tokens
        outputs += finished
        if on_step is not None:
            on_step(stats)
        if ttft is None and (finished or any(seq.num_output_tokens for seq in scheduler.running)):
            ttft = time.perf_counter() - start
    _sync(device)
    wall = time.perf_counter() - start
    peak_rss, peak_cuda = peak_memory(device)
    generated = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    llm.engine.close()  # tensor-parallel workers, if any
    del llm, scheduler  # drop both: nothing may keep the KV cache alive into the peer's run
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    result = RunResult(
        engine="nanoinfer", num_requests=len(outputs), input_tokens=workload.num_input_tokens, dtype=config.dtype,
        output_tokens=workload.num_output_tokens, generated_tokens=generated, seconds=wall,
        prefill_seconds=seconds["prefill"], decode_seconds=seconds["decode"], load_seconds=load_seconds,
        ttft_seconds=ttft, peak_rss_bytes=peak_rss, peak_cuda_bytes=peak_cuda,
        details={"num_prefill_steps": steps["prefill"], "num_decode_steps": steps["decode"], "num_loras": len(loras),
                 "num_preempted": num_preempted, "num_speculative_tokens": config.num_speculative_tokens,
                 "num_draft_tokens": num_draft, "num_accepted_tokens": num_accepted,
                 "other_seconds": wall - seconds["prefill"] - seconds["decode"]},
    )  # fmt: skip
    if generated != workload.num_output_tokens:  # ignore_eos + max_tokens: exact lengths are the contract
        raise AssertionError(f"nanoinfer generated {generated} tokens, {workload.num_output_tokens} requested")
    return result, engine_info


def _greedy(sampling_params_cls, max_tokens: int):
    return sampling_params_cls(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)


# ---- Hugging Face transformers --------------------------------------------------------------------------
def run_hf_in_own_process(
    model_dir, workload: Workload, dtype: str, device: str, batch_size: int | None = None, warmup: bool = True
) -> RunResult:
    """`run_hf` in a fresh process with this one's torch thread count: the peer runs as it does on its own.

    In the same process it would inherit nanoinfer's process-wide settings (the platform's allocator set-up made
    HF markedly faster: HF tuned by us, not HF; benchmarks/README.md).
    A NanoInferError raised there is raised here unchanged."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import torch

    context = multiprocessing.get_context("spawn")  # no fork of a process holding thread pools and a model
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        future = pool.submit(_run_hf_with_threads, torch.get_num_threads(), str(model_dir), workload, dtype, device,
                             batch_size, warmup)  # fmt: skip
        return future.result()


def _run_hf_with_threads(num_threads: int, *args) -> RunResult:
    import torch

    torch.set_num_threads(num_threads)
    return run_hf(*args)


def run_hf(
    model_dir, workload: Workload, dtype: str, device: str, batch_size: int | None = None, warmup: bool = True
) -> RunResult:
    """transformers' batched greedy `generate` over the workload in chunks of `batch_size` (default: all).

    Prefill time per chunk is chunk start -> the first logits (seen by a logits processor); the rest of
    the chunk is decode time. See the module docstring for how per-request output lengths are handled.
    """
    import torch
    import transformers

    from nanoinfer.testing.hf_reference import hf_model

    batch_size = batch_size or workload.num_requests
    if batch_size < 1:
        raise NanoInferError(f"--hf-batch-size must be at least 1, got {batch_size}.")
    transformers.utils.logging.disable_progress_bar()
    reset_peak_memory(device)
    start = time.perf_counter()
    model = hf_model(model_dir, getattr(torch, dtype)).to(device)  # a GGUF folder's file through transformers
    pad_id = _pad_token_id(model)
    load_seconds = time.perf_counter() - start
    if warmup:
        _hf_generate(model, [[0] * WARMUP_PROMPT_LEN], WARMUP_OUTPUT_LEN, pad_id, device)

    _sync(device)
    start = time.perf_counter()
    ttft, prefill, generated = None, 0.0, 0
    for first in range(0, workload.num_requests, batch_size):
        prompts = workload.prompt_token_ids[first : first + batch_size]
        max_new = max(workload.output_lens[first : first + batch_size])
        chunk_start = time.perf_counter()
        first_logits_at = _hf_generate(model, prompts, max_new, pad_id, device)
        prefill += first_logits_at - chunk_start
        ttft = first_logits_at - start if ttft is None else ttft
        generated += len(prompts) * max_new
    _sync(device)
    wall = time.perf_counter() - start
    peak_rss, peak_cuda = peak_memory(device)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return RunResult(
        engine="hf-transformers", num_requests=workload.num_requests, input_tokens=workload.num_input_tokens,
        dtype=dtype,
        output_tokens=workload.num_output_tokens, generated_tokens=generated, seconds=wall,
        prefill_seconds=prefill, decode_seconds=wall - prefill, load_seconds=load_seconds, ttft_seconds=ttft,
        peak_rss_bytes=peak_rss, peak_cuda_bytes=peak_cuda,
        details={"batch_size": batch_size, "transformers_version": transformers.__version__,
                 "wasted_tokens": generated - workload.num_output_tokens},
    )  # fmt: skip


def _pad_token_id(model) -> int:
    pad = model.generation_config.pad_token_id
    if pad is None:
        eos = model.generation_config.eos_token_id
        pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    return pad


def _hf_generate(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int, device: str) -> float:
    """Greedy, left-padded, exactly max_new_tokens per row; returns when the first logits were ready."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class FirstLogits(LogitsProcessor):
        at: float | None = None

        def __call__(self, input_ids, scores):
            if self.at is None:
                _sync(device)
                self.at = time.perf_counter()
            return scores

    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    first = FirstLogits()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens, pad_token_id=pad_id, logits_processor=LogitsProcessorList([first]),
            temperature=None, top_p=None, top_k=None,
        )  # fmt: skip
    if out.shape != (len(prompts), width + max_new_tokens):  # our invariant, not user input
        raise RuntimeError(f"HF generate returned shape {tuple(out.shape)}")
    return first.at


# ---- random-weight models for shapes we cannot download ---------------------------------------------------
def random_weight_model(config_dir: str | Path, dtype: str = "bfloat16", cache_dir: Path | None = None) -> Path:
    """A model folder with the config.json of `config_dir`, random weights and a tiny test tokenizer.

    Built once into the cache (keyed by the config's content and dtype); random weights run at the same
    speed as trained ones. The tokenizer only matters for decoding outputs: bench prompts are token ids
    drawn below the config's vocab_size.
    """
    from nanoinfer.model_source import cache_root

    config_text = (Path(config_dir) / "config.json").read_text()
    key = hashlib.sha256(f"{config_text}\n{dtype}".encode()).hexdigest()[:12]
    target = (cache_dir or cache_root() / "random-models") / f"{Path(config_dir).resolve().name}-{dtype}-{key}"
    if (target / ".complete").is_file():
        return target
    import torch
    import transformers

    from nanoinfer.testing.tiny_models import build_tokenizer

    print(
        f"Building random {dtype} weights for {config_dir} once into {target} ...",
        file=sys.stderr,
        flush=True,
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-build-"))
    try:
        config = transformers.AutoConfig.from_pretrained(str(config_dir))
        write_random_weights(config, getattr(torch, dtype), tmp)
        build_tokenizer().save_pretrained(tmp)
        shutil.copyfile(Path(config_dir) / "config.json", tmp / "config.json")  # exactly as shipped
        (tmp / ".complete").write_text(json.dumps({"config_sha256": key, "dtype": dtype}))
        if target.exists():  # a partial build from an interrupted run
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


RANDOM_SHARD_BYTES = 2 << 30


def write_random_weights(config, dtype, folder: Path) -> None:
    """Random weights for `config` written shard by shard (safetensors, with an index), named as transformers names
    its parameters: peak memory is one shard, not the model (save_pretrained of a built model holds it twice, more
    than a 24 GiB machine has for a mixture of experts). Matrices ~ N(0, initializer_range), norms 1, biases 0."""
    import torch
    import transformers
    from safetensors.torch import save_file

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    tied = getattr(model.config.get_text_config(), "tie_word_embeddings", False)
    std = getattr(config.get_text_config(), "initializer_range", 0.02)
    generator = torch.Generator().manual_seed(0)
    shard, size, weight_map = {}, 0, {}

    def flush():
        nonlocal shard, size
        if shard:
            file = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file(shard, str(folder / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
            shard, size = {}, 0

    for name, meta in model.state_dict().items():
        if tied and name.endswith("lm_head.weight"):
            continue
        if meta.dim() >= 2 and "norm" not in name:
            value = torch.empty(meta.shape).normal_(0.0, std, generator=generator).to(dtype)
        elif name.endswith("bias"):
            value = torch.zeros(meta.shape, dtype=dtype)
        else:  # norms and scales
            value = torch.ones(meta.shape, dtype=dtype)
        if size + value.nbytes > RANDOM_SHARD_BYTES:
            flush()
        shard[name] = value
        size += value.nbytes
    flush()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model.config.save_pretrained(folder)


def needs_random_weights(model_dir: Path) -> bool:
    """A folder with a config.json but no weights (e.g. configs/models/qwen3-0.6b): neither safetensors nor a GGUF
    file (the built-in default's folder holds its GGUF)."""
    return (model_dir / "config.json").is_file() and not any(model_dir.glob("*.safetensors")) \
        and not any(model_dir.glob("*.gguf"))


# ---- facts about the run --------------------------------------------------------------------------------
def process_age() -> float | None:
    """Seconds since this process started (Linux /proc), for "process start to first token"."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def source_revision() -> str | None:
    """The git commit nanoinfer runs from (`+dirty` when its tree has changes), None outside a checkout."""
    import subprocess

    root = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


def machine_info(device: str) -> dict:
    import torch
    import transformers

    from nanoinfer import __version__ as nanoinfer_version
    from nanoinfer.platforms import current_platform

    info = {
        **current_platform().describe(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "nanoinfer": nanoinfer_version,
        "nanoinfer_revision": source_revision(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info
