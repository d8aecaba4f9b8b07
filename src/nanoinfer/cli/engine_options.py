"""The engine flags, one per Config field, declared once and shared by every command that builds a Config.

`@engine_options()` puts the flags (and `--config FILE`) into a command's signature where its `engine: EngineOptions`
parameter is, and calls the command with one EngineOptions: the file and the value of each flag, None when it was
not given. `engine.build()` then applies flag > YAML > default (config_file.merge_settings, the one place that
does) and resolves the model argument before the Config is built.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import typer


def _flag(kind, *names: str, help: str):
    # None means "not given": the YAML value or the default applies.
    return Annotated[kind | None, typer.Option(*names, help=help)]


# Config field -> its flag, in the order --help lists them.
FLAGS = {
    "model": _flag(str, "--model", help="Model folder, .gguf file, 'smollm2-135m-instruct' or a hub repo id."),
    "max_num_batched_tokens": _flag(int, "--max-num-batched-tokens", help="Most tokens in one forward pass."),
    "max_num_seqs": _flag(int, "--max-num-seqs", help="Most sequences in one forward pass."),
    "max_model_len": _flag(int, "--max-model-len", help="Most tokens (prompt + output) in one sequence."),
    "gpu_memory_utilization": _flag(
        float, "--gpu-memory-utilization", help="Fraction of GPU memory the engine may use, in (0, 1]."
    ),
    "tensor_parallel_size": _flag(
        int, "--tensor-parallel-size", "--tp", help="Ranks (GPUs) the weights are sharded over (1..8)."
    ),
    "enforce_eager": _flag(bool, "--enforce-eager/--no-enforce-eager", help="Disable CUDA graphs for decode."),
    "kvcache_block_size": _flag(int, "--kvcache-block-size", help="Tokens per KV-cache block (multiple of 256)."),
    "num_kvcache_blocks": _flag(int, "--num-kvcache-blocks", help="Total KV-cache blocks; -1 sizes it from memory."),
    "device": _flag(str, "--device", help="auto | cpu | cuda."),
    "dtype": _flag(str, "--dtype", help="auto | float32 | bfloat16 | float16."),
    "kv_cache_dtype": _flag(
        str,
        "--kv-cache-dtype",
        help="auto (the model's dtype) | float32 | bfloat16 | float16 | fp8 (= fp8_e4m3) | fp8_e5m2: the KV cache's.",
    ),
    "attention_backend": _flag(str, "--attention-backend", help="auto | torch | triton | flash-attn."),
    "seed": _flag(int, "--seed", help="Sampling seed for requests that give none."),
    "cpu_kvcache_space_gib": _flag(float, "--cpu-kvcache-space-gib", help="KV-cache budget on CPU, in GiB."),
    "enable_prefix_caching": _flag(
        bool, "--enable-prefix-caching/--no-enable-prefix-caching", help="Reuse KV blocks of shared prefixes."
    ),
    "num_threads": _flag(int, "--num-threads", help="Torch threads on CPU; 0 = one per physical core."),
    "cpu_kernels": _flag(
        str,
        "--cpu-kernels",
        help="auto (the C++ CPU kernels when built here, else built in the background for the next run) | wait "
        "(build them now, about 2 minutes once per machine) | off (plain torch). Default auto; generate waits for "
        "jobs of 16,384+ output tokens, bench always waits.",
    ),
    "num_speculative_tokens": _flag(
        int,
        "--num-speculative-tokens",
        help="n-gram speculative decoding: tokens proposed per greedy sequence a step (0 = off, up to 16).",
    ),
    "prompt_lookup_min": _flag(int, "--prompt-lookup-min", help="Shortest n-gram matched by speculation (1..8)."),
    "prompt_lookup_max": _flag(int, "--prompt-lookup-max", help="Longest n-gram matched by speculation (1..8)."),
    "trust_remote_code": _flag(
        bool, "--trust-remote-code/--no-trust-remote-code", help="Let transformers run the model's own code."
    ),
    "runner": _flag(str, "--runner", help="generate | pooling (embeddings)."),
    "pooling_type": _flag(
        str, "--pooling", help="last | mean | cls (default: the model's sentence-transformers config, else last)."
    ),
    "normalize": _flag(
        bool, "--normalize/--no-normalize",
        help="L2-normalize embeddings (default: the model's sentence-transformers config, else normalize).",
    ),
    "enable_lora": _flag(
        bool, "--enable-lora/--no-enable-lora", help="Run PEFT LoRA adapters (on when --lora names any)."
    ),
    "max_loras": _flag(int, "--max-loras", help="Most adapters one step runs; 0 = as many as --lora names (<= 8)."),
    "max_lora_rank": _flag(int, "--max-lora-rank", help="Largest adapter rank accepted (1..512); default 16."),
    "max_cpu_loras": _flag(int, "--max-cpu-loras", help="Most adapters kept read in host memory; 0 = auto."),
    "loras": _flag(
        list[str], "--lora",
        help="NAME=PATH: a PEFT adapter folder a line selects with \"lora\": NAME (OpenAI lines: body.model). Repeat "
        "for more; added to the config file's loras.",
    ),
    "reasoning_parser": _flag(
        str, "--reasoning-parser", help="auto | none | think | harmony: how chat answers' reasoning_content splits off."
    ),
    "tool_call_parser": _flag(
        str, "--tool-call-parser",
        help="auto | none | hermes | llama3_json | mistral | harmony: how chat answers' tool calls are parsed.",
    ),
}
# The pooling runner's fields: only commands that make embeddings take them.
POOLING_FIELDS = ("runner", "pooling_type", "normalize")
# LoRA's fields: commands that generate (and check-config, plan-memory) take them.
LORA_FIELDS = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "loras")
# How chat answers are read: commands that write chat records (and check-config) take them.
CHAT_FIELDS = ("reasoning_parser", "tool_call_parser")
ConfigFileOption = Annotated[Path | None, typer.Option("--config", help="Engine YAML; flags override its values.")]


@dataclass
class EngineOptions:
    """What a command was given for the engine: a YAML file (or None) and each engine flag's value (None: not given)."""

    config_path: Path | None
    overrides: dict = field(default_factory=dict)

    def merge(self, defaults: dict | None = None) -> tuple[dict, dict, list]:
        """(values, field -> "flag" | "yaml" | "default", the file's problems): see config_file.merge_settings."""
        from nanoinfer.config_file import merge_settings

        return merge_settings(self.config_path, self.overrides, defaults)

    def build(self, defaults: dict | None = None, runner: str | None = None):
        """The Config: flag > YAML > the command's `defaults` > Config's, the model argument resolved first
        (config_file.build_config). `runner`: what the command runs (generate: text); a YAML file asking for the other
        is a ConfigError before any model loads."""
        from nanoinfer.config_file import build_config
        from nanoinfer.errors import ConfigError, ConfigProblem

        config = build_config(self.config_path, self.overrides, defaults)
        if runner is not None and config.runner != runner:
            raise ConfigError([ConfigProblem("runner", config.runner, f"must be {runner} for this command (it makes "
                                             "text; `nanoinfer embed` makes embeddings). Remove runner from the "
                                             "config file.")])  # fmt: skip
        return config


