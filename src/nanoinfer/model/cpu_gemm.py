"""CPU linear layers through oneDNN with the weights packed once, at load (vLLM's "oneDNN prepack").

`F.linear` on CPU hands each call to MKL's sgemm, which re-packs the weight matrix into its blocked layout
on every call. In decode the activations are a few dozen rows, so that re-packing (a full pass over the
weights) costs about as much as the multiply. oneDNN can keep the weight in its blocked layout: measured
on this project's 2-core AVX2 EPYC, one thread, 64 rows: gate_up (576 -> 3072) 6.6 -> 4.5 ms, the
49,152-row LM head 127 -> 65 ms, the square ones unchanged; results differ from sgemm by float32 rounding
only (relative 1e-6).

The ops are torch's own (`torch.ops.mkldnn`, what inductor's CPU freezing pass uses), so nothing extra is
installed; where they are missing or refuse a dtype (bfloat16 needs AVX-512 or AVX-NE-CONVERT), layers keep
plain `F.linear`.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger("nanoinfer")


def onednn_prepack_supported(dtype: torch.dtype) -> bool:
    """Can oneDNN pack and run a linear of this dtype on this CPU? Tried on a tiny matrix, not guessed."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        weight = torch.ones(8, 8, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=dtype), packed, None, "none", [], "")
    except (RuntimeError, NotImplementedError) as e:
        logger.debug("oneDNN prepacked linear unavailable for %s: %s", dtype, e)
        return False
    return bool(torch.all(out == 8))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None):
    """x W^T + b, through the packed weight when the layer has one."""
    if packed is None:
        return F.linear(x, weight, bias)
    if x.dim() != 2:  # the packed op takes [rows, features]
        return linear(x.reshape(-1, x.shape[-1]), weight, bias, packed).view(*x.shape[:-1], -1)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def prepack_linear_weights(model: nn.Module) -> int:
    """Pack the weight of every module that declares `packed_weight` (linears and the LM head).

    A weight no other module shares is then released: the packed copy is the only one the forward pass
    reads, so memory stays at one copy of the weights. A shared one (the LM head tied to the embedding)
    is kept for its other user. Returns how many weights were packed (0 when oneDNN cannot)."""
    dtype = next(model.parameters()).dtype
    if not onednn_prepack_supported(dtype):
        return 0
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    packed = 0
    for module in model.modules():
        if not hasattr(module, "packed_weight") or module.weight.device.type != "cpu":
            continue
        module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach())
        if owners[id(module.weight)] == 1:
            module.weight.data = torch.empty(0, dtype=dtype)
        packed += 1
    return packed
