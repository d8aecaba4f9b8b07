"""TensorParallelExecutor: rank 0's side of tensor parallelism, with ModelRunner's surface.

Rank 0 starts tp-1 spawned workers (worker.py), runs prepare_inputs once per step and sends the batch
tensors down one pipe per worker; every rank then runs its shard and the model's collectives pair up over
torch.distributed (gloo on CPU, NCCL on CUDA). Only rank 0 samples. Supports tensor_parallel_size that
divides num_attention_heads and num_key_value_heads (config.py checks it); KV heads are never replicated.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanoinfer.distributed import set_tensor_parallel
from nanoinfer.engine.model_runner import ModelRunner, PromptRowsReader, group_by_sequence
from nanoinfer.engine.scheduler import SchedulerOutput
from nanoinfer.engine.tp_worker import WorkerArgs, forward_shard, pack_step, recv, send, worker_main
from nanoinfer.errors import NanoInferError
from nanoinfer.platforms import current_platform

# A dead worker breaks the next collective at once (its sockets close); the timeout only catches a hung one.
COLLECTIVE_TIMEOUT_S = 120.0
# When rank 0 is still stuck in a step this long after a worker died, it prints the error and exits.
STUCK_GRACE_S = 10.0
SHUTDOWN_GRACE_S = 2.0


@dataclass
class _Worker:
    rank: int
    process: multiprocessing.Process
    conn: multiprocessing.connection.Connection


@dataclass
class _State:
    """What rank 0's main thread and its monitor thread share (not the executor: it must stay collectable)."""

    workers: list[_Worker] = field(default_factory=list)
    closing: bool = False
    failure: str | None = None
    step_id: int = 0  # bumped at the start and the end of every step; odd while a step runs
    lock: threading.Lock = field(default_factory=threading.Lock)  # one reader of a pipe at a time

    def record_failure(self, dead: _Worker, when: str, error_text: str | None = None) -> str:
        """The first failure wins: a worker's death can be seen by both threads."""
        with self.lock:
            if self.failure is None:
                self.failure = _failure_message(dead, when, error_text or _error_text(dead))
            return self.failure


