"""`nanoinfer plan-memory`: will a model fit on a card, and how many sequences at once?

Reads config.json and safetensors headers only (no weights, no GPU needed) and asks memory.py, the
planner the engine itself uses. Exit codes: 0 fits, 2 bad input, 3 the engine would refuse this setup.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from nanoinfer import memory
from nanoinfer.cli import app, user_errors
from nanoinfer.cli.engine_options import EngineOptions, engine_options
from nanoinfer.config import DTYPES, KV_CACHE_DTYPES, field_default, type_problem
from nanoinfer.errors import ConfigError, ConfigProblem, ModelLoadError, NanoInferError, OutOfMemoryError

EXIT_DOES_NOT_FIT = 3
# Config fields plan-memory reads, from flags or the YAML file; defaults are Config's.
_FIELDS = (
    "model", "tensor_parallel_size", "dtype", "kv_cache_dtype", "max_model_len", "max_num_seqs",
    "max_num_batched_tokens", "gpu_memory_utilization", "kvcache_block_size", "num_kvcache_blocks",
    "num_speculative_tokens", "enable_lora", "max_loras", "max_lora_rank", "loras",
)  # fmt: skip


@app.command("plan-memory")
@engine_options(_FIELDS)
def plan_memory(
    engine: EngineOptions = None,  # @engine_options puts --config and the engine flags here
    gpu: Annotated[
        str | None, typer.Option(help="A card from the table: H200, A100-80GB, RTX-4090...")
    ] = None,
    gpu_memory: Annotated[str | None, typer.Option(help="Device memory: 80GiB, 24GB, 143771MiB.")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
):
    """Plan the KV cache for a model on a GPU without loading weights or needing the GPU.

    Shows weights, activation estimate, KV bytes per token, blocks, tokens and max concurrency.

    Answers what fits: the largest max_model_len, the sequences of max_model_len at once, the smallest --tp.

    Name the card with --gpu or --gpu-memory; without either, the CUDA device present is measured.
    --dtype auto means bfloat16, as on CUDA.

    Exit codes: 0 fits; 2 bad input (unknown GPU, bad size, bad config); 3 does not fit (the engine would refuse).
    """
    with user_errors():
        settings = _settings(engine)
        device = _device_memory(gpu, gpu_memory)
        report = build_report(settings, device)
    if json_output:
        typer.echo(json.dumps(report, indent=2))
    else:
        _render(report)
    if not report["fits"]:
        raise typer.Exit(code=EXIT_DOES_NOT_FIT)


def _settings(engine: EngineOptions) -> dict:
    """Flag > YAML > Config default (config_file.merge_settings), checked; adds hf_config and model_dir.

    Not a full Config: that would also pick a device and dtype for this machine, and plan-memory plans
    for a GPU that need not be here.
    """
    file_values, _, problems = engine.merge()
    values = {name: file_values.get(name, field_default(name)) for name in _FIELDS}
    problems += [p for name in _FIELDS if (p := type_problem(name, values[name]))]
    if problems:
        raise ConfigError(problems)
    from nanoinfer.model_source import resolve_model

    model_dir = resolve_model(values["model"])
    hf_config = _load_hf_config(model_dir)
    spec = _model_spec(hf_config, model_dir)
    notes = []
    if values["dtype"] == "auto":
        values["dtype"] = "bfloat16"
        notes.append("dtype auto = bfloat16 (as on CUDA)")
    if values["kv_cache_dtype"] == "auto":
        values["kv_cache_dtype"] = values["dtype"]
    elif values["kv_cache_dtype"] == "fp8":
        values["kv_cache_dtype"] = "fp8_e4m3"
        notes.append("kv_cache_dtype fp8 = fp8_e4m3 (as in vLLM)")
    max_pos = getattr(hf_config, "max_position_embeddings", None)
    if isinstance(max_pos, int) and values["max_model_len"] > max_pos:
        notes.append(
            f"max_model_len clamped from {values['max_model_len']} to max_position_embeddings {max_pos}"
        )
        values["max_model_len"] = max_pos
    _check(values, spec)
    _resolve_loras(values, notes)
    return {**values, "model_dir": model_dir, "hf_config": hf_config, "spec": spec, "max_position_embeddings": max_pos,
            "notes": notes}  # fmt: skip


def _load_hf_config(model_dir: Path):
    from nanoinfer.models import registry
    from nanoinfer.models.config import load_hf_config

    try:
        hf_config = load_hf_config(model_dir)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"cannot read the model config in {model_dir}: {e}") from None
    return registry.text_config(hf_config)[0]  # a vision-language checkpoint plans as its text part


def _model_spec(hf_config, model_dir: Path):
    """The model family's ModelSpec (the registry's), or the error Config would give for this folder."""
    from nanoinfer.models import registry

    spec, problem = registry.checked_model_spec(hf_config)
    if problem is not None:
        raise ModelLoadError(f"{model_dir}: {problem}")
    return spec


def _check(values: dict, spec) -> None:
    problems = []

    def need(field, ok, rule):
        if not ok:
            problems.append(ConfigProblem(field, values[field], rule))

    tp = values["tensor_parallel_size"]
    if not 1 <= tp <= 8:
        need("tensor_parallel_size", False, "must be an integer from 1 to 8.")
    elif not spec.check_tensor_parallel(tp):
        sizes = memory.valid_tensor_parallel_sizes(spec, range(1, 9))
        need(
            "tensor_parallel_size", False,
            f"does not split this model's attention heads; use one of {sizes}." if spec.supports_tensor_parallel
            else f"must be 1: nanoinfer runs {spec.architecture} on one rank only (its layers are not sharded).",
        )
    need("dtype", values["dtype"] in DTYPES[1:], f"must be one of {', '.join(DTYPES)}.")
    kv_cache_dtype = values["kv_cache_dtype"]
    known = kv_cache_dtype in KV_CACHE_DTYPES[1:]
    need("kv_cache_dtype", known, f"must be one of {', '.join(KV_CACHE_DTYPES)} (auto: the model's dtype).")
    for field in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
        need(field, values[field] >= 1, "must be a positive integer.")
    if values["max_num_seqs"] >= 1:
        need(
            "max_num_batched_tokens",
            values["max_num_batched_tokens"] >= values["max_num_seqs"],
            f"must be >= max_num_seqs ({values['max_num_seqs']}): each scheduled sequence takes a token.",
        )
    need("gpu_memory_utilization", 0 < values["gpu_memory_utilization"] <= 1, "must be in (0, 1], e.g. 0.9.")
    block = values["kvcache_block_size"]
    need("kvcache_block_size", block > 0 and block % 256 == 0, "must be a positive multiple of 256.")
    blocks = values["num_kvcache_blocks"]
    need(
        "num_kvcache_blocks", blocks == -1 or blocks > 0, "must be -1 (size from memory) or a positive count."
    )
    if problems:
        raise ConfigError(problems)


def _resolve_loras(values: dict, notes: list) -> None:
    """max_loras as the engine resolves it (Config._lora_ranges), 0 without LoRA: the adapter slots to plan."""
    from nanoinfer.config import auto_max_loras

    loras = values["loras"] if isinstance(values["loras"], dict) else {}
    if not (values["enable_lora"] or loras):
        values["max_loras"] = 0
    elif values["max_loras"] == 0:
        values["max_loras"] = auto_max_loras(len(loras))
        notes.append(f"max_loras 0 = {values['max_loras']} (one slot an adapter in loras)")


def _device_memory(gpu: str | None, gpu_memory: str | None) -> dict:
    """Total memory and memory used by others, from --gpu, --gpu-memory or the CUDA device present."""
    if gpu and gpu_memory:
        raise NanoInferError("pass either --gpu or --gpu-memory, not both.")
    if gpu:
        name, total = memory.lookup_gpu(gpu)
        return {"name": name, "total_bytes": total, "other_bytes": 0,
                "source": "GPU table (vendor GB = 10^9 bytes), assumed empty"}  # fmt: skip
    if gpu_memory:
        return {"name": gpu_memory, "total_bytes": memory.parse_memory_size(gpu_memory), "other_bytes": 0,
                "source": "--gpu-memory, assumed empty"}  # fmt: skip
    import torch

    if not torch.cuda.is_available():
        raise NanoInferError(
            "no CUDA device here to measure. Name the card with --gpu (one of "
            f"{', '.join(memory.GPU_TABLE)}) or give its memory with --gpu-memory, e.g. --gpu-memory 24GiB."
        )
    free, total = torch.cuda.mem_get_info(0)
    name = torch.cuda.get_device_properties(0).name
    return {"name": name, "total_bytes": total, "other_bytes": total - free,
            "source": "measured on cuda:0 (used = memory taken by other processes)"}  # fmt: skip


def _plan(s: dict, device: dict, weights_total: int, tp: int, num_kvcache_blocks: int) -> dict:
    """One planner run for tensor_parallel_size tp; `plan` is None and `error` says why when nothing fits."""
    spec, dtype = s["spec"], s["dtype"]
    inputs = {
        "weights_bytes": math.ceil(weights_total / tp),  # every weight is sharded except tiny norms
        "activation_bytes": memory.estimate_activation_bytes(
            spec, s["max_num_batched_tokens"], s["max_num_seqs"], dtype, tp, s["num_speculative_tokens"]
        ),
        "block_bytes": memory.kv_block_bytes(spec, s["kvcache_block_size"], tp, s["kv_cache_dtype"]),
        "state_slot_bytes": memory.state_slot_bytes(spec, tp, dtype),
        "lora_bytes": s["max_loras"] * spec.lora_slot_bytes(s["max_lora_rank"], memory.dtype_bytes(dtype), tp),
    }
    if s["max_loras"]:  # the adapters' float32 shrink results, at most three slices of max_lora_rank a row
        inputs["activation_bytes"] += s["max_num_batched_tokens"] * 3 * s["max_lora_rank"] * 4
    try:
        plan = memory.plan_kv_cache(
            total_bytes=device["total_bytes"], utilization=s["gpu_memory_utilization"],
            other_bytes=device["other_bytes"], block_size=s["kvcache_block_size"],
            max_model_len=s["max_model_len"], num_kvcache_blocks=num_kvcache_blocks, spec=spec,
            max_num_seqs=s["max_num_seqs"], activation_bytes=inputs["activation_bytes"],
            block_bytes=inputs["block_bytes"], state_slot_bytes=inputs["state_slot_bytes"],
            weights_bytes=inputs["weights_bytes"] + inputs["lora_bytes"],  # adapter slots stay, like the weights
        )  # fmt: skip
        return {**inputs, "plan": plan, "error": None}
    except OutOfMemoryError as e:
        return {**inputs, "plan": None, "error": str(e)}


def build_report(s: dict, device: dict) -> dict:
    """Everything plan-memory shows, JSON-ready."""
    tp, max_model_len = s["tensor_parallel_size"], s["max_model_len"]
    weights_total = memory.weights_bytes_from_checkpoint(s["model_dir"], s["dtype"], s["spec"])
    run = _plan(s, device, weights_total, tp, s["num_kvcache_blocks"])
    plan = run["plan"]
    budget = memory.kv_budget_bytes(
        total_bytes=device["total_bytes"], utilization=s["gpu_memory_utilization"],
        weights_bytes=run["weights_bytes"] + run["lora_bytes"], activation_bytes=run["activation_bytes"],
        other_bytes=device["other_bytes"],
    )  # fmt: skip
    fits = plan is not None and plan.fits_one_sequence
    smallest_tp = next(
        (size for size in memory.valid_tensor_parallel_sizes(s["spec"])
         if (p := _plan(s, device, weights_total, size, -1)["plan"]) is not None and p.fits_one_sequence),
        None,
    )  # fmt: skip
    if fits:
        verdict = (
            f"fits: {plan.num_blocks:,} blocks hold {plan.num_tokens:,} tokens, "
            f"{plan.max_num_seqs_that_fit():,} sequences of max_model_len {max_model_len} at once."
        )
    elif plan is None:
        verdict = f"does not fit: {run['error'].rstrip('.')}."
    else:
        verdict = (
            f"does not fit at max_model_len {max_model_len}: the KV cache holds {plan.num_tokens:,} tokens. "
            f"Largest max_model_len that fits: {plan.max_model_len_that_fits(s['max_position_embeddings'])}."
        )
    if not fits and smallest_tp:
        verdict += f" Smallest tensor_parallel_size that fits: {smallest_tp}."
    elif not fits:
        verdict += " No tensor_parallel_size up to 8 fits on this card."
    return {
        "model": str(s["model_dir"]),
        "device": device["name"],
        "device_source": device["source"],
        "total_bytes": device["total_bytes"],
        "other_bytes": device["other_bytes"],
        "gpu_memory_utilization": s["gpu_memory_utilization"],
        "tensor_parallel_size": tp,
        "dtype": s["dtype"],
        "kv_cache_dtype": s["kv_cache_dtype"],
        "max_model_len": max_model_len,
        "max_num_seqs": s["max_num_seqs"],
        "max_num_batched_tokens": s["max_num_batched_tokens"],
        "kvcache_block_size": s["kvcache_block_size"],
        "num_kvcache_blocks_requested": s["num_kvcache_blocks"],
        "weights_bytes_total": weights_total,
        "weights_source": "safetensors headers"
        if any(Path(s["model_dir"]).glob("*.safetensors"))
        else "estimated from config.json (no *.safetensors)",
        "weights_bytes": run["weights_bytes"],
        # a mixture of experts: every expert is held (a step reads those its tokens chose), per rank
        "moe": (f"{s['spec'].num_moe_layers} layers x {s['spec'].num_experts}, top {s['spec'].experts_per_token}"
                if s["spec"].num_moe_layers else None),
        "expert_bytes": memory.expert_share(s["spec"], run["weights_bytes"]),
        "activation_bytes": run["activation_bytes"],
        # LoRA: max_loras adapter slots of max_lora_rank in every adapted layer, per rank (0 without LoRA)
        "max_loras": s["max_loras"],
        "max_lora_rank": s["max_lora_rank"],
        "lora_bytes": run["lora_bytes"],
        "kv_budget_bytes": budget,
        "kv_bytes_per_token": run["block_bytes"] // s["kvcache_block_size"],
        "kv_layer_groups": _kv_layer_groups(s["spec"], tp, s["kv_cache_dtype"]),
        "block_bytes": run["block_bytes"],
        "num_blocks": plan.num_blocks if plan else 0,
        "num_tokens": plan.num_tokens if plan else 0,
        "kv_bytes": plan.kv_bytes if plan else 0,
        "max_concurrency": round(plan.max_concurrency(), 2) if plan else 0.0,
        # a hybrid model's linear-attention layers: one state slot a running sequence, from the same budget
        "linear_attention_layers": len(s["spec"].linear_attention_layers),
        "state_slot_bytes": run["state_slot_bytes"],
        "num_state_slots": plan.num_state_slots if plan else 0,
        "state_bytes": plan.state_bytes if plan else 0,
        "fits": fits,
        "verdict": verdict,
        "largest_max_model_len": plan.max_model_len_that_fits(s["max_position_embeddings"]) if plan else 0,
        "max_num_seqs_at_max_model_len": plan.max_num_seqs_that_fit() if plan else 0,
        "smallest_tensor_parallel_size": smallest_tp,
        "notes": s["notes"],
    }


def _kv_layer_groups(spec, tp: int, kv_cache_dtype: str) -> list[dict]:
    """KV bytes a token takes per layer on one rank, by kind of layer (global or a sliding window, KV heads x head
    size): where a model's layers differ (Gemma 2-4, OLMo 3), each group's share of the cache."""
    groups: dict[tuple, list] = {}
    for layer in spec.layers:
        if layer.kv_shared_from is None:  # a layer reading another's cache has no bytes of its own
            groups.setdefault((layer.sliding_window, layer.num_kv_heads, layer.head_dim), []).append(layer)
    size = memory.dtype_bytes(kv_cache_dtype)
    return [
        {"attention": "global" if window is None else f"sliding window {window}",
         "kv_heads": kv_heads, "head_dim": head_dim, "num_layers": len(layers),
         "kv_bytes_per_token_per_layer": layers[0].kv_elements_per_token(tp) * size}
        for (window, kv_heads, head_dim), layers in groups.items()
    ]  # fmt: skip


def _render(r: dict) -> None:
    console = Console(soft_wrap=True, highlight=False)
    size = memory.format_bytes
    table = Table(title=f"KV-cache plan: {Path(r['model']).name} on {r['device']}", show_header=False)
    table.add_column("quantity", style="bold")
    table.add_column("value", justify="right")
    rows = [
        ("device memory", f"{size(r['total_bytes'])} ({r['total_bytes']:,} B)"),
        ("x gpu_memory_utilization", f"{r['gpu_memory_utilization']}"),
        ("used by others", size(r["other_bytes"])),
        ("tensor_parallel_size / dtype / KV cache",
         f"{r['tensor_parallel_size']} / {r['dtype']} / {r['kv_cache_dtype']}"),
        ("weights (per rank)", f"{size(r['weights_bytes'])} ({r['weights_bytes']:,} B)"),
        *([(f"  experts ({r['moe']})", size(r["expert_bytes"]))] if r.get("moe") else []),
        *([(f"LoRA slots ({r['max_loras']} x rank {r['max_lora_rank']}, per rank)",
            f"{size(r['lora_bytes'])} ({r['lora_bytes']:,} B)")] if r["max_loras"] else []),
        ("activation peak (estimate)", f"{size(r['activation_bytes'])} ({r['activation_bytes']:,} B)"),
        ("KV budget", f"{size(r['kv_budget_bytes'])} ({r['kv_budget_bytes']:,} B)"),
        ("KV bytes per token", f"{r['kv_bytes_per_token']:,}"),
        *[(f"  {g['num_layers']} layers: {g['attention']}, {g['kv_heads']} KV heads x {g['head_dim']}",
           f"{g['kv_bytes_per_token_per_layer']:,} a layer") for g in r["kv_layer_groups"]],
        (f"block bytes ({r['kvcache_block_size']} tokens)", f"{r['block_bytes']:,}"),
        ("blocks", f"{r['num_blocks']:,}"),
        ("tokens", f"{r['num_tokens']:,}"),
        (f"max concurrency at max_model_len {r['max_model_len']}", f"{r['max_concurrency']:.2f}"),
        *([(f"state slot ({r['linear_attention_layers']} linear-attention layers)",
            f"{size(r['state_slot_bytes'])} ({r['state_slot_bytes']:,} B)"),
           ("state slots (one a running sequence)", f"{r['num_state_slots']:,} = {size(r['state_bytes'])}")]
          if r["linear_attention_layers"] else []),
    ]
    for row in rows:
        table.add_row(*row)
    console.print(table)
    console.print(f"memory: {r['device_source']}; weights: {r['weights_source']}", markup=False)
    for note in r["notes"]:
        console.print(f"note: {note}", markup=False)
    console.print("[bold]What fits[/bold]")
    console.print(f"  largest max_model_len: {r['largest_max_model_len']:,}")
    console.print(
        f"  sequences of max_model_len {r['max_model_len']} at once: {r['max_num_seqs_at_max_model_len']:,}"
    )
    console.print(
        f"  smallest tensor_parallel_size that fits: {r['smallest_tensor_parallel_size'] or 'none up to 8'}"
    )
    console.print(Text.assemble(("verdict: ", "bold green" if r["fits"] else "bold red"), r["verdict"]))
