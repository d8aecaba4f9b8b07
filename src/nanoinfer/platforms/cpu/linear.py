"""CPU linear layers with the weights packed once, at load.

`F.linear` on CPU hands each call to MKL's sgemm, which re-packs the weight matrix into its blocked layout
on every call; in decode (a few dozen rows) that costs about as much as the multiply. So every linear
(and the LM head) is packed once, for one of two kernels:
- float32 and bfloat16 where the C++ kernels are built for AVX2: our own GEMM (csrc/gemm.cpp, 16-column
  panels and a 6 x 16 register tile; bfloat16 is widened to float32 in registers and summed in float32),
  faster than oneDNN's packed weights at decode's row counts and level at prefill's (benchmarks/README.md);
- bfloat16 on CPUs with AMX (Sapphire Rapids and later): our AMX GEMM (csrc/amx_gemm.cpp), which keeps
  DRAM busy at decode's row counts where oneDNN's kernels do not, and takes the MLP's SiLU-and-mul into
  its epilogue with the separate ops' roundings;
- bfloat16 on CPUs with AVX512-BF16 but no AMX, and otherwise where ours is not built: oneDNN's packed
  weights (torch's own `torch.ops.mkldnn` ops, what inductor's CPU freezing pass uses),
  where it runs the dtype (bfloat16 needs AVX-512 or AVX-NE-CONVERT);
- otherwise plain `F.linear`.
A float32 weight loaded from a GGUF's Q4_0 / Q4_1 blocks (the built-in default is one), or whose values are all
exactly such blocks, also gets those forms (`PackedWeight.compact`, `compact_amx`): the panel GEMM reads the
4-bit one for steps of few rows (csrc/q4_panels.h, the same bits), AMX CPUs run steps of more rows on the other
(csrc/q4_amx_gemm.cpp).
Float32 results differ from sgemm by summation order only (relative 1e-6); bfloat16 ones are rounded once,
from the float32 sum.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.platforms.cpu.ops import cpu_ops
from nanoinfer.platforms.cpu.process import release_freed_memory

logger = logging.getLogger("nanoinfer")


@dataclass(frozen=True)
class PackedWeight:
    """A weight in a kernel's own layout: kind "panels" (csrc/gemm.cpp), "gated" (the same GEMM over a
    [gate; up] weight, giving silu(gate) * up; `out_features` is then the intermediate size), "amx" and
    "amx_gated" (csrc/amx_gemm.cpp, bfloat16) or "onednn"."""

    kind: str
    data: torch.Tensor
    out_features: int
    # kinds "panels" and "gated", float32: the same weight as exact 4-bit blocks (csrc/q4_panels.h), which the
    # GEMM expands instead of reading `data` where that is faster, with the same bits; None when the weight's
    # values are not all exactly such block values (a model dequantized from a GGUF Q4_1 file has them)
    compact: torch.Tensor | None = None
    # with `compact`, on a CPU with AMX: the same 4-bit weight as AMX tiles (csrc/q4_amx_gemm.cpp), which steps of
    # many rows run on instead of the float32 panels (float32 sums in another order; exact products)
    compact_amx: torch.Tensor | None = None

    @property
    def gated(self) -> bool:
        """Does the GEMM give silu(gate) * up (call gated_linear), not the bare projection?"""
        return self.kind in ("gated", "amx_gated")


@dataclass(frozen=True)
class GreedyLMHead:
    """A float32 LM head's bfloat16 copy, packed for AMX, and its rows' L2 norms (rounded up): greedy tokens
    without the float32 product, found from the bfloat16 one and an error bound (csrc/greedy_lm_head.cpp)."""

    amx_packed: torch.Tensor
    weight_norms: torch.Tensor


def pack_greedy_lm_head(weight: torch.Tensor) -> GreedyLMHead:
    weight = weight.detach()
    # In float64, then up by more than float32's rounding: the bound holds only with norms no smaller than the
    # true ones.
    norms = (torch.linalg.vector_norm(weight, dim=1, dtype=torch.float64) * (1 + 1e-6)).float()
    return GreedyLMHead(pack_weight(weight.to(torch.bfloat16), "amx").data, norms)


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


def has_native_bfloat16_matmul() -> bool:
    """Does this CPU multiply bfloat16 natively (AMX tiles or AVX512-BF16 dot products)?"""
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def packing_kind(dtype: torch.dtype) -> str | None:
    """Which packed kernel runs linears of `dtype` here: "amx", "panels", "onednn" or None (plain F.linear)."""
    ops = cpu_ops()
    if dtype == torch.bfloat16 and ops is not None and ops.amx_available():
        return "amx"
    # bfloat16 on a CPU with AVX512-BF16 (no AMX): oneDNN's kernels multiply it natively, several times our
    # GEMM's widen-to-float32 rate (benchmarks/README.md).
    if dtype == torch.bfloat16 and has_native_bfloat16_matmul() and onednn_prepack_supported(dtype):
        return "onednn"
    if dtype in (torch.float32, torch.bfloat16) and ops is not None and ops.vectorized:
        return "panels"
    return "onednn" if onednn_prepack_supported(dtype) else None


def pack_weight(weight: torch.Tensor, kind: str, keep_panels: bool = False, blocks=None) -> PackedWeight:
    """The weight in `kind`'s layout. A float32 weight with both exact 4-bit forms (an AVX-512 CPU with AMX)
    leaves the float32 panels out unless `keep_panels`: every step runs on one of the forms, and the panels were
    424 MB and ~1.1 s of load for the default model. `blocks`: the weight's 4-bit blocks as a GGUF held them
    (row offset -> (d, m, q), see compact_from_blocks), packed as they are; without them a float32 weight still
    gets its 4-bit form when its values are exactly blocks (a checkpoint dequantized from a GGUF file)."""
    weight = weight.detach()
    if kind in ("panels", "gated"):
        gated = kind == "gated"
        compact = None
        if weight.dtype == torch.float32 and q4_panels_supported():
            compact = compact_from_blocks(blocks, weight.shape[0], gated) if blocks else pack_compact(weight, gated)
        compact_amx = cpu_ops().pack_q4_amx(compact) if compact is not None and cpu_ops().amx_available() else None
        if compact_amx is not None and not keep_panels:
            data = torch.empty(0, dtype=weight.dtype)
        else:
            data = cpu_ops().pack_gated_weight(weight) if gated else cpu_ops().pack_linear_weight(weight)
        return PackedWeight(kind, data, weight.shape[0] // (2 if gated else 1), compact, compact_amx)
    if kind in ("amx", "amx_gated"):
        gated = kind == "amx_gated"
        return PackedWeight(kind, cpu_ops().pack_amx_weight(weight, gated), weight.shape[0] // (2 if gated else 1))
    return PackedWeight(kind, torch.ops.mkldnn._reorder_linear_weight(weight), weight.shape[0])


def q4_panels_supported() -> bool:
    """Does this build's panel GEMM read 4-bit weights (AVX-512)? Asked of the packer with one exact block."""
    global _q4_supported
    if _q4_supported is None:
        ops = cpu_ops()
        _q4_supported = ops is not None and ops.pack_q4_panels(torch.zeros(16, 32), False).numel() > 0
    return _q4_supported


