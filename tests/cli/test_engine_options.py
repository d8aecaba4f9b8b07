"""The engine flags are declared once (cli/engine_options.py): every command spells and explains them alike."""

import pytest
import typer
from typer.testing import CliRunner

from nanoinfer.cli import app
from nanoinfer.cli.engine_options import (
    CHAT_FIELDS,
    FLAGS,
    LORA_FIELDS,
    POOLING_FIELDS,
    EngineOptions,
    engine_options,
)
from nanoinfer.config import settable_fields

COMMANDS = {  # command -> the engine fields it takes flags for
    "generate": set(FLAGS) - set(POOLING_FIELDS),  # embeddings' fields: `embed` takes them
    "check-config": set(FLAGS),
    # embed is the pooling runner; its lines name no adapter and hold no chat answers
    "embed": set(FLAGS) - {"runner", *LORA_FIELDS, *CHAT_FIELDS},
    "bench": set(FLAGS) - {"seed", "trust_remote_code", *POOLING_FIELDS, *CHAT_FIELDS},  # --seed: the workload's
    "plan-memory": {"model", "tensor_parallel_size", "dtype", "kv_cache_dtype", "max_model_len", "max_num_seqs",
                    "max_num_batched_tokens", "gpu_memory_utilization", "kvcache_block_size", "num_kvcache_blocks",
                    "num_speculative_tokens", "enable_lora", "max_loras", "max_lora_rank", "loras"},
}  # fmt: skip


def options_of(command: str) -> dict:
    group = typer.main.get_command(app)
    return {param.name: param for param in group.commands[command].params}


def test_every_settable_field_has_a_flag():
    assert set(FLAGS) == set(settable_fields())


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_command_takes_the_shared_flags_with_the_same_names_and_help(command):
    options = options_of(command)
    reference = options_of("check-config")  # it takes every flag
    if command == "bench":
        assert options.pop("seed").help == "Seed of the random workload."
    taken = {name for name in FLAGS if name in options}
    assert taken == COMMANDS[command]
    for name in taken:
        assert (options[name].opts, options[name].secondary_opts, options[name].help, options[name].default) == (
            reference[name].opts, reference[name].secondary_opts, reference[name].help, None
        )  # fmt: skip
    if command != "check-config":  # check-config takes the file as its argument
        assert options["config"].opts == ["--config"]


def test_the_command_gets_one_engine_options_with_what_was_given():
    seen = []
    cli = typer.Typer()

    @cli.command()
    @engine_options(["model", "max_num_seqs"])
    def run(engine: EngineOptions = None, verbose: bool = False):
        seen.append((engine, verbose))

    result = CliRunner().invoke(cli, ["--max-num-seqs", "8", "--config", "e.yaml", "--verbose"])
    assert result.exit_code == 0, result.output
    (engine, verbose), = seen
    assert verbose and str(engine.config_path) == "e.yaml"
    assert engine.overrides == {"model": None, "max_num_seqs": 8}  # None: not given, so YAML or the default applies


def test_a_flag_that_does_not_exist_is_a_bug_in_the_command():
    with pytest.raises(TypeError, match="no engine flag for"):
        engine_options(["max_num_seq"])
