"""A tensor-parallel worker process (ranks 1..tp-1): builds its shard of the model, then follows rank 0.

Rank 0 (executor.py) sends pickled messages down one pipe per worker; the model's own collectives run over
torch.distributed. A worker never schedules or samples. It exits when rank 0 says so, when the pipe
closes, or when its parent is gone (a watchdog thread: rank 0 may die while this process is in a collective).
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, fields
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from nanoinfer.attention.metadata import AttentionMetadata
from nanoinfer.distributed import set_tensor_parallel
from nanoinfer.engine.model_runner import ModelRunner, logits_in_chunks
from nanoinfer.platforms import select_platform

PARENT_POLL_S = 0.5


@dataclass
class WorkerArgs:
    rank: int
    tp_size: int
    config: object  # nanoinfer Config, pickled as is (hf_config included)
    num_blocks: int
    backend: str  # "gloo" | "nccl"
    store_port: int  # rank 0's TCPStore, on 127.0.0.1
    timeout_s: float  # collective timeout
    num_threads: int  # torch intra-op threads (CPU)
    parent_pid: int
    # Rank 0's choice of the CPU kernels ("wait": use them, "off": plain torch), so that every rank runs the same
    # platform: with cpu_kernels auto, each rank deciding on its own could see a background build half done.
    cpu_kernels: str = "off"
    num_state_slots: int = 0  # a hybrid model's state cache: one slot a running sequence


# ---- messages -------------------------------------------------------------------------------------------
# rank 0 -> worker: ("step", input_ids, positions, metadata fields, sample_indices, with_logits),
# ("allocate_kv_cache", num_blocks, num_state_slots), ("shutdown",). worker -> rank 0: ("hello",) once its imports are
# done, ("ready",) once its shard is loaded and after each cache allocation, ("error", traceback) before it exits.
# Tensors travel as numpy arrays: plain pickle copies them in band, with no shared-memory handles to leak.


def send(conn, message: tuple) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn) -> tuple:
    return pickle.loads(conn.recv_bytes())


def pack_step(input_ids, positions, metadata: AttentionMetadata, sample_indices, with_logits: bool) -> bytes:
    meta = {f.name: _to_wire(getattr(metadata, f.name)) for f in fields(metadata)}
    message = ("step", _to_wire(input_ids), _to_wire(positions), meta, _to_wire(sample_indices), with_logits)
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def unpack_step(message: tuple, device: torch.device):
    _, input_ids, positions, meta, sample_indices, with_logits = message
    metadata = AttentionMetadata(**{name: _from_wire(value, device) for name, value in meta.items()})
    return (_from_wire(input_ids, device), _from_wire(positions, device), metadata,
            _from_wire(sample_indices, device), with_logits)


def _to_wire(value):
    return value.cpu().numpy() if isinstance(value, torch.Tensor) else value


def _from_wire(value, device: torch.device):
    return torch.from_numpy(value).to(device) if isinstance(value, np.ndarray) else value


@torch.inference_mode()
def forward_shard(runner, input_ids, positions, metadata, sample_indices, with_logits: bool, consume=None):
    """This rank's part of one step; every rank calls it with the same inputs (the collectives pair up).

    With logits, the vocabulary-parallel LM head runs in logits_in_chunks' chunks on every rank (they depend on the
    row count alone, so their all-gathers pair up too), each into consume(first row, logits). Without `consume`
    (rank 0's plain steps) the chunks are joined."""
    hidden_states = runner.run_model(input_ids, positions, metadata, sample_indices)
    if not with_logits:
        return hidden_states  # the same on every rank after the last all-reduce: rank 0 pools its own
    if consume is not None:
        logits_in_chunks(runner.model, hidden_states, consume)
        return None
    parts = []
    logits_in_chunks(runner.model, hidden_states, lambda start, logits: parts.append(logits))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


# ---- the process ----------------------------------------------------------------------------------------


def worker_main(args: WorkerArgs, conn) -> None:
    """Entry point of a spawned worker. Exit code 0 after a shutdown or a vanished rank 0, 1 after an error."""
    # Ctrl-C in a terminal reaches the whole process group; rank 0 alone decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch_parent(args.parent_pid)
    try:
        send(conn, ("hello",))
        runner = _build_runner(args)
        send(conn, ("ready",))
    except BaseException as e:  # noqa: BLE001 - everything goes back to rank 0, which reports it
        _report(conn, e)
        _exit(1)
    _exit(_serve(runner, conn))


def _build_runner(args: WorkerArgs) -> ModelRunner:
    config = args.config
    if args.backend == "nccl":
        torch.cuda.set_device(args.rank)
    select_platform(config.device, config.dtype, args.cpu_kernels).setup_process(config, num_threads=args.num_threads)
    store = dist.TCPStore("127.0.0.1", args.store_port, args.tp_size, is_master=False,
                          timeout=timedelta(seconds=args.timeout_s))
    dist.init_process_group(args.backend, store=store, rank=args.rank, world_size=args.tp_size,
                            timeout=timedelta(seconds=args.timeout_s))
    set_tensor_parallel(args.rank, args.tp_size)  # this process only ever builds this one shard
    return ModelRunner(config, args.num_blocks, args.num_state_slots)


def _serve(runner, conn) -> int:
    while True:
        try:
            message = recv(conn)
        except (EOFError, OSError):
            return 0  # rank 0 is gone: nothing left to follow
        kind = message[0]
        if kind == "shutdown":
            return 0
        try:
            if kind == "step":
                forward_shard(runner, *unpack_step(message, runner.device), consume=lambda start, logits: None)
            elif kind == "allocate_kv_cache":
                runner.allocate_kv_cache(message[1], message[2])
                send(conn, ("ready",))
            else:
                raise AssertionError(f"unknown message {kind!r}")
        except Exception as e:  # noqa: BLE001 - rank 0 gets the traceback, whatever it is
            if _rank0_is_leaving(conn):
                return 0  # rank 0 tore the group down mid-step (Ctrl-C, an error of its own): not our failure
            _report(conn, e)
            return 1


def _exit(code: int) -> None:
    # Skip interpreter teardown: a process group whose peer is gone can take seconds (NCCL: forever) to
    # destroy, and this process owns nothing that needs a clean shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _rank0_is_leaving(conn) -> bool:
    try:
        return conn.poll(1.0) and recv(conn)[0] == "shutdown"
    except (EOFError, OSError):
        return True


def _report(conn, error: BaseException) -> None:
    text = "".join(traceback.format_exception(error))
    try:
        send(conn, ("error", text))
    except OSError:
        print(text, file=sys.stderr)


def _watch_parent(parent_pid: int) -> None:
    """Exit as soon as rank 0 is gone, even while the main thread is blocked inside a collective."""

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="nanoinfer-parent-watchdog", daemon=True).start()
