"""`nanoinfer embed`: a JSONL file of texts in, a JSONL file of embeddings out, through the pooling runner.

The job machinery is generate's (cli/generate.py: file checks, resume manifest, RecordWriter, progress, signals,
exit codes); this module adds the embedding flags, forces runner=pooling, and plugs in the embedding line parser
(jsonl/embed.py) and EmbedLineRunner (jobs/embed_runner.py).
"""

from __future__ import annotations

from typing import Annotated

import typer

from nanoinfer.cli import app, err_console, user_errors
from nanoinfer.cli import generate as generate_cli
from nanoinfer.cli.engine_options import CHAT_FIELDS, LORA_FIELDS, EngineOptions, engine_options
from nanoinfer.errors import BatchFileError
from nanoinfer.jobs.embed_runner import EmbedLineRunner
from nanoinfer.jsonl.embed import parse_embedding
from nanoinfer.jsonl.openai import ENCODING_FORMATS
from nanoinfer.jsonl.reader import MAX_LINE_BYTES, scan_input

_EMBEDDING = "Embeddings (a line's own fields win)"


@app.command("embed")
@engine_options(exclude=("runner", *LORA_FIELDS, *CHAT_FIELDS))  # always the pooling runner; lines name no adapter
def embed(
    input: Annotated[
        str,
        typer.Argument(help="JSONL file of texts, or - for stdin.", metavar="INPUT", show_default=False),
    ],
    output: Annotated[str, typer.Option("--output", "-o", help="JSONL file of records, or - for stdout.")],
    engine: EngineOptions = None,  # @engine_options puts --config and the engine flags (--pooling, --normalize) here
    dimensions: Annotated[
        int | None,
        typer.Option("--dimensions", help="Keep the first N dimensions (Matryoshka models), before normalizing.",
                     rich_help_panel=_EMBEDDING),
    ] = None,
    embedding_format: Annotated[
        str,
        typer.Option("--embedding-format", help="float (a JSON list) | base64 (little-endian float32 bytes, as "
                     "OpenAI's encoding_format).", rich_help_panel=_EMBEDDING),
    ] = "float",
    resume: generate_cli.ResumeOption = False,
    overwrite: generate_cli.OverwriteOption = False,
    quiet: generate_cli.QuietOption = False,
    json_output: generate_cli.JsonOption = False,
    max_in_flight: Annotated[
        int | None,
        typer.Option("--max-in-flight", help="Most requests (inputs) in the engine at once (default 4 x "
                     f"max_num_seqs, at most {generate_cli.MAX_IN_FLIGHT_CAP})."),
    ] = None,
    max_line_bytes: generate_cli.MaxLineBytesOption = MAX_LINE_BYTES,
    log_level: generate_cli.LogLevelOption = None,
):
    """Embed every line of a JSONL file, writing one JSONL record per line.

    Input lines: {"input": "text"} or {"input": [101, 2023, ...]} (token ids), with an optional "id" (default
    "line-N") and optional "dimensions", "normalize" and "encoding_format" that override the flags. OpenAI batch
    lines ({"custom_id", "method": "POST", "url": "/v1/embeddings", "body": {"input", "model", "encoding_format",
    "dimensions"}}) are answered in the OpenAI batch output format; their input may be a list of texts (or of
    token-id lists), answered in one response with one data entry each.

    Records are written as lines finish: {"id", "line", "embedding", "usage", "error"}. A bad line gets a record
    whose "error" has a code and a message naming the line; the job goes on.

    Pooling (--pooling last|mean|cls) and --normalize default to the model folder's sentence-transformers config
    (modules.json, 1_Pooling/config.json, a Normalize module), else last token + normalize.

    Interrupted? Run the same command with --resume. Exit codes as `nanoinfer generate`: 0 done (even if some
    lines had errors), 2 bad files or config (before any model loads), 74 the output could not be written, 141
    stdout was closed, 130/143 interrupted.
    """
    stopper = generate_cli.Stopper("embed")
    stopper.install()
    try:
        with user_errors():
            generate_cli._configure_logging(log_level)
            job = prepare_job(input, output, engine, dimensions, embedding_format, resume, overwrite, max_in_flight,
                              max_line_bytes)
            llm = load_llm(job.config)
        code = generate_cli.run_job(job, llm, stopper, quiet=quiet, json_output=json_output, loop=stream_embeddings)
    except KeyboardInterrupt:
        code = stopper.exit_code if stopper.signum else 130
        err_console.print("nanoinfer embed: interrupted before embedding started; nothing was written.")
    finally:
        stopper.restore()
    if code:
        raise typer.Exit(code=code)


def prepare_job(input: str, output: str, engine: EngineOptions, dimensions: int | None, embedding_format: str,
                resume: bool, overwrite: bool, max_in_flight: int | None, max_line_bytes: int) -> generate_cli.Job:
    """generate's checks, plus the embedding flags; raises a NanoInferError (exit 2) before any model loads."""
    input_path, output_path = generate_cli.check_files(input, output, resume, overwrite)
    if embedding_format not in ENCODING_FORMATS:
        raise BatchFileError(f"--embedding-format must be one of {', '.join(ENCODING_FORMATS)}, got "
                             f"{embedding_format!r}.")
    if dimensions is not None and dimensions < 1:
        raise BatchFileError(f"--dimensions must be >= 1 (or left out: all of them), got {dimensions}.")
    if max_line_bytes < 1:
        raise BatchFileError(f"--max-line-bytes must be >= 1, got {max_line_bytes}.")
    sha256, num_lines = scan_input(input_path) if input_path is not None else (None, None)
    engine.overrides["runner"] = "pooling"
    config = engine.build()
    hidden_size = config.hf_config.hidden_size
    if dimensions is not None and dimensions > hidden_size:
        raise BatchFileError(f"--dimensions {dimensions} is more than the {hidden_size} dimensions of "
                             f"{config.model}'s embeddings. Ask for at most {hidden_size}, or leave it out.")
    # Also what a resumed job must repeat: pooling_type and normalize as the Config resolved them (flag, YAML, the
    # model's sentence-transformers config or the default), so that a changed folder or flag is caught.
    defaults = {"dimensions": dimensions, "encoding_format": embedding_format,
                "pooling_type": config.pooling_type, "normalize": config.normalize}
    job = generate_cli.make_job(input_path, output_path, config, defaults, resume, overwrite, max_in_flight, sha256,
                                num_lines)
    job.command, job.parse, job.max_line_bytes = "embed", parse_embedding, max_line_bytes
    return job


def load_llm(config):
    from nanoinfer.llm import LLM

    return LLM(config=config)


def stream_embeddings(llm, reader, writer, progress, max_in_flight, stopper) -> None:
    generate_cli.stream_requests(llm, reader, writer, progress, max_in_flight, stopper, runner=EmbedLineRunner(llm))
