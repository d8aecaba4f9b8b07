"""CPU process set-up, once per process before the model loads: the thread count and glibc's malloc."""

from __future__ import annotations

import os

import torch

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_KEEP_BYTES = 1 << 30


def keep_freed_memory_for_reuse() -> bool:
    """Let glibc's malloc serve large tensors from memory it already has (once per process; CPU runs only).

    By default glibc hands every allocation over 32 MB (a prefill's activations) to a fresh mmap and unmaps it
    when freed, so each step page-faults its activations in again, and with heap trimming smaller ones too:
    a large prefill's GEMMs ran markedly slower so (benchmarks/README.md). Freed memory then stays in the
    process for the next step (peak RSS is reached either way). Returns whether both settings took (False off
    glibc)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES))


def release_freed_memory() -> None:
    """Hand memory freed back to the OS (glibc's malloc_trim) once, where keep_freed_memory_for_reuse would keep
    it: after a weight is packed into its own pages and the original released, nothing reuses that heap memory,
    and a model's worth of it (a mixture of experts: most of its weights) would stay in the process."""
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def setup_process(num_threads: int | None) -> None:
    """Keep freed memory for reuse; one torch thread a physical core unless `num_threads` says otherwise."""
    keep_freed_memory_for_reuse()
    threads = num_threads or physical_cores()
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def physical_cores() -> int:
    try:
        cores = set()
        with open("/proc/cpuinfo") as f:
            phys = core = None
            for line in f:
                if line.startswith("physical id"):
                    phys = line.split(":")[1].strip()
                elif line.startswith("core id"):
                    core = line.split(":")[1].strip()
                    cores.add((phys, core))
        if cores:
            return len(cores)
    except OSError:
        pass
    return os.cpu_count() or 1
