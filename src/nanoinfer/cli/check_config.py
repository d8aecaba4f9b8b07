"""`nanoinfer check-config`: validate a config (YAML + flags) without loading weights.

Also declares the Config override flags once (`ModelFlag`, `MaxModelLenFlag`, ...) so every command spells
them the same way; a command passes them to `nanoinfer.config_file.build_config`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from nanoinfer.cli import app, user_errors

# Override flags: each defaults to None ("not given"), so the YAML value or the default applies.
# Usage in a command: `max_model_len: MaxModelLenFlag = None`, then
# `build_config(config, {"max_model_len": max_model_len, ...})`.
ModelFlag = Annotated[
    str | None, typer.Option("--model", help="Model folder, 'smollm2-135m-instruct' or a hub repo id.")
]
MaxNumBatchedTokensFlag = Annotated[
    int | None, typer.Option("--max-num-batched-tokens", help="Most tokens in one forward pass.")
]
MaxNumSeqsFlag = Annotated[
    int | None, typer.Option("--max-num-seqs", help="Most sequences in one forward pass.")
]
MaxModelLenFlag = Annotated[
    int | None, typer.Option("--max-model-len", help="Most tokens (prompt + output) in one sequence.")
]
GpuMemoryUtilizationFlag = Annotated[
    float | None,
    typer.Option("--gpu-memory-utilization", help="Fraction of GPU memory the engine may use, in (0, 1]."),
]
TensorParallelSizeFlag = Annotated[
    int | None, typer.Option("--tensor-parallel-size", help="Ranks the weights are sharded over (1..8).")
]
EnforceEagerFlag = Annotated[
    bool | None, typer.Option("--enforce-eager/--no-enforce-eager", help="Disable CUDA graphs for decode.")
]
KvcacheBlockSizeFlag = Annotated[
    int | None, typer.Option("--kvcache-block-size", help="Tokens per KV-cache block (multiple of 256).")
]
NumKvcacheBlocksFlag = Annotated[
    int | None,
    typer.Option("--num-kvcache-blocks", help="Total KV-cache blocks; -1 sizes it from memory."),
]
DeviceFlag = Annotated[str | None, typer.Option("--device", help="auto | cpu | cuda.")]
DtypeFlag = Annotated[str | None, typer.Option("--dtype", help="auto | float32 | bfloat16 | float16.")]
KvCacheDtypeFlag = Annotated[
    str | None,
    typer.Option(
        "--kv-cache-dtype",
        help="auto (the model's dtype) | float32 | bfloat16 | float16 | fp8 (= fp8_e4m3) | fp8_e5m2: the KV cache's.",
    ),
]
AttentionBackendFlag = Annotated[
    str | None, typer.Option("--attention-backend", help="auto | torch | triton | flash-attn.")
]
SeedFlag = Annotated[int | None, typer.Option("--seed", help="Sampling seed for requests that give none.")]
CpuKvcacheSpaceGibFlag = Annotated[
    float | None, typer.Option("--cpu-kvcache-space-gib", help="KV-cache budget on CPU, in GiB.")
]
EnablePrefixCachingFlag = Annotated[
    bool | None,
    typer.Option(
        "--enable-prefix-caching/--no-enable-prefix-caching", help="Reuse KV blocks of shared prefixes."
    ),
]
NumThreadsFlag = Annotated[
    int | None, typer.Option("--num-threads", help="Torch threads on CPU; 0 = one per physical core.")
]
NumSpeculativeTokensFlag = Annotated[
    int | None,
    typer.Option(
        "--num-speculative-tokens",
        help="n-gram speculative decoding: tokens proposed per greedy sequence a step (0 = off, up to 16).",
    ),
]
PromptLookupMinFlag = Annotated[
    int | None, typer.Option("--prompt-lookup-min", help="Shortest n-gram matched by speculation (1..8).")
]
PromptLookupMaxFlag = Annotated[
    int | None, typer.Option("--prompt-lookup-max", help="Longest n-gram matched by speculation (1..8).")
]
TrustRemoteCodeFlag = Annotated[
    bool | None,
    typer.Option(
        "--trust-remote-code/--no-trust-remote-code", help="Let transformers run the model's own code."
    ),
]


@app.command("check-config")
def check_config(
    config: Annotated[
        Path | None,
        typer.Argument(
            help="YAML config file. Without one, the defaults and flags are checked.", show_default=False
        ),
    ] = None,
    model: ModelFlag = None,
    max_num_batched_tokens: MaxNumBatchedTokensFlag = None,
    max_num_seqs: MaxNumSeqsFlag = None,
    max_model_len: MaxModelLenFlag = None,
    gpu_memory_utilization: GpuMemoryUtilizationFlag = None,
    tensor_parallel_size: TensorParallelSizeFlag = None,
    enforce_eager: EnforceEagerFlag = None,
    kvcache_block_size: KvcacheBlockSizeFlag = None,
    num_kvcache_blocks: NumKvcacheBlocksFlag = None,
    device: DeviceFlag = None,
    dtype: DtypeFlag = None,
    kv_cache_dtype: KvCacheDtypeFlag = None,
    attention_backend: AttentionBackendFlag = None,
    seed: SeedFlag = None,
    cpu_kvcache_space_gib: CpuKvcacheSpaceGibFlag = None,
    enable_prefix_caching: EnablePrefixCachingFlag = None,
    num_threads: NumThreadsFlag = None,
    num_speculative_tokens: NumSpeculativeTokensFlag = None,
    prompt_lookup_min: PromptLookupMinFlag = None,
    prompt_lookup_max: PromptLookupMaxFlag = None,
    trust_remote_code: TrustRemoteCodeFlag = None,
    json_output: Annotated[
        bool, typer.Option("--json", help='Print {"ok", "config", "sources", "notes", "problems"} as JSON.')
    ] = False,
):
    """Check a config before a long job: every problem at once, or the resolved values.

    Flags override the YAML file, which overrides the defaults. Reads the model's config.json but loads no
    weights. Exits 0 when the config is valid and 2 when it is not.
    """
    overrides = {
        "model": model,
        "max_num_batched_tokens": max_num_batched_tokens,
        "max_num_seqs": max_num_seqs,
        "max_model_len": max_model_len,
        "gpu_memory_utilization": gpu_memory_utilization,
        "tensor_parallel_size": tensor_parallel_size,
        "enforce_eager": enforce_eager,
        "kvcache_block_size": kvcache_block_size,
        "num_kvcache_blocks": num_kvcache_blocks,
        "device": device,
        "dtype": dtype,
        "kv_cache_dtype": kv_cache_dtype,
        "attention_backend": attention_backend,
        "seed": seed,
        "cpu_kvcache_space_gib": cpu_kvcache_space_gib,
        "enable_prefix_caching": enable_prefix_caching,
        "num_threads": num_threads,
        "num_speculative_tokens": num_speculative_tokens,
        "prompt_lookup_min": prompt_lookup_min,
        "prompt_lookup_max": prompt_lookup_max,
        "trust_remote_code": trust_remote_code,
    }
    if json_output:
        _check_json(config, overrides)
        return
    from nanoinfer.config_file import build_config, merge_settings

    with user_errors():
        _, sources, _ = merge_settings(config, overrides)
        resolved = build_config(config, overrides)
    _print_summary(resolved, sources)


def _check_json(config_path: Path | None, overrides: dict) -> None:
    from nanoinfer.config_file import make_config, merge_settings
    from nanoinfer.errors import ConfigError, NanoInferError

    values, sources, problems, resolved = {}, {}, [], None
    try:
        values, sources, problems = merge_settings(config_path, overrides)
        resolved = make_config(values, problems)
    except ConfigError as e:
        problems = e.problems  # the file's problems are among them
    except NanoInferError as e:  # e.g. the model source could not be fetched
        problems = problems + [{"field": "", "value": None, "message": str(e)}]
    ok = not problems
    report = {
        "ok": ok,
        "config": resolved.to_dict() if resolved is not None else _as_given(values),
        "sources": sources,
        "notes": [{"field": f, "value": v, "reason": r} for f, v, r in resolved.notes] if resolved else [],
        "problems": [p if isinstance(p, dict) else p.to_dict() for p in problems],
    }
    typer.echo(json.dumps(report, indent=2, default=str))
    if not ok:
        raise typer.Exit(code=2)


def _as_given(values: dict) -> dict:
    """Every settable field as the user asked for it (unresolved), for a config that failed."""
    from nanoinfer.config import field_default, settable_fields

    return {name: values.get(name, field_default(name)) for name in settable_fields()}


def _print_summary(config, sources: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from nanoinfer.config import settable_fields

    notes = {}
    for name, _, reason in config.notes:
        notes[name] = f"{notes[name]}; {reason}" if name in notes else reason
    table = Table(title="Resolved configuration", title_justify="left")
    table.add_column("field", no_wrap=True)
    table.add_column("value", overflow="fold")
    table.add_column("source", no_wrap=True)
    table.add_column("note", overflow="fold")
    for name in settable_fields():
        value = getattr(config, name)
        source = sources.get(name, "default")
        if name in notes and source == "default":
            source = "filled-in"
        table.add_row(name, str(value), source, notes.get(name, ""))
    console = Console(highlight=False)
    console.print(table)
    hf = config.hf_config
    console.print(
        f"model: {getattr(hf, 'model_type', '?')}, {getattr(hf, 'num_hidden_layers', '?')} layers, "
        f"{getattr(hf, 'num_attention_heads', '?')} attention heads, "
        f"{getattr(hf, 'num_key_value_heads', '?')} KV heads, "
        f"max_position_embeddings {getattr(hf, 'max_position_embeddings', '?')}",
        markup=False,
    )
    console.print("[bold green]ok:[/bold green] the configuration is valid.")