def parse_lora_flags(values: list[str]) -> dict | None:
    """--lora NAME=PATH flags -> {NAME: PATH} (None when none was given); a ConfigError for a malformed one."""
    from nanoinfer.errors import ConfigError, ConfigProblem

    loras, problems = {}, []
    for value in values or ():
        name, sep, path = value.partition("=")
        if not sep or not name.strip() or not path.strip():
            problems.append(ConfigProblem("loras", value, "--lora takes NAME=PATH, e.g. --lora support=./adapters/"
                                          "support (the name lines use, the PEFT adapter's folder)."))  # fmt: skip
        elif name.strip() in loras:
            problems.append(ConfigProblem("loras", value, f"names {name.strip()!r} twice: give each adapter its own "
                                          "name."))  # fmt: skip
        else:
            loras[name.strip()] = path.strip()
    if problems:
        raise ConfigError(problems)
    return loras or None


def engine_options(fields: Iterable[str] | None = None, *, exclude: Iterable[str] = (), config_option: bool = True):
    """Decorator: the command's `engine: EngineOptions` parameter becomes `--config` and one flag per field.

    Args:
        fields: the Config fields the command takes flags for (default: all of FLAGS), in FLAGS' order.
        exclude: fields left out (e.g. bench's own --seed is the workload's).
        config_option: add `--config FILE`; False for a command that takes the file its own way (check-config's
            argument), which then sets `engine.config_path` itself.
    """
    fields = list(FLAGS) if fields is None else list(fields)
    names = [name for name in FLAGS if name in fields and name not in set(exclude)]
    unknown = set(fields) - set(FLAGS)
    if unknown:  # a command asked for a flag that does not exist: a bug in that command
        raise TypeError(f"no engine flag for {sorted(unknown)}")

    def decorate(command):
        signature = inspect.signature(command, eval_str=True)
        params = list(signature.parameters.values())
        at = [p.name for p in params].index("engine")
        flag = inspect.Parameter.POSITIONAL_OR_KEYWORD
        added = [inspect.Parameter("config", flag, default=None, annotation=ConfigFileOption)] if config_option else []
        added += [inspect.Parameter(name, flag, default=None, annotation=FLAGS[name]) for name in names]
        params[at : at + 1] = added

        @functools.wraps(command)
        def with_engine_options(**kwargs):
            config_path = kwargs.pop("config") if config_option else None
            overrides = {name: kwargs.pop(name) for name in names}
            if overrides.get("loras") is not None:
                overrides["loras"] = parse_lora_flags(overrides["loras"])
            engine = EngineOptions(config_path, overrides)
            return command(**kwargs, engine=engine)

        # Typer reads the parameters from the signature, and their types from __annotations__.
        with_engine_options.__signature__ = signature.replace(parameters=params)
        with_engine_options.__annotations__ = {p.name: p.annotation for p in params if p.annotation is not p.empty}
        return with_engine_options

    return decorate
