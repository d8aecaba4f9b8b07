"""`nanoinfer generate`: stream a JSONL file of prompts through the engine into a JSONL file of records.

Checks the files, the config and the resume manifest before any model loads, then reads the input lazily,
keeps at most --max-in-flight requests in the engine and writes each record as its request finishes.
Parsing lines and writing records is `nanoinfer.jsonl`'s job; the bar and summary are `nanoinfer.progress`'s.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from nanoinfer.cli import app, err_console, user_errors
from nanoinfer.cli.engine_options import POOLING_FIELDS, EngineOptions, engine_options
from nanoinfer.errors import BatchFileError, NanoInferError, OutputWriteError, ReplicaError, RequestError
from nanoinfer.jobs.line_runner import FinishedLine, LineRunner
from nanoinfer.jsonl.lines import BadLine
from nanoinfer.jsonl.manifest import (
    make_manifest,
    manifest_differences,
    manifest_path,
    prepare_resume,
    read_manifest,
    write_manifest,
)
from nanoinfer.jsonl.reader import MAX_LINE_BYTES, BatchReader, scan_input
from nanoinfer.jsonl.requests import (
    ANY_WHITESPACE_DEFAULT,
    CHAT_TEMPLATE_KWARGS_DEFAULT,
    DEFAULT_MAX_TOKENS,
    make_params,
)
from nanoinfer.jsonl.writer import RecordWriter
from nanoinfer.progress import JobProgress
from nanoinfer.tokenizer import template_kwargs_problem

logger = logging.getLogger("nanoinfer")

MAX_IN_FLIGHT_CAP = 4096  # the default is 4 x max_num_seqs, at most this
# A job of this many output tokens (lines x the default max_tokens) waits for the CPU kernels unless cpu_kernels is
# set: plain torch is several times slower, so such a job gains more than their one-time build (~2 minutes) costs.
WAIT_FOR_CPU_KERNELS_TOKENS = 16_384
EXIT_OUTPUT_FAILED = 74  # sysexits' EX_IOERR: the output could not take more records (disk full, EIO)
EXIT_CLOSED_PIPE = 141  # 128 + SIGPIPE, what a Unix tool killed by a closed pipe exits with
_LOG_LEVELS = ("debug", "info", "warning", "error")
_SAMPLING = "Sampling defaults (a line's own fields win)"
_RAY = "Many machines (Ray)"


# The job options `generate` and `embed` share, declared once.
ResumeOption = Annotated[bool, typer.Option("--resume", help="Continue an interrupted job into OUTPUT.")]
OverwriteOption = Annotated[bool, typer.Option("--overwrite", help="Replace OUTPUT if it exists.")]
QuietOption = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar; a plain log line every 10 s.")]
JsonOption = Annotated[
    bool, typer.Option("--json", help="Print the final summary as JSON on stdout (stderr when -o -).")
]
MaxLineBytesOption = Annotated[
    int, typer.Option("--max-line-bytes", help="Longer input lines get an error record, unread.")
]
LogLevelOption = Annotated[
    str | None, typer.Option("--log-level", help=f"Log to stderr at this level: {', '.join(_LOG_LEVELS)}.")
]


def _opt(*names: str, help: str, panel: str | None = None):
    return typer.Option(*names, help=help, rich_help_panel=panel)


@dataclass
class Job:
    """Everything checked before the model loads."""

    input_path: Path | None  # None: stdin
    output_path: Path | None  # None: stdout
    config: object
    sampling_defaults: dict
    resume: bool
    overwrite: bool
    max_in_flight: int
    max_line_bytes: int = MAX_LINE_BYTES
    total: int | None = None
    manifest: dict | None = None
    command: str = "generate"  # the subcommand running the job (`embed` reuses all of this), for messages
    parse: Callable | None = None  # the BatchReader's line parser (None: generate's)


class Stopper:
    """SIGINT/SIGTERM: the first stops admitting work (the loop then exits cleanly); a second exits at once."""

    def __init__(self, command: str = "generate"):
        self.command = command
        self.signum: int | None = None
        self.started = False  # past loading: from here on an interrupt is handled by the loop
        self._previous = {}

    def install(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    @property
    def stopping(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or 0)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            # Every record written so far is already in the kernel (one write() each): safe to leave now.
            os.write(2, f"\nnanoinfer {self.command}: second interrupt, exiting now. Resume with --resume.\n".encode())
            os._exit(128 + signum)
        self.signum = signum
        if not self.started:
            raise KeyboardInterrupt  # still checking or loading: nothing to flush
        message = f"\nnanoinfer {self.command}: stopping after this step (interrupt again to exit at once)\n"
        os.write(2, message.encode())


@app.command("generate")
@engine_options(exclude=POOLING_FIELDS)
def generate(
    input: Annotated[
        str,
        typer.Argument(help="JSONL file of prompts, or - for stdin.", metavar="INPUT", show_default=False),
    ],
    output: Annotated[str, typer.Option("--output", "-o", help="JSONL file of records, or - for stdout.")],
    engine: EngineOptions = None,  # @engine_options puts --config and the engine flags here
    temperature: Annotated[
        float | None, _opt("--temperature", help="0 = greedy (default 1.0).", panel=_SAMPLING)
    ] = None,
    top_p: Annotated[
        float | None, _opt("--top-p", help="Nucleus sampling, in (0, 1].", panel=_SAMPLING)
    ] = None,
    top_k: Annotated[int | None, _opt("--top-k", help="Top-k filtering; -1 = off.", panel=_SAMPLING)] = None,
    min_p: Annotated[
        float | None, _opt("--min-p", help="Min-probability filtering.", panel=_SAMPLING)
    ] = None,
    max_tokens: Annotated[
        int | None,
        _opt(
            "--max-tokens",
            help=f"Most tokens to generate per sequence (default {DEFAULT_MAX_TOKENS}).",
            panel=_SAMPLING,
        ),
    ] = None,
    min_tokens: Annotated[
        int | None, _opt("--min-tokens", help="Stop conditions wait for this many tokens.", panel=_SAMPLING)
    ] = None,
    repetition_penalty: Annotated[
        float | None, _opt("--repetition-penalty", help="HF-style, > 1 discourages repeats.", panel=_SAMPLING)
    ] = None,
    presence_penalty: Annotated[
        float | None, _opt("--presence-penalty", help="OpenAI-style, in [-2, 2].", panel=_SAMPLING)
    ] = None,
    frequency_penalty: Annotated[
        float | None, _opt("--frequency-penalty", help="OpenAI-style, in [-2, 2].", panel=_SAMPLING)
    ] = None,
    stop: Annotated[
        list[str] | None, _opt("--stop", help="A stop string (repeat for several).", panel=_SAMPLING)
    ] = None,
    ignore_eos: Annotated[
        bool | None, _opt("--ignore-eos/--no-ignore-eos", help="Generate past EOS.", panel=_SAMPLING)
    ] = None,
    n: Annotated[int | None, _opt("--n", help="Sequences per prompt.", panel=_SAMPLING)] = None,
    logprobs: Annotated[
        int | None,
        _opt("--logprobs", help="Return each token's logprob and this many alternatives.", panel=_SAMPLING),
    ] = None,
    json_schema: Annotated[
        Path | None,
        _opt("--json-schema", help="Constrain every output to this JSON schema (a file).", panel=_SAMPLING),
    ] = None,
    json_any_whitespace: Annotated[
        bool | None,
        _opt("--json-any-whitespace/--no-json-any-whitespace",
             help="Let JSON outputs hold free whitespace (default: as json.dumps writes it).", panel=_SAMPLING),
    ] = None,
    chat_template_kwargs: Annotated[
        str | None,
        _opt("--chat-template-kwargs",
             help='Options for the chat template of every chat line, as JSON, e.g. \'{"enable_thinking": false}\' '
                  '(a line\'s own chat_template_kwargs win).', panel=_SAMPLING),
    ] = None,
    resume: ResumeOption = False,
    overwrite: OverwriteOption = False,
    quiet: QuietOption = False,
    json_output: JsonOption = False,
    max_in_flight: Annotated[
        int | None,
        typer.Option(
            "--max-in-flight",
            help=f"Most requests in the engine (in each replica) at once (default 4 x max_num_seqs, at most "
            f"{MAX_IN_FLIGHT_CAP}).",
        ),
    ] = None,
    max_line_bytes: MaxLineBytesOption = MAX_LINE_BYTES,
    log_level: LogLevelOption = None,
    data_parallel_size: Annotated[
        int,
        _opt("--data-parallel-size", help="Engine replicas, each with all the settings above, run as Ray actors "
             "(pip install 'nanoinfer\\[ray]'); 1: one engine in this process.", panel=_RAY),
    ] = 1,
    ray_address: Annotated[
        str | None,
        _opt("--ray-address", help="Run the replicas on this Ray cluster (auto: the one `ray start` runs "
             "here; HOST:PORT: its head) instead of a local Ray instance started for the job.", panel=_RAY),
    ] = None,
):
    """Generate a completion for every line of a JSONL file, writing one JSONL record per line.

    Input lines: {"prompt": "..."}, {"messages": [...]} (chat template) or {"prompt_token_ids": [...]},
    with an optional "id" (default "line-N") and optional sampling fields (temperature, top_p, top_k,
    min_p, max_tokens, stop, seed, n, ignore_eos, logprobs, ...) that override the flags below, and an
    optional "lora": NAME to run with the adapter --lora NAME=PATH names. OpenAI batch lines ({"custom_id",
    "method", "url", "body"} for /v1/chat/completions or /v1/completions) are answered in the OpenAI batch
    output format; a body.model naming an adapter selects it, any other model name is the base model.

    Records are written as requests finish: {"id", "line", "text", "finish_reason", "stop_reason",
    "usage", "error"} ("choices" instead of "text" when n > 1; "lora" when an adapter ran). A bad line gets
    a record whose "error" has a code and a message naming the line; the job goes on.
    max_tokens defaults to 256.

    Interrupted (Ctrl-C, kill -9, power loss)? Run the same command with --resume: finished records are
    kept, a torn last line is cut, the rest is generated. Exit codes: 0 done (even if some lines had
    errors), 2 bad files or config (before any model loads), 74 the output could not be written (disk
    full, I/O error: free space and --resume), 141 stdout was closed (e.g. | head), 130/143 interrupted.

    Many machines: --data-parallel-size N runs N engine replicas on Ray, with the same records and the same
    --resume (also with another N); a replica that dies has its lines retried on the others.
    """
    flags = {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "max_tokens": max_tokens,
        "min_tokens": min_tokens,
        "repetition_penalty": repetition_penalty,
        "presence_penalty": presence_penalty,
        "frequency_penalty": frequency_penalty,
        "stop": stop or None,
        "ignore_eos": ignore_eos,
        "n": n,
        "logprobs": logprobs,
        "structured_outputs": json_schema,  # the file's path: prepare_job reads it
        ANY_WHITESPACE_DEFAULT: json_any_whitespace,
        CHAT_TEMPLATE_KWARGS_DEFAULT: chat_template_kwargs,  # JSON text: prepare_job reads it
    }
    stopper = Stopper()
    stopper.install()
    replicas = None
    try:
        with user_errors():
            _configure_logging(log_level)
            ray_replicas = _ray_replicas(data_parallel_size, ray_address)
            job = prepare_job(input, output, engine, flags, resume, overwrite, max_in_flight)
            if max_line_bytes < 1:
                raise BatchFileError(f"--max-line-bytes must be >= 1, got {max_line_bytes}.")
            job.max_line_bytes = max_line_bytes
            if ray_replicas is None:
                llm, loop = load_llm(job.config), stream_requests
            else:
                llm = replicas = ray_replicas.ReplicaPool(job.config, data_parallel_size, ray_address, notify=_note)
                loop = ray_replicas.stream_requests
                if not quiet:
                    _note(f"nanoinfer generate: started {replicas.description} on Ray")
        code = run_job(job, llm, stopper, quiet=quiet, json_output=json_output, loop=loop)
    except KeyboardInterrupt:
        code = stopper.exit_code if stopper.signum else 130
        err_console.print("nanoinfer generate: interrupted before generation started; nothing was written.")
    finally:
        if replicas is not None:
            replicas.close()
        stopper.restore()
    if code:
        raise typer.Exit(code=code)


def _ray_replicas(data_parallel_size: int, ray_address: str | None):
    """The Ray replicas module when the job runs on Ray (--data-parallel-size > 1 or --ray-address), else None."""
    if data_parallel_size < 1:
        raise BatchFileError(f"--data-parallel-size must be >= 1, got {data_parallel_size}.")
    if data_parallel_size == 1 and ray_address is None:
        return None
    try:
        from nanoinfer.jobs import ray_replicas
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != "ray":
            raise
        raise ReplicaError(
            f"--data-parallel-size {data_parallel_size} runs the engine replicas on Ray, which is not installed "
            "here. Install it with `pip install 'nanoinfer[ray]'`, or run one engine (--data-parallel-size 1)."
        ) from None
    return ray_replicas


def _configure_logging(level: str | None) -> None:
    if level is None:
        return
    if level.lower() not in _LOG_LEVELS:
        raise BatchFileError(f"--log-level must be one of {', '.join(_LOG_LEVELS)}, got {level!r}.")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level.upper())


# ---- before the model loads ---------------------------------------------------------------------------------
def prepare_job(
    input: str,
    output: str,
    engine: EngineOptions,
    flags: dict,
    resume: bool,
    overwrite: bool,
    max_in_flight: int | None,
) -> Job:
    """Every file-level and config check; raises a NanoInferError (exit 2) before anything is loaded."""
    input_path, output_path = check_files(input, output, resume, overwrite)
    sampling_defaults = {k: v for k, v in flags.items() if v is not None}
    sampling_defaults.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
    if "structured_outputs" in sampling_defaults:
        sampling_defaults["structured_outputs"] = {"json": _read_json_schema(sampling_defaults["structured_outputs"])}
    if CHAT_TEMPLATE_KWARGS_DEFAULT in sampling_defaults:
        sampling_defaults[CHAT_TEMPLATE_KWARGS_DEFAULT] = _read_chat_template_kwargs(
            sampling_defaults[CHAT_TEMPLATE_KWARGS_DEFAULT])
    try:
        make_params(sampling_defaults, {})
    except BadLine as e:
        raise RequestError(f"the sampling flags are invalid: {e.message}") from None
    # Counted before the Config is built: a large job's default for cpu_kernels depends on it.
    sha256, num_lines = scan_input(input_path) if input_path is not None else (None, None)
    config = engine.build(defaults=engine_defaults(num_lines, sampling_defaults["max_tokens"]), runner="generate")
    return make_job(input_path, output_path, config, sampling_defaults, resume, overwrite, max_in_flight,
                    sha256, num_lines)


def check_files(input: str, output: str, resume: bool, overwrite: bool) -> tuple[Path | None, Path | None]:
    """(input path, output path), None for stdin/stdout, once the flags and files can make a job (else exit 2)."""
    if resume and overwrite:
        raise BatchFileError(
            "--resume and --overwrite contradict each other: --resume continues OUTPUT, "
            "--overwrite starts it over. Pass one of them."
        )
    input_path = None if input == "-" else Path(input)
    output_path = None if output == "-" else Path(output)
    if input_path is not None and not input_path.is_file():
        what = "is a folder" if input_path.is_dir() else "does not exist"
        raise BatchFileError(f"input file {input_path} {what}. Pass a JSONL file of prompts, or - for stdin.")
    if output_path is None and resume:
        raise BatchFileError(
            "--resume needs an output file: records written to stdout cannot be resumed. Pass -o FILE."
        )
    if input_path is None and resume:
        raise BatchFileError(
            "--resume needs an input file: stdin cannot be read again to check it is the "
            "same input. Save it to a file first."
        )
    if output_path is not None:
        _check_output_path(input_path, output_path, resume, overwrite)
    return input_path, output_path


def make_job(input_path: Path | None, output_path: Path | None, config, sampling_defaults: dict, resume: bool,
             overwrite: bool, max_in_flight: int | None, sha256: str | None, num_lines: int | None) -> Job:
    """The Job and its resume manifest (`sampling_defaults` is what a resumed run must repeat); checks an existing
    output's manifest on --resume."""
    if max_in_flight is None:
        max_in_flight = min(4 * config.max_num_seqs, MAX_IN_FLIGHT_CAP)
    elif max_in_flight < 1:
        raise BatchFileError(f"--max-in-flight must be >= 1, got {max_in_flight}.")
    job = Job(input_path, output_path, config, sampling_defaults, resume, overwrite, max_in_flight, total=num_lines)
    if output_path is not None:
        job.manifest = make_manifest(
            input_path or Path("-"), sha256, num_lines, config, sampling_defaults
        )
        if resume and output_path.exists():
            _check_manifest(output_path, job.manifest)
    return job


