"""Shared fixtures. The default model is built once per machine into the user's cache (as users get it)."""

import os

# Triton's interpreter for the kernel tests (tests/kernels/conftest.py says why): set here, before any test module
# is imported, since some import triton on their way (sentence-transformers through torch) and triton reads the
# setting once; on a CUDA machine TRITON_INTERPRET=0 in the environment keeps the compiled kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def default_model_dir():
    """The built-in default model's HF folder (SmolLM2-135M-Instruct, float32); builds it on first use."""
    from nanoinfer.config import DEFAULT_MODEL
    from nanoinfer.model_source import resolve_model

    return resolve_model(DEFAULT_MODEL)


def pytest_sessionstart(session):
    # Build the CPU attention kernel once, up front: otherwise the first engine test pays for it, and a
    # subprocess killed on purpose (the crash tests) could die in the middle of the build.
    from nanoinfer.platforms.cpu.ops import cpu_ops

    cpu_ops()
