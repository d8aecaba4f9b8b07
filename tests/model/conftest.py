"""Tiny random models and their Hugging Face reference outputs, built once per session."""

from __future__ import annotations

import pytest

from nanoinfer.testing.tiny_models import build_tiny_model

FAMILIES = ["qwen3", "qwen2", "llama"]
NUM_REFERENCE_TOKENS = 32


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-models")
    return {family: build_tiny_model(family, root / family) for family in FAMILIES}
