"""Everything device-specific, behind one interface (interface.Platform) chosen once at engine start.

    cpu/    the C++ extension (ops.py is its only importer, csrc/ its sources), the packed-weight linear
            method, the attention backend on the C++ kernels, the fused decode runner, process set-up
    cuda/   Triton kernels, the Triton and flash-attn backends, CUDA graphs, KV-cache sizing by measurement

The model, attention and engine packages ask `current_platform()` when they are built and hold no device
special cases. With the extension disabled (NANOINFER_DISABLE_CPU_KERNELS=1, cpu_kernels: off) or not built
yet, a CPU engine runs on the plain-torch platform of interface.py.
"""

from __future__ import annotations

import contextlib

from nanoinfer.platforms.interface import Platform

_current: Platform | None = None


def select_platform(device: str, dtype: str = "float32", cpu_kernels: str = "auto") -> Platform:
    """Choose this process's platform for an engine on `device` (a resolved Config's), and make it current."""
    global _current
    if device == "cuda":
        from nanoinfer.platforms.cuda import CudaPlatform

        _current = CudaPlatform(dtype)
    else:
        from nanoinfer.platforms.cpu import cpu_platform

        _current = cpu_platform(cpu_kernels)
    return _current


def select_platform_for(config) -> Platform:
    return select_platform(config.device, config.dtype, config.cpu_kernels)


def current_platform() -> Platform:
    """The platform the last engine of this process chose; before any engine, the CPU one (modules built on
    their own, e.g. in tests, get the C++ kernels when they are built)."""
    global _current
    if _current is None:
        _current = select_platform("cpu", cpu_kernels="wait")
    return _current


@contextlib.contextmanager
def plain_platform():
    """Build modules under the plain-torch platform (e.g. on the meta device, to read a model's shape), whatever
    the process's platform is; it is restored afterwards."""
    global _current
    previous, _current = _current, Platform()
    try:
        yield _current
    finally:
        _current = previous


__all__ = ["Platform", "current_platform", "plain_platform", "select_platform", "select_platform_for"]
