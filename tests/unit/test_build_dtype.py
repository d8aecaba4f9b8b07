"""registry.build_model makes parameters in the run's dtype (a bfloat16 model is never held in float32 first), and
nothing computed at build time follows that default: each family's rotary tables are the float32 ones."""

from __future__ import annotations

import pytest
import torch

from nanoinfer.models import registry
from nanoinfer.models.config import load_hf_config
from nanoinfer.platforms import plain_platform
from nanoinfer.testing.tiny_models import TINY_FAMILIES, build_tiny_model


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dtype-families")
    return {family: registry.text_config(load_hf_config(str(build_tiny_model(family, root / family))))[0]
            for family in TINY_FAMILIES}  # fmt: skip


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_parameters_in_the_run_dtype_and_rotary_tables_unchanged(configs, family):
    with plain_platform():
        reference = registry.build_model(configs[family], None, max_position=64)
        model = registry.build_model(configs[family], None, max_position=64, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32  # restored
    for ours, want in zip(model.rotary_embeddings(), reference.rotary_embeddings(), strict=True):
        assert ours.cos.dtype == want.cos.dtype == torch.float32
        assert torch.equal(ours.cos, want.cos) and torch.equal(ours.sin, want.sin)
