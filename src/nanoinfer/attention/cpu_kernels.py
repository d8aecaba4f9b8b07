"""The CPU paged decode attention kernel (csrc/cpu_paged_attention.cpp), compiled once per machine with
torch's C++ extension builder and cached (~/.cache/torch_extensions). Where no compiler is available the
torch backend falls back to its gather-based path, with one warning."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

logger = logging.getLogger("nanoinfer")
_SOURCE = Path(__file__).parent / "csrc" / "cpu_paged_attention.cpp"
_module = None
_failed = False


def cpu_paged_decode_kernel():
    """The compiled `paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale)`, or None."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    if os.environ.get("NANOINFER_DISABLE_CPU_KERNELS") == "1":
        _failed = True
        return None
    try:
        from torch.utils.cpp_extension import load

        digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]
        name = f"nanoinfer_cpu_attention_{digest}"
        _remove_stale_lock(name)
        _module = load(
            name=name,
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, ...: the torch path still works
        _failed = True
        logger.warning("CPU attention kernel unavailable (%s); using the slower torch path.", str(e).splitlines()[0])
    return _module


def _remove_stale_lock(name: str) -> None:
    # torch's builder waits forever on a lock file left by a build that was killed (kill -9); a real
    # build takes a minute or two, so a lock older than ten minutes is stale.
    import time

    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    try:
        if time.time() - lock.stat().st_mtime > 600:
            lock.unlink()
    except OSError:
        pass
