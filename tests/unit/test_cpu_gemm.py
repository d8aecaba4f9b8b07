"""oneDNN-prepacked CPU linears against F.linear, and what packing does to the model's weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.model.cpu_gemm import linear, onednn_prepack_supported, prepack_linear_weights
from nanoinfer.model.layers import ParallelLMHead, VocabParallelEmbedding
from nanoinfer.model.linear import ColumnParallelLinear, RowParallelLinear

needs_onednn = pytest.mark.skipif(
    not onednn_prepack_supported(torch.float32), reason="this torch build has no oneDNN float32 linear"
)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(200, 96, generator=gen)
    bias = torch.randn(200, generator=gen) if with_bias else None
    x = torch.randn(rows, 96, generator=gen)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    torch.testing.assert_close(linear(x, weight, bias, packed), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_packed_linear_takes_non_contiguous_and_3d_input():
    weight = torch.randn(40, 32)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    x = torch.randn(32, 10).t()  # non-contiguous rows
    torch.testing.assert_close(linear(x, weight, None, packed), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 5, 32)
    assert linear(x3, weight, None, packed).shape == (2, 5, 40)
    torch.testing.assert_close(linear(x3, weight, None, packed), F.linear(x3, weight), rtol=1e-5, atol=1e-5)


class _Tiny(nn.Module):
    """An embedding tied to the LM head, plus one column and one row linear."""

    def __init__(self):
        super().__init__()
        self.embed = VocabParallelEmbedding(50, 16)
        self.up = ColumnParallelLinear(16, [24, 24], bias=True)
        self.down = RowParallelLinear(48, 16)
        self.lm_head = ParallelLMHead(50, 16)
        self.lm_head.weight = self.embed.weight
        for p in self.parameters():
            nn.init.normal_(p)

    def forward(self, ids):
        return self.lm_head(self.down(self.up(self.embed(ids))))


@needs_onednn
def test_prepack_keeps_outputs_and_releases_unshared_weights():
    model = _Tiny()
    ids = torch.tensor([1, 7, 49])
    before = model(ids)
    assert prepack_linear_weights(model) == 3
    after = model(ids)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-4)
    assert model.up.weight.numel() == 0 and model.down.weight.numel() == 0  # only the packed copy remains
    assert model.embed.weight.shape == (50, 16)  # shared with the LM head: still needed by the embedding


def test_unsupported_dtype_leaves_layers_on_f_linear(monkeypatch):
    model = _Tiny()
    monkeypatch.setattr("nanoinfer.model.cpu_gemm.onednn_prepack_supported", lambda dtype: False)
    assert prepack_linear_weights(model) == 0
    assert model.up.packed_weight is None and model.up.weight.shape == (48, 16)
