"""The only importer of nanoinfer's C++ CPU kernels (csrc/: paged decode and prefill attention, the GEMMs, RMSNorm,
rotary, SiLU-and-mul, the fused decode loop), compiled once per machine with torch's C++ extension builder and
cached (~/.cache/torch_extensions).

cpu_ops_for(mode) says how an engine gets them: "wait" builds them now if needed (about 2 minutes, once per
machine); "auto" loads them only if already built, else starts the build in a detached background process for
the next run and answers None (this run uses plain torch); "off", or NANOINFER_DISABLE_CPU_KERNELS=1, never
uses them. Where no compiler is available the answer is None after one warning.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger("nanoinfer")
_CSRC = Path(__file__).parent / "csrc"
_module = None
_failed = False
_BACKGROUND_MARKER = "nanoinfer-background-build"
_STALE_S = 600  # a real build takes a few minutes: a lock or marker older than this was left by a killed one


def disabled() -> bool:
    return os.environ.get("NANOINFER_DISABLE_CPU_KERNELS") == "1"


def cpu_ops_for(mode: str):
    """The compiled module for an engine whose Config says `cpu_kernels: mode`, or None (see the docstring)."""
    if mode == "off" or disabled():
        return None
    if mode == "auto" and _module is None and not _failed:
        name = extension_name()
        if not _is_built(name):
            start_background_build(name)
            return None
    return cpu_ops()


def cpu_ops():
    """The compiled module (see csrc/bindings.cpp for its functions), built now if needed; or None."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    if disabled():
        _failed = True
        return None
    try:
        from torch.utils.cpp_extension import load

        name = extension_name()
        _remove_stale_lock(name)
        if not _is_built(name):  # say why the first run on a machine pauses (no logging is configured: stderr)
            logger.warning("building nanoinfer's CPU kernels for this machine (first run only, about 2 minutes)")
        with _own_ninja_first():
            _module = load(
                name=name,
                sources=[str(f) for f in _sources() if f.suffix == ".cpp"],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
    except Exception as e:  # no compiler, no ninja, ...: the torch path still works
        _failed = True
        logger.warning("CPU kernels unavailable (%s); using the slower torch ops.", str(e).splitlines()[0])
    return _module


def _sources() -> list[Path]:
    return sorted(_CSRC.glob("*.cpp")) + sorted(_CSRC.glob("*.h"))


def extension_name() -> str:
    """The build's name covers the sources, where they are and which torch compiles them: a changed source builds
    anew instead of loading a stale build, and two checkouts or venvs on one machine keep separate builds (sharing
    one, each one's ninja saw the other's paths and rebuilt)."""
    import torch

    where = f"{_CSRC.resolve()}|{Path(torch.__file__).parent}|{torch.__version__}"
    content = where.encode() + b"".join(f.name.encode() + f.read_bytes() for f in _sources())
    return f"nanoinfer_cpu_ops_{hashlib.sha256(content).hexdigest()[:12]}"


def start_background_build(name: str) -> bool:
    """Build the kernels in a detached process that outlives this one, unless one is already at it. Returns
    whether this call started one."""
    build_dir = _build_dir(name)
    marker = build_dir / _BACKGROUND_MARKER
    try:
        if time.time() - marker.stat().st_mtime < _STALE_S:
            return False  # another run started it
    except OSError:
        pass
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        marker.write_text(str(os.getpid()))
        log = open(build_dir / "background-build.log", "wb")  # noqa: SIM115 - handed to the child
        subprocess.Popen(
            [sys.executable, "-c", "from nanoinfer.platforms.cpu import ops; ops.build_in_background()"],
            stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True, cwd=str(build_dir),
        )  # fmt: skip
    except OSError as e:
        logger.warning("could not start building nanoinfer's CPU kernels in the background (%s)", e)
        return False
    logger.warning(
        "nanoinfer's CPU kernels are building in the background (first run on this machine, about 2 minutes); "
        "this run uses the slower torch ops. Set cpu_kernels: wait (--cpu-kernels wait) to wait for them."
    )
    return True


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


def _lowest_priority() -> None:
    # nice 19, and the same for this session's autogroup: Linux's autogroups share the CPU fairly between sessions
    # whatever the nice values inside them, and this process has a session of its own.
    os.nice(19)
    try:
        Path("/proc/self/autogroup").write_text("19")
    except OSError:
        pass


def _remove_stale_lock(name: str) -> None:
    # torch's builder waits forever on a lock file left by a build that was killed (kill -9).
    lock = _build_dir(name) / "lock"
    try:
        if time.time() - lock.stat().st_mtime > _STALE_S:
            lock.unlink()
    except OSError:
        pass


def _is_built(name: str) -> bool:
    """Is the library there and no build still writing it (torch's builder holds `lock` until it is done)?"""
    build_dir = _build_dir(name)
    return (build_dir / f"{name}.so").is_file() and not (build_dir / "lock").exists()


def build_in_background() -> None:
    """The detached process start_background_build starts, at the lowest priority: the compiler then takes only
    what the run that started it leaves idle (on 2 cores, at equal priority it slowed that run 20-fold)."""
    _lowest_priority()
    try:
        sys.exit(0 if cpu_ops() is not None else 1)
    finally:
        (_build_dir(extension_name()) / _BACKGROUND_MARKER).unlink(missing_ok=True)
