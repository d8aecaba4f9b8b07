"""Linear attention's two state-carrying ops on the CPU (attention/gated_delta.py holds the reference and the state
cache's layout), in csrc/gated_delta.cpp: a decode step (one row a sequence) through the decode kernels, any other
step (prompt chunks, with or without one-token rows beside them) through the prefill kernels in one call each.

A decode step reads and writes every sequence's state once a layer, which is most of what linear attention costs
there: the kernel does it in two passes over the state instead of the reference's several torch ops a head. A
prompt chunk runs the rule token by token (the recurrent form: its float32 results differ from the reference's
chunked form by rounding), each work item (sequence, value head, block of columns) keeping its block of the state
in L1 from the first token to the last; the convolution likewise keeps a block of channels' window.
Inputs the kernels do not take (float16, the extension not built, metadata without the host copies of its
lengths) get None, and the platform runs the reference.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from nanoinfer.platforms.cpu.ops import cpu_ops

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class Step:
    """A step's sequences as the kernels take them."""

    decode: bool  # one row a sequence: the decode kernels (rows are sequences)
    query_start_loc: torch.Tensor | None  # each sequence's first row, then the end (int64 [B + 1]); None: decode
    has_context: torch.Tensor | None  # whether each sequence has context (bool [B]); None: all of them


def step_of(metadata, num_tokens: int) -> Step:
    """A decode step (one row a sequence) or any other, from the host copies of the lengths. A decode step costs
    no Python loop over its sequences when all have context: it runs once per linear-attention layer."""
    query_lens, seq_lens = metadata.query_lens_cpu, metadata.seq_lens_cpu
    if len(query_lens) == num_tokens and max(query_lens, default=1) == 1:
        has_context = None if min(seq_lens, default=2) > 1 else torch.tensor([s > 1 for s in seq_lens])
        return Step(True, None, has_context)
    starts = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int64)
    context = [s > n for n, s in zip(query_lens, seq_lens)]
    return Step(False, starts, None if all(context) else torch.tensor(context, dtype=torch.bool))


def _no_host_lens(metadata) -> bool:
    return metadata.query_lens_cpu is None or metadata.seq_lens_cpu is None


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, metadata) -> torch.Tensor | None:
    """Platform.causal_conv1d (silu of the causal depthwise convolution), or None where the kernel does not take
    these tensors."""
    ops = cpu_ops()
    if (ops is None or x.dtype not in _KERNEL_DTYPES or weight.dtype != x.dtype or conv_state.dtype != x.dtype
            or x.dim() != 2 or not conv_state.is_contiguous() or x.device.type != "cpu"
            or _no_host_lens(metadata)):  # fmt: skip
        return None
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    step = step_of(metadata, x.shape[0])
    out = torch.empty(x.shape, dtype=x.dtype)
    if step.decode:
        ops.causal_conv1d_update(x, weight, conv_state, metadata.state_slots, out, step.has_context)
    else:
        ops.causal_conv1d_prefill(x, weight, conv_state, metadata.state_slots, step.query_start_loc, out,
                                  step.has_context)  # fmt: skip
    return out


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     ssm_state: torch.Tensor, metadata) -> torch.Tensor | None:  # fmt: skip
    """Platform.gated_delta_rule, or None where the kernel does not take these tensors."""
    ops = cpu_ops()
    if (ops is None or v.dtype not in _KERNEL_DTYPES or q.dtype != v.dtype or k.dtype != v.dtype
            or ssm_state.dtype != torch.float32 or not ssm_state.is_contiguous()
            or v.device.type != "cpu" or _no_host_lens(metadata)):  # fmt: skip
        return None
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    g, beta = g.float().contiguous(), beta.float().contiguous()
    step = step_of(metadata, v.shape[0])
    out = torch.empty(v.shape, dtype=v.dtype)
    if step.decode:
        ops.gated_delta_decode(q, k, v, g, beta, ssm_state, metadata.state_slots, out, step.has_context)
    else:
        ops.gated_delta_prefill(q, k, v, g, beta, ssm_state, metadata.state_slots, step.query_start_loc, out,
                                step.has_context)  # fmt: skip
    return out
