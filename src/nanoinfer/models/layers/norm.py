"""RMSNorm as transformers computes it: normalised in float32, rounded to the model's dtype, then scaled.

GemmaRMSNorm scales by (1 + weight) in float32 before rounding (Gemma's, OLMo's are the plain one): its loader
stores 1 + weight, so in float32 it is the plain op (and the platform's kernel) on the stored weight, exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoinfer.platforms import current_platform


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.platform = current_platform()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x) or, with a residual, (norm(x + residual), x + residual): the fused pre-norm step. The
        platform's op may overwrite both inputs: the decoder layer owns them and reads neither afterwards."""
        return self.platform.rms_norm(x, self.weight, self.eps, residual)


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (weight_offset + w), the scale computed in float32 and the result rounded once, as transformers'
    Gemma 1-3 (offset 1) and OLMo 2 (offset 0) do. The parameter holds w as the checkpoint does (a bfloat16 1 + w
    would be rounded); the float32 scale is kept beside it, and in float32 the platform's op runs on it."""

    weight_offset = 1.0

    def __init__(self, hidden_size: int, eps: float):
        super().__init__(hidden_size, eps)
        self._scale: tuple[tuple, torch.Tensor] | None = None  # (the weight's identity, offset + w in float32)

    def scale(self) -> torch.Tensor:
        w = self.weight
        key = (w.data_ptr(), w.dtype, w.device, w._version)  # a new load or .to() makes a new scale
        if self._scale is None or self._scale[0] != key:
            self._scale = (key, w.detach().float() + self.weight_offset)
        return self._scale[1]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.dtype == torch.float32:
            return self.platform.rms_norm(x, self.scale(), self.eps, residual)
        if residual is not None:  # half precision: scale in float32 before rounding, as transformers does
            x = x + residual
            residual = x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (h * self.scale()).to(x.dtype)
        return out if residual is None else (out, residual)


class UnscaledRMSNorm(nn.Module):
    """x / rms(x) in float32, rounded once, with no weight (Gemma 4's value norm). transformers takes the power
    -0.5 here rather than rsqrt; so do we, for the same bits."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)).to(x.dtype)
