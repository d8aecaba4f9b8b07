"""Progress of a `generate` or `embed` job on stderr: a rich bar on a terminal, plain periodic log lines otherwise.

Counts requests, errors and tokens from what the job reports (engine steps, written records) and turns
them into rates, an ETA and the final summary (text or a JSON-ready dict). Owns no I/O but stderr.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

RATE_WINDOW_SECONDS = 5.0  # live tok/s is measured over this sliding window


class JobProgress:
    """Live progress and the final summary of one job.

    Args:
        total: non-blank input lines (None when unknown, e.g. reading stdin).
        num_skipped: lines answered by an earlier run (--resume); they count as done.
        plain: no bar; a log line every `log_seconds` instead (--quiet, or stderr is not a terminal).
        task: the command's name, shown first; "embed" jobs make no output tokens, so their rate is of prompt tokens.
    """

    def __init__(
        self,
        total: int | None,
        num_skipped: int = 0,
        plain: bool = False,
        stream: TextIO | None = None,
        log_seconds: float = 10.0,
        task: str = "generate",
    ):
        self.task = task
        self.makes_tokens = task != "embed"
        self.total = total
        self.num_skipped = num_skipped
        self.stream = stream or sys.stderr
        self.plain = plain
        self.log_seconds = log_seconds
        self.num_done = 0  # records written by this run
        self.num_errors = 0
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.prefill_tokens = 0  # computed by the engine (prefix-cache hits excluded, recompute included)
        self.num_preempted = 0
        self.num_draft_tokens = 0  # n-gram speculation: tokens proposed, and the ones the model kept
        self.num_accepted_tokens = 0
        self.num_replica_failures = 0  # --data-parallel-size: replicas that died mid-job
        self.num_retries = 0  # lines sent to another replica after the one running them died
        self.start = time.monotonic()
        self._window: deque[tuple[float, int, int]] = deque()  # (time, prefill tokens, decode tokens)
        self._last_log = self.start
        self._bar: Progress | None = None
        self._task = None

    # ---- lifecycle -------------------------------------------------------------------------------------
    def __enter__(self):
        self.start = self._last_log = time.monotonic()
        if not self.plain:
            console = Console(file=self.stream, stderr=self.stream is sys.stderr)
            out = [TextColumn("out {task.fields[out]} tok/s")] if self.makes_tokens else []
            self._bar = Progress(
                TextColumn(f"[bold]{self.task}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("requests"),
                TextColumn("{task.fields[errors]}"),
                *out,
                TextColumn("prefill {task.fields[prefill]} tok/s"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=console,
                transient=False,
            )
            self._bar.start()
            self._task = self._bar.add_task(
                self.task, total=self.total, completed=self.num_skipped, errors="", out="-", prefill="-"
            )
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._refresh()
            self._bar.stop()
            self._bar = None

    # ---- events ------------------------------------------------------------------------------------------
    def on_step(self, num_prefill_tokens: int, num_decode_tokens: int, num_preempted: int = 0,
                num_draft_tokens: int = 0, num_accepted_tokens: int = 0) -> None:
        now = time.monotonic()
        self.prefill_tokens += num_prefill_tokens
        self.num_preempted += num_preempted
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        # The live output rate counts tokens generated: a refused proposed token was computed, not generated.
        generated = num_decode_tokens - (num_draft_tokens - num_accepted_tokens)
        self._window.append((now, num_prefill_tokens, generated))
        while self._window and now - self._window[0][0] > RATE_WINDOW_SECONDS:
            self._window.popleft()
        self._tick(now)

    def on_replica_failure(self, num_retried_lines: int) -> None:
        self.num_replica_failures += 1
        self.num_retries += num_retried_lines

    def on_record(self, usage: dict | None, is_error: bool) -> None:
        self.num_done += 1
        self.num_errors += is_error
        if usage:
            self.prompt_tokens += usage["prompt_tokens"]
            self.output_tokens += usage["completion_tokens"]
        self._tick(time.monotonic())

    # ---- numbers ---------------------------------------------------------------------------------------
    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def live_rates(self) -> tuple[float, float]:
        """(output tok/s, prefill tok/s) over the last few seconds."""
        if not self._window:
            return 0.0, 0.0
        span = max(time.monotonic() - self._window[0][0], 1e-3)
        return sum(w[2] for w in self._window) / span, sum(w[1] for w in self._window) / span

    def eta_seconds(self) -> float | None:
        if self.total is None or self.num_done == 0:
            return None
        remaining = self.total - self.num_skipped - self.num_done
        return max(remaining, 0) * self.elapsed / self.num_done

    def summary(self) -> dict:
        elapsed = self.elapsed
        return {
            "requests": self.num_done,
            "errors": self.num_errors,
            "skipped": self.num_skipped,
            "total": self.total,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "prefill_tokens_computed": self.prefill_tokens,
            "preemptions": self.num_preempted,
            "speculative_tokens_proposed": self.num_draft_tokens,
            "speculative_tokens_kept": self.num_accepted_tokens,
            "replica_failures": self.num_replica_failures,
            "retries": self.num_retries,
            "seconds": round(elapsed, 3),
            "requests_per_s": round(self.num_done / elapsed, 3) if elapsed > 0 else None,
            "output_tokens_per_s": round(self.output_tokens / elapsed, 2) if elapsed > 0 else None,
        }

    def summary_text(self) -> str:
        s = self.summary()
        skipped = f" (+{s['skipped']} from an earlier run)" if s["skipped"] else ""
        rate = s["output_tokens_per_s"] or 0.0
        proposed, kept = s["speculative_tokens_proposed"], s["speculative_tokens_kept"]
        speculation = f"; speculation kept {kept:,} of {proposed:,} proposed tokens" if proposed else ""
        failures = s["replica_failures"]
        retries = (
            f"; {failures} replica failure{'s' * (failures != 1)}, {s['retries']} lines retried" if failures else ""
        )
        if not self.makes_tokens:
            prompt_rate = s["prompt_tokens"] / s["seconds"] if s["seconds"] else 0.0
            return (f"{s['requests']} requests{skipped}, {s['errors']} errors; {s['prompt_tokens']} prompt tokens in "
                    f"{s['seconds']:.1f} s ({prompt_rate:.1f} prompt tok/s){retries}")
        return (
            f"{s['requests']} requests{skipped}, {s['errors']} errors; {s['prompt_tokens']} prompt tokens, "
            f"{s['output_tokens']} output tokens in {s['seconds']:.1f} s ({rate:.1f} output tok/s){speculation}"
            f"{retries}"
        )

    def log_line(self) -> str:
        out_rate, prefill_rate = self.live_rates()
        done = self.num_skipped + self.num_done
        of = f"/{self.total}" if self.total is not None else ""
        eta = self.eta_seconds()
        eta_text = f", ETA {_clock(eta)}" if eta is not None else ""
        out = f"out {out_rate:.1f} tok/s, " if self.makes_tokens else ""
        return (
            f"{self.task}: {done}{of} requests, {self.num_errors} errors, {out}"
            f"prefill {prefill_rate:.1f} tok/s, elapsed {_clock(self.elapsed)}{eta_text}"
        )

    # ---- display -----------------------------------------------------------------------------------------
    def _tick(self, now: float) -> None:
        if self._bar is not None:
            self._refresh()
        elif self.plain and now - self._last_log >= self.log_seconds:
            self._last_log = now
            print(self.log_line(), file=self.stream, flush=True)

    def _refresh(self) -> None:
        out_rate, prefill_rate = self.live_rates()
        errors = f"[red]{self.num_errors} errors[/red]" if self.num_errors else ""
        self._bar.update(
            self._task,
            completed=self.num_skipped + self.num_done,
            errors=errors,
            out=f"{out_rate:.0f}",
            prefill=f"{prefill_rate:.0f}",
        )


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