def engine_defaults(num_lines: int | None, max_tokens: int) -> dict:
    """generate's own Config defaults (a flag or the YAML file wins): a large job waits for the CPU kernels.

    num_lines: the input's non-blank lines (None: stdin, not known in advance). With --resume all of them count:
    what remains is known only once the output is read, after the model loads, and the run that started a large
    job on this machine has built the kernels already, so waiting for them then costs nothing.
    """
    if num_lines is not None and num_lines * max_tokens >= WAIT_FOR_CPU_KERNELS_TOKENS:
        return {"cpu_kernels": "wait"}
    return {}


def _read_chat_template_kwargs(text: str) -> dict:
    """--chat-template-kwargs: a JSON object, or a RequestError saying what it is instead."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise RequestError(f"--chat-template-kwargs is not JSON ({e}): give an object, e.g. "
                           "'{\"enable_thinking\": false}'.") from None
    if (problem := template_kwargs_problem(value)) is not None:
        raise RequestError(f"--chat-template-kwargs {problem}")
    return value


def _read_json_schema(path: Path) -> dict:
    """--json-schema's file: JSON text of a schema xgrammar can turn into a grammar (checked before loading)."""
    try:
        schema = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BatchFileError(f"--json-schema {path} cannot be read as JSON ({e}). Pass a file holding a JSON "
                             "schema, e.g. {\"type\": \"object\", \"properties\": {...}}.") from None
    if not isinstance(schema, dict):
        raise BatchFileError(f"--json-schema {path} holds a JSON {type(schema).__name__}, not a schema object.")
    try:
        import xgrammar

        xgrammar.Grammar.from_json_schema(json.dumps(schema))
    except Exception as e:  # xgrammar raises RuntimeError with its own message for a schema it cannot use
        raise BatchFileError(f"--json-schema {path} cannot be used: {str(e).strip().splitlines()[-1][:300]}. "
                             "Fix the schema or leave the flag out.") from None
    return schema


