"""`nanoinfer bench`: throughput on nano-vllm's random-prompt workload, optionally beside HF transformers.

Picks the defaults by device, builds the Config (flag > YAML > default) and renders what
`nanoinfer.bench` measured as a rich table and, with --output-json, a JSON file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from nanoinfer.cli import app, err_console, user_errors
from nanoinfer.cli.engine_options import CHAT_FIELDS, POOLING_FIELDS, EngineOptions, engine_options
from nanoinfer.errors import NanoInferError

# Workload defaults. CUDA: nano-vllm's bench.py shape. CPU: workload W (64 requests, 32..256 in and out,
# SmolLM2-135M), the one benchmarks/README.md reports.
CUDA_DEFAULTS = {"num_requests": 256, "input_len": (100, 1024), "output_len": (100, 1024)}
CPU_DEFAULTS = {"num_requests": 64, "input_len": (32, 256), "output_len": (32, 256)}
CUDA_DEFAULT_MODEL_CONFIG = Path(__file__).resolve().parents[3] / "configs" / "models" / "qwen3-0.6b"
COMPARE_CHOICES = ("hf", "base")
HF_DTYPES = ("float32", "bfloat16", "float16")
_WORKLOAD = "Workload"
_ROOFLINE = "Roofline"


@app.command("bench")
@engine_options(exclude=("seed", "trust_remote_code", *POOLING_FIELDS, *CHAT_FIELDS))  # --seed is the workload's
def bench(
    ctx: typer.Context,
    engine: EngineOptions = None,  # @engine_options puts --config and the engine flags here
    num_requests: Annotated[
        int | None,
        typer.Option(help="Requests (default: 256 on CUDA, 64 on CPU).", rich_help_panel=_WORKLOAD),
    ] = None,
    input_len: Annotated[
        tuple[int, int] | None,
        typer.Option(
            help="Prompt lengths, min and max (default: 100 1024 on CUDA, 32 256 on CPU).",
            rich_help_panel=_WORKLOAD,
        ),
    ] = None,
    output_len: Annotated[
        tuple[int, int] | None,
        typer.Option(
            help="Output lengths, min and max (default: 100 1024 on CUDA, 32 256 on CPU).",
            rich_help_panel=_WORKLOAD,
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the random workload.", rich_help_panel=_WORKLOAD)] = 0,
    compare: Annotated[
        str | None,
        typer.Option(help="Also run a peer on the same workload: hf (transformers' generate) | base (nanoinfer "
                     "without the --lora adapters: what the adapters cost)."),
    ] = None,
    hf_batch_size: Annotated[
        int | None, typer.Option(help="Requests per HF generate call (default: all of them in one batch).")
    ] = None,
    hf_dtype: Annotated[
        str | None,
        typer.Option(help="The dtype HF runs in: float32 | bfloat16 | float16 (default: nanoinfer's dtype)."),
    ] = None,
    output_json: Annotated[Path | None, typer.Option(help="Write every number and machine facts here.")] = None,
    warmup: Annotated[bool, typer.Option(help="One short untimed generate per engine first.")] = True,
    roofline: Annotated[
        bool,
        typer.Option(help="Set each class of step against the device's floor (bytes and FLOPs vs ceilings).",
                     rich_help_panel=_ROOFLINE),
    ] = True,
    peak_bandwidth_gbs: Annotated[
        float | None,
        typer.Option(help="Memory bandwidth in GB/s for the roofline (default: the GPU table, or a probe on CPU).",
                     rich_help_panel=_ROOFLINE),
    ] = None,
    peak_tflops: Annotated[
        float | None,
        typer.Option(help="Dense matrix rate in TFLOP/s for the roofline (default: the GPU table, or a probe).",
                     rich_help_panel=_ROOFLINE),
    ] = None,
):
    """Measure generation throughput on random prompts (nano-vllm's bench.py workload).

    Each request has a random prompt (token ids) and a random output length; EOS is ignored and decoding is
    greedy. Defaults: on CUDA 256 requests, 100-1024 tokens in and out, a Qwen3-0.6B-shaped model with
    random weights; on CPU the built-in default model and 64 requests, 32-256 in and out.

    Throughput = requested output tokens / wall time (model load and a short warm-up excluded).

    The roofline table sets the prefill steps and the decode steps (by batch size) against their floor: the
    bytes each step must move (weights once, KV cache read and written, logits) over the memory bandwidth, or
    its FLOPs over the matrix rate, whichever is longer. Ceilings: a table of known GPUs, a short probe on
    CPU, or --peak-bandwidth-gbs / --peak-tflops.

    --compare hf runs Hugging Face transformers' batched generate on the same requests in the same process
    (left-padded; each batch generates its longest output length, only requested tokens count).
    """
    from nanoinfer import bench as bench_lib

    with user_errors():
        if compare is not None and compare not in COMPARE_CHOICES:
            raise NanoInferError(f"--compare {compare} is not a known peer. Use one of: {', '.join(COMPARE_CHOICES)}.")
        cfg, notes = _build_config(engine)
        defaults = CUDA_DEFAULTS if cfg.device == "cuda" else CPU_DEFAULTS
        workload = bench_lib.make_workload(
            num_requests if num_requests is not None else defaults["num_requests"],
            tuple(input_len or defaults["input_len"]), tuple(output_len or defaults["output_len"]),
            seed, cfg.hf_config.vocab_size,
        )  # fmt: skip
        if workload.max_seq_len > cfg.max_model_len:
            raise NanoInferError(
                f"the longest request needs {workload.max_seq_len} tokens (prompt + output) but max_model_len "
                f"is {cfg.max_model_len}. Raise --max-model-len or lower --input-len / --output-len."
            )
        if hf_batch_size is not None and hf_batch_size < 1:
            raise NanoInferError(f"--hf-batch-size must be at least 1, got {hf_batch_size}.")
        if hf_dtype is not None and hf_dtype not in HF_DTYPES:
            raise NanoInferError(
                f"--hf-dtype {hf_dtype} is not a dtype HF runs here. Use one of: {', '.join(HF_DTYPES)}."
            )
        if compare == "hf" and cfg.loras:
            raise NanoInferError("--compare hf runs the base model: with --lora adapters compare with --compare base "
                                 "(the same engine without them).")  # fmt: skip
        if compare == "base" and not cfg.loras:
            raise NanoInferError("--compare base measures what LoRA adapters cost: give them with --lora NAME=PATH.")
        if hf_dtype is not None and compare != "hf":
            raise NanoInferError("--hf-dtype sets the dtype of the HF peer: give it with --compare hf.")
        for flag, value in (("--peak-bandwidth-gbs", peak_bandwidth_gbs), ("--peak-tflops", peak_tflops)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise NanoInferError(f"{flag} must be a positive number, got {value}.")
    console = Console(highlight=False, soft_wrap=True)
    for note in notes:
        console.print(f"note: {note}", markup=False)
    console.print(
        f"model {cfg.model} ({cfg.dtype}, {cfg.device}); workload {workload.num_requests} requests, "
        f"input {workload.input_len[0]}..{workload.input_len[1]}, output {workload.output_len[0]}.."
        f"{workload.output_len[1]}, seed {seed}: {workload.num_input_tokens:,} prompt and "
        f"{workload.num_output_tokens:,} output tokens",
        markup=False,
    )
    model_dir, dtype_name, device_name = cfg.model, cfg.dtype, cfg.device
    with user_errors():
        console.print("running nanoinfer ...", markup=False)
        steps = []
        ours, engine_info = bench_lib.run_nanoinfer(cfg, workload, warmup=warmup, on_step=steps.append)
        if cfg.loras:
            ours = dataclasses.replace(ours, engine=f"nanoinfer ({len(cfg.loras)} LoRA adapters)")
            notes.append("the roofline's floor is the base model's: the adapters' A and B reads and FLOPs are not in "
                         "it")  # fmt: skip
        console.print(engine_info["kv_cache"], markup=False)
        # After the timed run: the CPU probe's buffers would count in its peak memory.
        floor = _roofline(cfg, engine_info, steps, peak_bandwidth_gbs, peak_tflops) if roofline else None
        runs = [ours]
        if compare == "base":
            console.print("running nanoinfer without the adapters ...", markup=False)
            base_cfg = dataclasses.replace(cfg, enable_lora=False, loras={})
            base, _ = bench_lib.run_nanoinfer(base_cfg, workload, warmup=warmup)
            runs.append(dataclasses.replace(base, engine="nanoinfer (base model)"))
        if compare == "hf":
            console.print("running HF transformers generate ...", markup=False)
            # Another dtype than ours (--hf-dtype) compares across precisions, e.g. nanoinfer in bfloat16
            # against HF in float32; the table's dtype row says which ran in which.
            hf = bench_lib.run_hf_in_own_process(model_dir, workload, hf_dtype or dtype_name, device_name,
                                                 hf_batch_size, warmup)  # fmt: skip
            runs.append(hf)
    ratio = _ratio(runs)
    _render(console, runs, ratio)
    if floor is not None:
        _render_roofline(console, floor, ours.seconds)
    if output_json is not None:
        report = {
            "schema": bench_lib.SCHEMA,
            "command": _command_line(ctx),
            "machine": bench_lib.machine_info(device_name),
            "model": str(model_dir),
            "config": cfg.to_dict(),
            "notes": notes,
            "workload": workload.summary(),
            "engine": engine_info,
            "startup_to_first_token_s": _startup(engine_info, ours),
            "runs": [run.to_dict() for run in runs],
            "ratio": ratio,
            "roofline": floor.to_dict(wall_seconds=ours.seconds) if floor is not None else None,
        }
        output_json.parent.mkdir(parents=True, exist_ok=True)
        output_json.write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"wrote {output_json}", markup=False)


def _build_config(engine: EngineOptions):
    """The Config, with the device-dependent default model; returns (config, notes for the user)."""
    from nanoinfer import bench as bench_lib
    from nanoinfer.model_source import resolve_model

    values, _, _ = engine.merge()
    notes = []
    model = values.get("model")
    if model is None and _wants_cuda(values.get("device", "auto")):
        if not (CUDA_DEFAULT_MODEL_CONFIG / "config.json").is_file():
            raise NanoInferError(
                f"the CUDA default model config {CUDA_DEFAULT_MODEL_CONFIG} is missing (it ships in the source "
                "tree). Pass --model with a model folder."
            )
        model = CUDA_DEFAULT_MODEL_CONFIG
    if model is not None:  # resolved here, once: a folder with only a config.json gets random weights
        model_dir = resolve_model(str(model))
        if bench_lib.needs_random_weights(model_dir):
            # in the dtype asked for (a bfloat16 run of a large model need not build it in float32), else the
            # device's default
            asked = values.get("dtype")
            if asked in ("float32", "bfloat16", "float16"):
                weights_dtype = asked
            else:
                weights_dtype = "bfloat16" if _wants_cuda(values.get("device", "auto")) else "float32"
            notes.append(f"{model_dir} has no weights: using random {weights_dtype} weights with its config.json")
            model_dir = bench_lib.random_weight_model(model_dir, weights_dtype)
        engine = EngineOptions(engine.config_path, {**engine.overrides, "model": str(model_dir)})
    # cpu_kernels wait: bench measures the kernels, not their absence
    return engine.build(defaults={"cpu_kernels": "wait"}, runner="generate"), notes


def _wants_cuda(device: str) -> bool:
    """Will the engine run on CUDA? (An unusable `cuda` is Config's to report, before any weights are built.)"""
    if device not in ("auto", "cuda"):
        return False
    import torch

    return torch.cuda.is_available()


def _command_line(ctx: typer.Context) -> str:
    """The flags given on the command line, as `nanoinfer bench ...` (the same whichever way it was launched)."""
    parts = ["nanoinfer", ctx.info_name or "bench"]
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name)  # an enum of Typer's vendored click: compare by name
        if source is None or source.name != "COMMANDLINE":
            continue
        value = ctx.params[param.name]
        if getattr(param, "is_flag", False) or isinstance(value, bool):
            parts.append(param.opts[0] if value or not param.secondary_opts else param.secondary_opts[0])
        elif isinstance(value, tuple):
            parts += [param.opts[0], *map(str, value)]
        else:
            parts += [param.opts[0], str(value)]
    return shlex.join(parts)


def _ratio(runs) -> dict | None:
    if len(runs) < 2:
        return None
    ours, peer = runs
    return {
        "peer": peer.engine,
        "output_tok_s": ours.output_tok_s / peer.output_tok_s,
        "total_tok_s": ours.total_tok_s / peer.total_tok_s,
    }


def _startup(engine_info: dict, ours) -> float | None:
    """Process start -> engine ready, plus time to first token (the warm-up in between not counted)."""
    ready = engine_info.get("ready_since_process_start_s")
    return ready + ours.ttft_seconds if ready is not None and ours.ttft_seconds is not None else None


def _speculation_cell(run) -> str:
    """The share of n-gram speculation's proposed tokens the model kept, e.g. "85% of 6,802"; "off" or "-"."""
    details = run.details or {}
    if "num_speculative_tokens" not in details:
        return "-"  # a peer
    if not details["num_speculative_tokens"]:
        return "off"
    proposed, kept = details["num_draft_tokens"], details["num_accepted_tokens"]
    return f"{kept / proposed:.0%} of {proposed:,}" if proposed else "none proposed"


def _render(console: Console, runs, ratio: dict | None) -> None:
    from nanoinfer.memory import format_bytes

    def memory(run) -> str:
        parts = [f"{format_bytes(run.peak_cuda_bytes)} GPU"] if run.peak_cuda_bytes is not None else []
        parts += [f"{format_bytes(run.peak_rss_bytes)} RSS"] if run.peak_rss_bytes is not None else []
        return ", ".join(parts) or "-"

    rows = [
        ("dtype", lambda r: r.dtype or "-", None),  # differs with --hf-dtype
        ("requests", lambda r: f"{r.num_requests}", None),
        ("input tokens", lambda r: f"{r.input_tokens:,}", None),
        ("output tokens (requested)", lambda r: f"{r.output_tokens:,}", None),
        ("time (s)", lambda r: f"{r.seconds:.2f}", None),
        ("output tok/s", lambda r: f"{r.output_tok_s:.1f}", "output_tok_s"),
        ("total tok/s", lambda r: f"{r.total_tok_s:.1f}", "total_tok_s"),
        ("prefill time (s)", lambda r: f"{r.prefill_seconds:.2f}", None),
        ("decode time (s)", lambda r: f"{r.decode_seconds:.2f}", None),
        (
            "time to first token (s)",
            lambda r: f"{r.ttft_seconds:.2f}" if r.ttft_seconds is not None else "-",
            None,
        ),
        ("speculated tokens kept", _speculation_cell, None),
        ("model load (s)", lambda r: f"{r.load_seconds:.2f}", None),
        ("peak memory", memory, None),
    ]
    table = Table(title="Throughput: output tok/s = requested output tokens / wall time", title_justify="left")
    table.add_column("", style="bold", no_wrap=True)
    for run in runs:
        table.add_column(run.engine, justify="right", no_wrap=True)
    if ratio is not None:
        table.add_column("ratio", justify="right", no_wrap=True)
    for label, cell, ratio_key in rows:
        ratio_cell = [f"{ratio[ratio_key]:.2f}x" if ratio_key else ""] if ratio is not None else []
        table.add_row(label, *[cell(run) for run in runs], *ratio_cell)
    console.print(table)
    peer = next((run for run in runs if run.engine == "hf-transformers"), None)
    if peer is not None and peer.details.get("wasted_tokens"):
        err_console.print(
            f"note: HF generated {peer.generated_tokens:,} tokens for {peer.output_tokens:,} requested "
            f"(batch {peer.details['batch_size']}: each batch runs to its longest output); only requested "
            "tokens are counted.",
            markup=False, highlight=False,
        )  # fmt: skip


def _roofline(cfg, engine_info: dict, steps: list, bandwidth_gbs: float | None, tflops: float | None):
    """The timed run's steps against the device's ceilings (nanoinfer.roofline)."""
    from nanoinfer import roofline

    shape = roofline.ModelShape.from_spec(cfg.model_spec, cfg.dtype, cfg.kv_cache_dtype, cfg.tensor_parallel_size,
                                          engine_info.get("weights_read_bytes"), engine_info.get("expert_bytes"))
    ceilings = roofline.device_ceilings(cfg.device, cfg.dtype, bandwidth_gbs=bandwidth_gbs, tflops=tflops,
                                        tensor_parallel_size=cfg.tensor_parallel_size)  # fmt: skip
    floor = roofline.Roofline(shape, ceilings)
    for stats in steps:
        floor.add(stats)
    return floor


def _render_roofline(console: Console, floor, wall_seconds: float) -> None:
    ceilings, shape = floor.ceilings, floor.shape
    console.print(
        f"Roofline on {ceilings.device}: {_si(ceilings.bandwidth, 'B/s')} ({ceilings.bandwidth_source}), "
        f"{_si(ceilings.flops, 'FLOP/s')} ({ceilings.flops_source}); a step reads {_si(shape.weights_bytes, 'B')} "
        f"of weights, KV is {shape.kv_bytes_per_token:,} bytes a token",
        markup=False,
    )
    table = Table(title="Roofline: floor = max(bytes / bandwidth, FLOPs / peak), step by step; % = floor / time",
                  title_justify="left")  # fmt: skip
    for name in ("step class", "steps", "time", "floor", "floor / time", "bound", "moved", "KV read", "FLOPs"):
        table.add_column(name, justify="left" if name in ("step class", "bound") else "right", no_wrap=True)

    def cells(totals) -> list[str]:
        share = f"{totals.of_floor:.0%}" if totals.of_floor is not None else "-"
        cost = totals.cost
        return [f"{totals.steps:,}", _si(totals.seconds, "s"), _si(totals.floor_seconds, "s"), share, totals.bound,
                _si(cost.total_bytes, "B"), _si(cost.kv_read_bytes, "B"), _si(cost.flops, "")]  # fmt: skip

    for name, totals in floor.ordered_classes():
        table.add_row(name, *cells(totals))
    table.add_row("all steps", *cells(floor.all_steps), style="bold")
    run_share = f"{floor.all_steps.floor_seconds / wall_seconds:.0%}" if wall_seconds > 0 else "-"
    table.add_row("run (wall time)", "", _si(wall_seconds, "s"), _si(floor.all_steps.floor_seconds, "s"), run_share,
                  "", "", "", "")  # fmt: skip
    console.print(table)


def _si(value: float, unit: str) -> str:
    """3 significant digits with an SI prefix: 1.19 GB, 512 kB, 10.5 ms, 4.80 TB/s, 2.41 T (FLOPs)."""
    if value == 0:
        return f"0 {unit}".rstrip()
    prefixes = [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1, ""), (1e-3, "m"), (1e-6, "u"), (1e-9, "n")]
    scale, prefix = next(((s, p) for s, p in prefixes if abs(value) >= s), prefixes[-1])
    if unit == "s" and scale > 1:
        scale, prefix = 1, ""  # 234 s, not 0.234 ks
    scaled = value / scale
    digits = 0 if abs(scaled) >= 100 else 1 if abs(scaled) >= 10 else 2
    return f"{scaled:,.{digits}f} {prefix}{unit}".rstrip()
