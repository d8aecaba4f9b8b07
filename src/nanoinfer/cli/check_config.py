"""`nanoinfer check-config`: validate a config (YAML + flags) without loading weights (LoRA adapters' headers are read:
Config checks each one against the model)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated

import typer

from nanoinfer.cli import app, user_errors
from nanoinfer.cli.engine_options import EngineOptions, engine_options


@app.command("check-config")
@engine_options(config_option=False)
def check_config(
    config: Annotated[
        Path | None,
        typer.Argument(
            help="YAML config file. Without one, the defaults and flags are checked.", show_default=False
        ),
    ] = None,
    engine: EngineOptions = None,  # check-config takes the file as CONFIG: @engine_options puts the engine flags here
    json_output: Annotated[
        bool,
        typer.Option("--json", help='Print {"ok", "config", "sources", "notes", "problems", "loras"} as JSON.'),
    ] = False,
):
    """Check a config before a long job: every problem at once, or the resolved values.

    Flags override the YAML file, which overrides the defaults. Reads the model's config.json but loads no
    weights; checks every LoRA adapter (--lora, loras:) against the model. Exits 0 when the config is valid
    and 2 when it is not.
    """
    engine = dataclasses.replace(engine, config_path=config)
    if json_output:
        _check_json(engine)
        return
    with user_errors():
        _, sources, _ = engine.merge()
        resolved = engine.build()
    _print_summary(resolved, sources)


def _check_json(engine: EngineOptions) -> None:
    from nanoinfer.config_file import make_config
    from nanoinfer.errors import ConfigError, NanoInferError

    values, sources, problems, resolved = {}, {}, [], None
    try:
        values, sources, problems = engine.merge()
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
        "problems": [_problem_json(p) for p in problems],
        "loras": _adapters(resolved.loras if resolved is not None else values.get("loras"), problems, resolved),
    }
    typer.echo(json.dumps(report, indent=2, default=str))
    if not ok:
        raise typer.Exit(code=2)


def _problem_json(problem) -> dict:
    if isinstance(problem, dict):
        return problem
    report = problem.to_dict()
    if _lora_name(problem) is not None:  # the adapter's {name: folder}, as JSON rather than its repr
        report["value"] = {name: str(path) for name, path in problem.value.items()}
    return report


def _lora_name(problem) -> str | None:
    """The adapter a problem is about (Config reports each as field loras, value {name: folder}), else None."""
    value = problem.get("value") if isinstance(problem, dict) else problem.value
    field = problem.get("field") if isinstance(problem, dict) else problem.field
    if field == "loras" and isinstance(value, dict) and len(value) == 1:
        return str(next(iter(value)))
    return None


def _adapters(loras, problems: list, config=None) -> list[dict]:
    """Each adapter `loras` names: {"name", "path", "rank", "targets", "problems"}; rank (the largest of its modules')
    and targets (the projections it adapts) once the config resolved, which means Config read and checked it."""
    from nanoinfer.lora.peft import read_adapter

    entries = []
    for name, path in (loras.items() if isinstance(loras, dict) else ()):
        entry = {"name": name, "path": str(path), "rank": None, "targets": None,
                 "problems": [p["message"] if isinstance(p, dict) else p.message
                              for p in problems if _lora_name(p) == name]}  # fmt: skip
        if config is not None and config.model_spec is not None:
            adapter = read_adapter(path, config.max_lora_rank, config.model_spec.lora_shapes, name)
            entry["rank"] = adapter.max_rank
            entry["targets"] = sorted({target.module.rsplit(".", 1)[-1] for target in adapter.targets})
        entries.append(entry)
    return entries


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
    # KV heads as the model's layers have them: they may differ between layers (Gemma 4's global ones), where
    # transformers refuses to read one num_key_value_heads off the config
    spec = config.model_spec
    kv_heads = sorted({layer.num_kv_heads for layer in spec.layers}) if spec else []
    experts = (f"{spec.num_experts} experts in {spec.num_moe_layers} layers (top {spec.experts_per_token}), "
               if spec and spec.num_moe_layers else "")  # fmt: skip
    linear = (f"{len(spec.linear_attention_layers)} of them linear attention (a state slot a sequence), "
              if spec and spec.is_hybrid else "")  # fmt: skip
    console.print(
        f"model: {getattr(hf, 'model_type', '?')}, {getattr(hf, 'num_hidden_layers', '?')} layers, {linear}"
        f"{getattr(hf, 'num_attention_heads', '?')} attention heads, "
        f"{' / '.join(map(str, kv_heads)) or '?'} KV heads, {experts}"
        f"max_position_embeddings {getattr(hf, 'max_position_embeddings', '?')}",
        markup=False,
    )
    adapters = _adapters(config.loras, [], config)
    if adapters:
        console.print(f"LoRA adapters ({len(adapters)}, each checked against the model):", markup=False)
        for a in adapters:
            console.print(f"  {a['name']}: rank {a['rank']}, adapts {', '.join(a['targets'])} ({a['path']})",
                          markup=False)
    console.print("[bold green]ok:[/bold green] the configuration is valid.")