def _check_output_path(input_path: Path | None, output_path: Path, resume: bool, overwrite: bool) -> None:
    if not output_path.parent.is_dir():
        raise BatchFileError(
            f"the folder of the output file, {output_path.parent}, does not exist. Create it "
            "or pass another -o."
        )
    if output_path.is_dir():
        raise BatchFileError(f"output {output_path} is a folder; pass a file path to -o.")
    if input_path is not None and (
        output_path.resolve() == input_path.resolve()
        or (output_path.exists() and output_path.samefile(input_path))
    ):
        raise BatchFileError(
            f"the output {output_path} is the input file; writing to it would destroy the "
            "prompts. Pass another -o."
        )
    if output_path.exists() and not (resume or overwrite):
        raise BatchFileError(
            f"output {output_path} already exists. Pass --resume to continue that job, or "
            "--overwrite to replace the file."
        )


def _check_manifest(output_path: Path, manifest: dict) -> None:
    path = manifest_path(output_path)
    if not path.is_file():
        raise BatchFileError(
            f"cannot resume {output_path}: its manifest {path} is missing, so nothing shows "
            "which input, model and settings produced it. Pass --overwrite to start over, "
            "or move the file away."
        )
    differences = manifest_differences(read_manifest(path), manifest)
    if differences:
        lines = "\n".join(f"  - {d}" for d in differences)
        raise BatchFileError(
            f"cannot resume {output_path}: it was started with other inputs or settings, and "
            f"mixing them would give a file of inconsistent records:\n{lines}\nRun the "
            "command it was started with, or pass --overwrite to start over."
        )