_q4_supported: bool | None = None


def compact_from_blocks(blocks: dict, num_rows: int, gated: bool) -> torch.Tensor | None:
    """4-bit blocks -> the panel GEMM's 4-bit layout (csrc/q4_panels.h), the bytes pack_q4_panels writes.

    `blocks` maps a row offset of the weight to (d, m, q): float16 [rows, K/32] twice, uint8 [rows, K] in 0..15,
    value = d * q + m. None unless the blocks cover every row. The layout: panels of 16 columns (gated: 8 gate
    rows and the 8 up rows of the same outputs), per panel and 32-input block 16 d, 16 m, then per pair of
    inputs one byte a column, the first input in the low nibble.
    """
    offsets = sorted(blocks)
    if sum(blocks[o][0].shape[0] for o in offsets) != num_rows or any(
            a + blocks[a][0].shape[0] != b for a, b in zip(offsets, offsets[1:])) or offsets[0] != 0:
        return None
    d, m, q = (torch.cat([blocks[o][i] for o in offsets]) for i in range(3))
    num_blocks = d.shape[1]

    def columns(x: torch.Tensor) -> torch.Tensor:  # rows -> [panels, 16, ...] in panel-column order, zeros past N
        if not gated:
            return _pad_rows(x, 16).view(-1, 16, *x.shape[1:])
        half = num_rows // 2
        gate, up = (_pad_rows(part, 8).view(-1, 8, *x.shape[1:]) for part in (x[:half], x[half:]))
        return torch.cat([gate, up], dim=1)

    d, m = (columns(t).transpose(1, 2).contiguous().view(torch.uint8) for t in (d, m))  # [panels, blocks, 32]
    panels = d.shape[0]
    q = columns(q).view(panels, 16, num_blocks, 16, 2)  # column, block, input pair, (first, second)
    nibbles = (q[..., 0] | (q[..., 1] << 4)).permute(0, 2, 3, 1).reshape(panels, num_blocks, 256)
    out = cpu_ops().zeros_on_huge_pages([panels, num_blocks, 320], torch.uint8)  # as the C++ packer's
    torch.cat([d, m, nibbles], dim=2, out=out)
    return out


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -x.shape[0] % multiple
    return x if not extra else torch.cat([x, x.new_zeros(extra, *x.shape[1:])])


def pack_compact(weight: torch.Tensor, gated: bool) -> torch.Tensor | None:
    """The float32 weight's exact 4-bit form for the panel GEMM, or None where it has none (any other dtype, or a
    value that is not exactly d * q + m of its block: decided at the first such block, so ~free for others)."""
    if weight.dtype != torch.float32:
        return None
    compact = cpu_ops().pack_q4_panels(weight, gated)
    return compact if compact.numel() else None


