"""The gated MLP: down(act(gate(x)) * up(x)), with gate and up fused into one projection."""

from __future__ import annotations

from contextlib import nullcontext

from torch import nn

from nanoinfer.models.layers.linear import GateUpParallelLinear, RowParallelLinear
from nanoinfer.platforms import current_platform


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu"):
        super().__init__()
        self.gate_up_proj = GateUpParallelLinear(hidden_size, intermediate_size, hidden_act)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False)
        self.hidden_size = hidden_size
        self.chunk_bytes = current_platform().mlp_chunk_bytes

    def forward(self, x):
        """The MLP of every row, chunks of rows at a time where the platform bounds the activations (at least 64
        rows a chunk; rows are independent, so the same result)."""
        rows = x.shape[0]
        if self.chunk_bytes is None:
            return self._forward(x)
        chunk = max(64, self.chunk_bytes // (sum(self.gate_up_proj.output_sizes) * x.element_size()))
        if rows <= chunk:
            return self._forward(x)
        out = x.new_empty(rows, self.hidden_size)
        lora = self.gate_up_proj.lora  # with adapters, each chunk's rows use their own slots
        for start in range(0, rows, chunk):
            with lora.context.row_window(rows, start, start + chunk) if lora is not None else nullcontext():
                out[start : start + chunk] = self._forward(x[start : start + chunk])
        return out

    def _forward(self, x):
        return self.down_proj(self.gate_up_proj.act_and_mul(x))