def load_llm(config):
    from nanoinfer.llm import LLM

    return LLM(config=config)


# ---- the loop -------------------------------------------------------------------------------------------------
def run_job(job: Job, llm, stopper: Stopper, quiet: bool = False, json_output: bool = False, loop=None) -> int:
    """Start (or resume) the output, stream the input through `llm` (or Ray replicas, with their `loop`);
    returns the exit code."""
    stopper.started = True
    where = "stdout" if job.output_path is None else str(job.output_path)
    done_lines: set[int] = set()
    writer = None
    try:
        done_lines = _start_output(job)
        writer = RecordWriter(
            job.output_path, stdout=sys.stdout.buffer if job.output_path is None else None
        )
    except OSError as e:
        return _output_failed(job, OutputWriteError(
            f"starting {where} failed: {e.strerror or e} (errno {e.errno}).", errno=e.errno), len(done_lines))
    plain = quiet or not sys.stderr.isatty()
    progress = JobProgress(job.total, num_skipped=len(done_lines), plain=plain, task=job.command)
    if not quiet:
        lines = f"{job.total} lines" if job.total is not None else "stdin"
        _note(f"nanoinfer {job.command}: {lines} -> {where} with {job.config.model}")
    try:
        with contextlib.ExitStack() as stack:
            stack.callback(writer.close)  # fsync at exit, also when the loop raises
            stream = (
                sys.stdin.buffer if job.input_path is None else stack.enter_context(open(job.input_path, "rb"))
            )
            reader = BatchReader(stream, job.sampling_defaults, done_lines, job.max_line_bytes, parse=job.parse)
            with progress:
                (loop or stream_requests)(llm, reader, writer, progress, job.max_in_flight, stopper)
    except OutputWriteError as e:
        return _output_failed(job, e, len(done_lines) + writer.num_written)
    except NanoInferError as e:
        # Mid-run failure (e.g. a tensor-parallel worker died): finished records are on disk.
        err_console.print(f"[bold red]error:[/bold red] {escape(str(e))}", highlight=False)
        err_console.print(f"Finished records are in {escape(where)}; run the same command with --resume to "
                          "continue.", highlight=False)
        return 1
    if stopper.stopping:
        name = signal.Signals(stopper.signum).name
        total = f" of {job.total}" if job.total is not None else ""
        how = (
            "Run the same command with --resume to finish the job."
            if job.output_path is not None
            else "Output went to stdout, so it cannot be resumed; rerun with -o FILE."
        )
        _note(f"{name}: stopped. {len(done_lines) + progress.num_done}{total} records are in {where}. {how}")
        return stopper.exit_code
    _note(f"done: {progress.summary_text()}; wrote {where}")
    if json_output:
        summary = {**progress.summary(), "output": where, "model": job.config.model}
        with contextlib.suppress(BrokenPipeError):
            print(json.dumps(summary), file=sys.stdout if job.output_path is not None else sys.stderr, flush=True)
    return 0