def gated_linear(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """silu(x Wg^T) * (x Wu^T) through a weight packed as kind "gated" or "amx_gated"."""
    if packed.kind == "amx_gated":
        return cpu_ops().amx_linear(x, packed.data, None, packed.out_features, gated=True)
    return cpu_ops().packed_linear(x, packed.data, None, packed.out_features, gated=True, compact=packed.compact,
                                   compact_amx=packed.compact_amx)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight | None):
    """x W^T + b, through the packed weight when the layer has one."""
    if packed is None:
        return F.linear(x, weight, bias)
    if packed.gated:
        raise RuntimeError("this weight is packed with its activation: call silu_and_mul on its layer")
    if packed.kind == "panels":
        return cpu_ops().packed_linear(x, packed.data, bias, packed.out_features, compact=packed.compact,
                                       compact_amx=packed.compact_amx)
    if packed.kind == "amx":
        return cpu_ops().amx_linear(x, packed.data, bias, packed.out_features)
    if x.dim() != 2:  # the oneDNN op takes [rows, features]
        return linear(x.reshape(-1, x.shape[-1]), weight, bias, packed).view(*x.shape[:-1], -1)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed.data, bias, "none", [], "")


def prepack_linear_weights(model: nn.Module) -> int:
    """Pack the weight of every linear layer and the LM head (modules multiplying through the platform's linear
    method); each gets `packed_weight` (None where its weight stays as it is).

    A weight no other module shares is then released: the packed copy is the only one the forward pass
    reads, so memory stays at one copy of the weights. A shared one (the LM head tied to the embedding)
    is kept for its other user. Returns how many weights were packed (0 when no packed kernel runs here)."""
    dtype = next(model.parameters()).dtype
    kind = packing_kind(dtype)
    if kind is None:
        return 0
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    packed = 0
    for module in model.modules():
        if not _uses_linear_method(module) or module.weight.device.type != "cpu":
            continue
        # The MLP's gate_up projection takes SiLU-and-mul into the GEMM: our float32 GEMM, and the AMX one,
        # which rounds where the separate bfloat16 ops do (the widening bfloat16 GEMM would skip those
        # roundings, which the bfloat16 comparisons with transformers expect).
        module_kind = kind
        if getattr(module, "fused_activation", None) == "silu_and_mul" and kind in ("amx", "panels"):
            module_kind = {"amx": "amx_gated", "panels": "gated" if dtype == torch.float32 else kind}[kind]
        # A float32 LM head on a CPU with AMX also keeps a bfloat16 copy: greedy rows take their token from it
        # (exactly the float32 logits' argmax, csrc/greedy_lm_head.cpp) at a third of the float32 product's cost.
        is_lm_head = getattr(module, "is_lm_head", False)
        if is_lm_head and module.tp_size == 1 and module_kind == "panels" and dtype == torch.float32 \
                and cpu_ops().amx_available():
            module.greedy_head = pack_greedy_lm_head(module.weight)
        # The LM head's float32 panels are read by greedy_lm_head whatever else it has.
        module.packed_weight = pack_weight(module.weight, module_kind,
                                           keep_panels=is_lm_head,
                                           blocks=getattr(module, "q4_blocks", None))  # fmt: skip
        module.q4_blocks = None  # packed: the blocks are no longer needed
        if owners[id(module.weight)] == 1:
            module.weight.data = torch.empty(0, dtype=dtype)
        packed += 1
    release_freed_memory()
    return packed


def _uses_linear_method(module: nn.Module) -> bool:
    return getattr(module, "uses_linear_method", False)  # the model's linears and LM head say so themselves


def has_greedy_kernel(lm_head: nn.Module) -> bool:
    """Does greedy_token_ids skip writing the logits here? float32 with its bfloat16 copy (greedy_head), or
    bfloat16 packed for AMX (the argmax taken in the GEMM's epilogue)."""
    packed = getattr(lm_head, "packed_weight", None)
    if getattr(lm_head, "greedy_head", None) is not None:
        return True
    return packed is not None and packed.kind == "amx" and lm_head.tp_size == 1


def greedy_token_ids(lm_head: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor | None:
    """The argmax of lm_head(hidden_states) a row (the first index on a tie) without the logits, or None where no
    kernel applies: float32 from the bfloat16 copy (a CPU with AMX), the same tokens without the float32 product;
    bfloat16 on AMX from the GEMM's sums as they are rounded, never stored."""
    head, packed = getattr(lm_head, "greedy_head", None), getattr(lm_head, "packed_weight", None)
    if hidden_states.dim() != 2:
        return None
    if head is not None and hidden_states.dtype == torch.float32:
        token_ids = cpu_ops().greedy_lm_head(
            hidden_states, head.amx_packed, head.weight_norms, packed.data, packed.out_features
        )
    elif has_greedy_kernel(lm_head) and hidden_states.dtype == torch.bfloat16:
        token_ids = cpu_ops().amx_greedy_argmax(hidden_states, packed.data, packed.out_features)
    else:
        return None
    full = (token_ids < 0).nonzero().flatten()  # rows whose hidden state or bfloat16 logits are not finite
    if len(full):
        token_ids[full] = torch.argmax(lm_head(hidden_states[full]), dim=-1)
    return token_ids
