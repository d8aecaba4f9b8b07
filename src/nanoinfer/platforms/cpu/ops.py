"""nanoinfer's CPU kernels (csrc/: paged decode and prefill attention, the GEMM, RMSNorm, rotary, SiLU-and-mul),
compiled once per machine with torch's C++ extension builder and cached (~/.cache/torch_extensions). Where no
compiler is available every caller falls back to plain torch ops, after one warning;
NANOINFER_DISABLE_CPU_KERNELS=1 forces that fallback (the tests use it to check both paths)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sysconfig
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger("nanoinfer")
_CSRC = Path(__file__).parent / "csrc"
_module = None
_failed = False


def cpu_ops():
    """The compiled module (see csrc/bindings.cpp for its functions), or None."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    if os.environ.get("NANOINFER_DISABLE_CPU_KERNELS") == "1":
        _failed = True
        return None
    try:
        import torch
        from torch.utils.cpp_extension import load

        files = sorted(_CSRC.glob("*.cpp")) + sorted(_CSRC.glob("*.h"))
        # The name covers the sources, where they are and which torch compiles them: a changed source builds
        # anew instead of loading a stale build, and two checkouts (or two venvs) on one machine keep separate
        # builds. Sharing one, each process's ninja saw the other's paths and rebuilt (2-3 minutes, seen
        # when a second venv ran the benchmarks), under a lock the other may be waiting on.
        where = f"{_CSRC.resolve()}|{Path(torch.__file__).parent}|{torch.__version__}"
        content = where.encode() + b"".join(f.name.encode() + f.read_bytes() for f in files)
        name = f"nanoinfer_cpu_ops_{hashlib.sha256(content).hexdigest()[:12]}"
        _remove_stale_lock(name)
        if not _is_built(name):  # say why the first run on a machine pauses (no logging is configured: stderr)
            logger.warning("building nanoinfer's CPU kernels for this machine (first run only, about 2 minutes)")
        with _own_ninja_first():
            _module = load(
                name=name,
                sources=[str(f) for f in files if f.suffix == ".cpp"],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
    except Exception as e:  # no compiler, no ninja, ...: the torch path still works
        _failed = True
        logger.warning("CPU kernels unavailable (%s); using the slower torch ops.", str(e).splitlines()[0])
    return _module


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


@contextmanager
def _own_ninja_first():
    """PATH with this environment's ninja (the `ninja` dependency) first, while torch builds or checks the build.

    torch runs whichever `ninja` PATH finds, and ninja versions keep incompatible logs of what they built: a
    build made by the venv's ninja 1.13 (venv activated) was rebuilt from scratch, 2.5 minutes, when the same
    CLI ran through a PATH that found the system's ninja 1.11, and again the other way round."""
    scripts = sysconfig.get_path("scripts")
    if not shutil.which("ninja", path=scripts):
        yield
        return
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = scripts + os.pathsep + path
    try:
        yield
    finally:
        os.environ["PATH"] = path


def _build_dir(name: str) -> Path:
    """Where torch's extension builder keeps this build (a private helper of torch, used read-only)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def _remove_stale_lock(name: str) -> None:
    # torch's builder waits forever on a lock file left by a build that was killed (kill -9); a real
    # build takes a minute or two, so a lock older than ten minutes is stale.
    import time

    lock = _build_dir(name) / "lock"
    try:
        if time.time() - lock.stat().st_mtime > 600:
            lock.unlink()
    except OSError:
        pass


def _is_built(name: str) -> bool:
    return (_build_dir(name) / f"{name}.so").is_file()