def _output_failed(job: Job, failure: OutputWriteError, num_records: int) -> int:
    """Report a failed output once, clearly; a closed stdout ends quietly, as Unix tools do."""
    if job.output_path is None:
        _silence_stdout()  # what Python still holds for stdout must not fail again at exit
        if failure.closed_pipe:
            return EXIT_CLOSED_PIPE
        err_console.print(f"[bold red]error:[/bold red] {escape(str(failure))} Output went to stdout, so it "
                          "cannot be resumed; rerun with -o FILE.", highlight=False)
        return EXIT_OUTPUT_FAILED
    total = f" of {job.total}" if job.total is not None else ""
    err_console.print(
        f"[bold red]error:[/bold red] {escape(str(failure))}\n{num_records}{total} records are safely in "
        f"{escape(str(job.output_path))}, none of them torn, and its resume manifest is intact. Free space "
        "(or fix the device) and run the same command with --resume to finish the job.",
        highlight=False,
    )
    return EXIT_OUTPUT_FAILED


def _silence_stdout() -> None:
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _start_output(job: Job) -> set[int]:
    """Resume (cut a torn tail, collect answered lines) or start the output; write the manifest first."""
    if job.output_path is None:
        return set()
    done_lines: set[int] = set()
    if job.resume and job.output_path.exists():
        state = prepare_resume(job.output_path)
        done_lines = state.done_lines
        message = f"resuming {job.output_path}: {len(done_lines)} records already written"
        if state.num_cut_bytes:
            message += f"; cut {state.num_cut_bytes} bytes of a torn or unreadable tail"
        if state.num_dropped_records:
            message += f" ({state.num_dropped_records} records after it will be redone)"
        _note(message)
    elif job.output_path.exists():
        job.output_path.unlink()  # --overwrite: old records go first, so no new manifest vouches for them
    write_manifest(manifest_path(job.output_path), job.manifest)
    return done_lines


def stream_requests(
    llm,
    reader: BatchReader,
    writer: RecordWriter,
    progress: JobProgress,
    max_in_flight: int,
    stopper: Stopper,
    runner: LineRunner | None = None,
) -> None:
    """Admit lines while fewer than max_in_flight requests are in the engine; write each one as it ends.
    `runner`: what turns lines into requests and finished requests into records (default: LineRunner(llm))."""
    for event in (runner or LineRunner(llm)).run(reader, max_in_flight, lambda: stopper.stopping):
        if isinstance(event, FinishedLine):
            write_finished(writer, progress, event)
        else:  # the end of an engine step
            progress.on_step(event.num_prefill_tokens, event.num_decode_tokens, event.num_preempted,
                             event.num_draft_tokens, event.num_accepted_tokens)
            writer.sync_if_due()


def write_finished(writer: RecordWriter, progress: JobProgress, finished: FinishedLine) -> None:
    writer.write(finished.record)
    progress.on_record(finished.usage, finished.is_error)


def _note(message: str) -> None:
    err_console.print(message, markup=False, highlight=False)