class TensorParallelExecutor:
    """Runs a model sharded over `config.tensor_parallel_size` processes; this process is rank 0.

    Steps reach the workers as pickled tensors on a pipe rather than a torch.distributed broadcast: the
    control path then works the same under gloo and NCCL, and the pipe doubles as the workers' signal that
    rank 0 is gone. Call close() (or LLMEngine.close()) to stop the workers; it also runs at exit. One
    tensor-parallel engine per process at a time: it owns the default torch.distributed process group.

    Raises:
        NanoInferError: a worker failed to start, died or failed during a step (its exit code or traceback
            is in the message). The executor is unusable afterwards and its other workers are stopped.
    """

    def __init__(self, config, num_blocks: int, num_state_slots: int = 0):
        self.config = config
        self.tp_size = tp = config.tensor_parallel_size
        self._state = _State()
        self._closed = True  # until there is something to close
        if dist.is_initialized():
            raise NanoInferError(
                "a torch.distributed process group already exists in this process, so a tensor-parallel engine "
                "cannot create its own. Close the other tensor-parallel engine first (LLMEngine.close())."
            )
        cuda = config.device == "cuda"
        backend = "nccl" if cuda else "gloo"
        num_threads = max(1, torch.get_num_threads() // tp)  # the CPU cores are shared by all ranks
        if not cuda:
            torch.set_num_threads(num_threads)
        timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        # Port 0: the OS picks a free port, so two jobs on one host never collide.
        store = dist.TCPStore("127.0.0.1", 0, tp, is_master=True, wait_for_workers=False, timeout=timeout)
        self._closed = False
        self._atexit = functools.partial(_close_at_exit, weakref.ref(self))
        atexit.register(self._atexit)
        try:
            self._start_workers(config, num_blocks, num_state_slots, backend, store.port, num_threads)
            self._wait_for_all("hello", "while starting")
            dist.init_process_group(backend, store=store, rank=0, world_size=tp, timeout=timeout)
            set_tensor_parallel(0, tp)
            try:
                self.runner = ModelRunner(config, num_blocks, num_state_slots)
            finally:
                set_tensor_parallel(0, 1)  # layers read it when built; later single-process models must see 1
            self._wait_for_all("ready", "while starting")
        except BaseException:
            self.close()
            raise
        threading.Thread(target=_monitor, args=(self._state,), name="nanoinfer-tp-monitor", daemon=True).start()

    # ---- ModelRunner's surface ------------------------------------------------------------------------
    @property
    def model(self):
        return self.runner.model  # rank 0's shard (what memory planning measures per device)

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def block_size(self) -> int:
        return self.runner.block_size

    @property
    def state_cache(self):
        return self.runner.state_cache  # rank 0's (a hybrid model's), None for others

    @property
    def num_state_slots(self) -> int:
        return self.runner.num_state_slots

    @property
    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self._state.workers]

    def execute(self, out: SchedulerOutput) -> dict[int, list[int]]:
        """Run one step on every rank; returns seq_id -> sampled token ids (sampled on rank 0 only)."""
        inputs = self.runner.prepare_inputs(out)
        sample_seqs = inputs.sample_seqs
        self.runner.sampler.prepare(sample_seqs, self.runner.config.hf_config.vocab_size)
        # The vocabulary-parallel LM head is a collective, so every rank computes the logits of every row read
        # (prompt logprobs' rows too), a chunk at a time; an embedding step reads rank 0's hidden states instead.
        args = inputs.input_ids, inputs.positions, inputs.metadata, inputs.hidden_indices
        if inputs.prompt_rows:
            logits = self._forward(*args, True, consume=PromptRowsReader(inputs))
        else:
            rows = self._forward(*args, bool(sample_seqs))
            if inputs.pooled_rows:
                self.runner.read_pooled_rows(inputs, rows)
            logits = rows
        if not sample_seqs:
            return {}
        return group_by_sequence(sample_seqs, self.runner.sampler(logits, sample_seqs))

    def add_lora(self, lora) -> None:
        self.runner.add_lora(lora)  # rank 0 checks it; each worker reads it for the first step that runs it

    def compute_logits(self, out: SchedulerOutput) -> torch.Tensor:
        """Full-vocabulary logits of the sequences that reach their end this step (gathered on rank 0)."""
        inputs = self.runner.prepare_inputs(out)
        logits = self._forward(inputs.input_ids, inputs.positions, inputs.metadata, inputs.hidden_indices, True)
        return (logits if inputs.sample_rows is None else logits[inputs.sample_rows]).float()

    def allocate_kv_cache(self, num_blocks: int, num_state_slots: int = 0) -> None:
        self._check_usable()
        with contextlib.suppress(OSError):  # a dead worker is reported by the wait below
            self._send_all(("allocate_kv_cache", num_blocks, num_state_slots))
        self.runner.allocate_kv_cache(num_blocks, num_state_slots)
        self._wait_for_all("ready", "while allocating its KV cache")

    def warmup(self) -> None:
        # The same warm-up batch, run through our execute(). Not ModelRunner's extra logits pass for speculative
        # rows: rank 0 alone would wait in the vocabulary all-gather (a known gap: with speculation on, the
        # measured peak leaves out those rows' logits under tensor parallelism).
        ModelRunner.warmup_batch(self)

    # ---- lifecycle ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every worker (ask, then SIGKILL after a grace period) and leave the process group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        state = self._state
        state.closing = True
        atexit.unregister(self._atexit)
        for w in state.workers:
            with contextlib.suppress(OSError):
                send(w.conn, ("shutdown",))
        if dist.is_initialized():
            with contextlib.suppress(RuntimeError):  # the group may already be broken by a dead peer
                dist.destroy_process_group()  # a worker blocked in a collective then fails out of it
        _stop(state.workers, SHUTDOWN_GRACE_S)
        for w in state.workers:
            w.conn.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            self.close()

    # ---- internals ------------------------------------------------------------------------------------
    def _start_workers(self, config, num_blocks: int, num_state_slots: int, backend: str, port: int,
                       num_threads: int) -> None:
        ctx = mp.get_context("spawn")
        # The platform this process chose (LLMEngine, before starting us) decides for every rank.
        cpu_kernels = "wait" if current_platform().name == "cpu" else "off"
        for rank in range(1, self.tp_size):
            args = WorkerArgs(rank, self.tp_size, config, num_blocks, backend, port, COLLECTIVE_TIMEOUT_S,
                              num_threads, parent_pid=os.getpid(), cpu_kernels=cpu_kernels,
                              num_state_slots=num_state_slots)
            parent_conn, child_conn = ctx.Pipe()
            process = ctx.Process(target=worker_main, args=(args, child_conn), name=f"nanoinfer-tp{rank}",
                                  daemon=True)
            with _sigint_ignored():
                process.start()
            child_conn.close()  # only the worker holds its end: our exit shows up there as EOF
            self._state.workers.append(_Worker(rank, process, parent_conn))

    def _wait_for_all(self, kind: str, when: str) -> None:
        """Wait until every worker has sent `kind`; a worker's error or death closes the engine and raises."""
        state = self._state
        pending = {w.conn: w for w in state.workers}
        while pending:
            sentinels = {w.process.sentinel: w for w in pending.values()}
            for ready in multiprocessing.connection.wait(list(pending) + list(sentinels)):
                worker = pending.get(ready) or sentinels.get(ready)
                if worker is None or worker.conn not in pending:
                    continue  # it answered earlier in this round
                with state.lock:
                    message = _next_message(worker)
                if message is not None and message[0] == kind:
                    del pending[worker.conn]
                    continue
                assert message is None or message[0] == "error", message
                failure = state.record_failure(worker, when, message[1] if message else None)
                self.close()
                raise NanoInferError(failure)

    def _forward(self, input_ids, positions, metadata, sample_indices, with_logits: bool, consume=None):
        """Rank 0's forward_shard (hidden states, the logits, or the logits chunk by chunk into `consume`, whose
        sampled rows it returns), with every worker running its own."""
        self._check_usable()
        state = self._state
        state.step_id += 1
        try:
            self._send_all(pack_step(input_ids, positions, metadata, sample_indices, with_logits))
            result = forward_shard(self.runner, input_ids, positions, metadata, sample_indices, with_logits, consume)
            return consume.sampled() if consume is not None else result
        except BaseException as e:
            # A collective or a pipe failing means a worker is probably dead; give its exit a moment to show.
            failure = self._worker_failure(wait_s=3.0 if isinstance(e, (RuntimeError, OSError)) else 0.0)
            self.close()  # the ranks are out of step now (workers may sit in a collective), whatever the cause
            if failure is None:
                raise  # every worker is alive: rank 0's own error (or Ctrl-C), with its traceback
            raise NanoInferError(failure) from None
        finally:
            state.step_id += 1

    def _send_all(self, message) -> None:
        data = message if isinstance(message, bytes) else None
        for w in self._state.workers:
            if data is None:
                send(w.conn, message)
            else:
                w.conn.send_bytes(data)

    def _check_usable(self) -> None:
        if self._closed:
            raise NanoInferError(self._state.failure or "the tensor-parallel engine was closed; create a new one.")
        if any(w.process.exitcode is not None for w in self._state.workers):
            failure = self._worker_failure()
            self.close()
            raise NanoInferError(failure)

    def _worker_failure(self, wait_s: float = 3.0) -> str | None:
        """The message for a dead worker, if one died (its exit may lag its closed socket a little)."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = next((w for w in self._state.workers if w.process.exitcode is not None), None)
            if dead is not None:
                return self._state.record_failure(dead, "during a step")
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)


def _monitor(state: _State) -> None:
    """Notice a worker's death within moments: record it, stop the other workers, and never let rank 0 hang.

    With gloo a dead peer fails rank 0's current collective by itself; if rank 0 is still inside the same step
    STUCK_GRACE_S later (a backend that waits for its timeout), the error is printed and the process exits.
    """
    sentinels = {w.process.sentinel: w for w in state.workers}
    ready = multiprocessing.connection.wait(list(sentinels))
    if state.closing:
        return
    dead = sentinels[ready[0]]
    step_id = state.step_id
    state.record_failure(dead, "during a step" if step_id % 2 else "")
    _stop([w for w in state.workers if w is not dead], 0.0)
    if step_id % 2 == 0:
        return  # between steps: the next execute() raises
    time.sleep(STUCK_GRACE_S)
    if state.step_id == step_id and not state.closing:
        print(f"nanoinfer: error: {state.failure}", file=sys.stderr, flush=True)
        _stop(state.workers, 0.0)
        os._exit(1)


def _failure_message(worker: _Worker, when: str, error_text: str | None = None) -> str:
    process = worker.process
    code = _exitcode(process)
    when = f" {when}" if when else ""
    hint = ""
    if error_text:
        how = f"failed{when} with this error:\n{error_text.rstrip()}\n"
    elif code is not None and code < 0:
        how = f"was killed by signal {signal.Signals(-code).name}{when}"
        if -code == signal.SIGKILL:
            how += " (the kernel's OOM killer does this when memory runs out; see `dmesg`)"
    else:
        how = f"exited with code {code}{when}" if code is not None else f"closed its pipe{when}"
        if when == " while starting":
            # Before our code runs, spawn re-imports the main script; an unguarded LLM(...) there fails.
            hint = (
                " If its traceback above is about bootstrapping, create the engine under "
                "`if __name__ == \"__main__\":` in your script (workers are spawned, which re-imports it)."
            )
    return (
        f"tensor-parallel worker rank {worker.rank} (pid {process.pid}) {how}. The engine cannot go on without "
        f"it and has stopped its other workers.{hint} Rerun the job; if it keeps failing, lower "
        "tensor_parallel_size or the memory settings (cpu_kvcache_space_gib, max_num_batched_tokens)."
    )


def _exitcode(process: multiprocessing.Process) -> int | None:
    # Its sentinel fires when the worker's files close, a moment before it can be reaped.
    deadline = time.monotonic() + 1.0
    while process.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return process.exitcode


def _next_message(worker: _Worker) -> tuple | None:
    """The worker's next message, or None when it has none and never will (its pipe is closed)."""
    try:
        return recv(worker.conn) if worker.conn.poll() else None
    except (EOFError, OSError):
        return None


