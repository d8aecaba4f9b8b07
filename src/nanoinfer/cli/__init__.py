"""The `nanoinfer` command line: flags -> Config -> engine -> rich output.

Each subcommand lives in its own module and registers itself on `app`. The only error boundary is
`run_command`: a NanoInferError is printed without a traceback and exits 2 (Click's code for bad usage);
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import typer
from rich.console import Console
from rich.markup import escape

from nanoinfer.errors import NanoInferError

app = typer.Typer(
    name="nanoinfer",
    help="Offline batch generation for LLMs: JSONL prompts in, JSONL completions out.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
err_console = Console(stderr=True, soft_wrap=True)


@contextmanager
def user_errors():
    """Turn a NanoInferError into a clear message and exit code 2."""
    try:
        yield
    except NanoInferError as e:
        err_console.print(f"[bold red]error:[/bold red] {escape(str(e))}", highlight=False)
        raise typer.Exit(code=2) from None


def _register() -> None:
    # Imported for their side effect: each module adds its command to `app`.
    import importlib

    for name in ("check_config", "generate", "embed", "plan_memory", "bench"):
        try:
            importlib.import_module(f"nanoinfer.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"nanoinfer.cli.{name}":
                raise


_register()


def main() -> None:  # pragma: no cover - console entry point
    sys.exit(app())