def _error_text(worker: _Worker) -> str | None:
    """The traceback a worker sent before it exited, if any."""
    while (message := _next_message(worker)) is not None:
        if message[0] == "error":
            return message[1]
    return None


def _stop(workers: list[_Worker], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for w in workers:
        w.process.join(max(0.0, deadline - time.monotonic()))
    for w in workers:
        if w.process.is_alive():
            w.process.kill()  # a worker holds nothing that needs a clean shutdown
    for w in workers:
        w.process.join()


@contextlib.contextmanager
def _sigint_ignored():
    """A child started in here ignores SIGINT from its first instruction on (the setting survives exec): a
    terminal's Ctrl-C reaches the whole process group, and only rank 0 decides when workers stop."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may change signal handlers; the worker ignores SIGINT once it runs
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


def _close_at_exit(ref: weakref.ref) -> None:
    executor = ref()
    if executor is not None:
        executor.close()



def make_executor(config, num_blocks: int, num_state_slots: int = 0):
    """What runs the model for an engine: a ModelRunner in this process, or with tensor_parallel_size > 1 the
    executor that runs rank 0 here and the other ranks in worker processes (the same surface, close() included)."""
    if config.tensor_parallel_size > 1:
        return TensorParallelExecutor(config, num_blocks, num_state_slots)
    return ModelRunner(config, num_blocks, num_state_slots)
