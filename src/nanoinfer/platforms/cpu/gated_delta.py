"""Linear attention's two state-carrying ops on the CPU (attention/gated_delta.py holds the reference and the state
cache's layout): a step's one-token rows (decode rows, and one-token prompts) go to csrc/gated_delta.cpp's decode
kernels in one call; its prompt chunks to the reference, per sequence, which runs them in the chunked form.

A decode step reads and writes every sequence's state once a layer, which is most of what linear attention costs
there: the kernel does it in two passes over the state instead of the reference's several torch ops a head.
Inputs the kernels do not take (float16, the extension not built, metadata without the host copies of its
lengths) get None, and the platform runs the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from nanoinfer.attention import gated_delta as reference
from nanoinfer.platforms.cpu.ops import cpu_ops

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class StepSplit:
    """A step's rows as the kernels and the reference take them."""

    decode_rows: torch.Tensor | None  # rows of the one-token sequences (int64), None: every row is one
    decode_slots: torch.Tensor  # their slots
    has_context: torch.Tensor | None  # whether each has context (bool), None: all of them
    prefills: list[tuple[int, int, int]]  # (first row, rows, sequence index) of the longer sequences


def split_step(metadata, num_tokens: int) -> StepSplit:
    """Which rows are one-token sequences. A decode step (one row a sequence, all with context) costs no
    Python loop: it runs once per linear-attention layer."""
    query_lens, seq_lens = metadata.query_lens_cpu, metadata.seq_lens_cpu
    if len(query_lens) == num_tokens and max(query_lens, default=1) == 1:
        has_context = None if min(seq_lens, default=2) > 1 else torch.tensor([s > 1 for s in seq_lens])
        return StepSplit(None, metadata.state_slots, has_context, [])
    rows, seqs, prefills = [], [], []
    for i, (start, n, _) in enumerate(reference.sequence_spans(metadata)):
        if n == 1:
            rows.append(start)
            seqs.append(i)
        else:
            prefills.append((start, n, i))
    seq_index = torch.tensor(seqs, dtype=torch.int64)
    has_context = torch.tensor([seq_lens[i] > 1 for i in seqs], dtype=torch.bool)
    return StepSplit(torch.tensor(rows, dtype=torch.int64), metadata.state_slots[seq_index], has_context, prefills)


def _no_host_lens(metadata) -> bool:
    return metadata.query_lens_cpu is None or metadata.seq_lens_cpu is None


def _one_sequence(metadata, i: int) -> SimpleNamespace:
    """The metadata of sequence i alone, for the reference."""
    return SimpleNamespace(state_slots=metadata.state_slots[i : i + 1], query_lens_cpu=[metadata.query_lens_cpu[i]],
                           seq_lens_cpu=[metadata.seq_lens_cpu[i]])  # fmt: skip


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
    split = split_step(metadata, x.shape[0])
    out = torch.empty(x.shape, dtype=x.dtype)
    if split.decode_rows is None:
        ops.causal_conv1d_update(x, weight, conv_state, split.decode_slots, out, split.has_context)
        return out
    if split.decode_rows.numel():
        decoded = torch.empty(len(split.decode_rows), x.shape[1], dtype=x.dtype)
        ops.causal_conv1d_update(x[split.decode_rows], weight, conv_state, split.decode_slots, decoded,
                                 split.has_context)  # fmt: skip
        out[split.decode_rows] = decoded
    for start, n, i in split.prefills:
        out[start : start + n] = reference.causal_conv1d(x[start : start + n], weight, conv_state,
                                                         _one_sequence(metadata, i))  # fmt: skip
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
    split = split_step(metadata, v.shape[0])
    out = torch.empty(v.shape, dtype=v.dtype)
    if split.decode_rows is None:
        ops.gated_delta_decode(q, k, v, g, beta, ssm_state, split.decode_slots, out, split.has_context)
        return out
    if split.decode_rows.numel():
        rows = split.decode_rows
        decoded = torch.empty((len(rows), *v.shape[1:]), dtype=v.dtype)
        ops.gated_delta_decode(q[rows], k[rows], v[rows], g[rows], beta[rows], ssm_state, split.decode_slots,
                               decoded, split.has_context)  # fmt: skip
        out[rows] = decoded
    for start, n, i in split.prefills:
        rows_of = slice(start, start + n)
        out[rows_of] = reference.gated_delta_rule(q[rows_of], k[rows_of], v[rows_of], g[rows_of], beta[rows_of],
                                                  ssm_state, _one_sequence(metadata, i))  # fmt: skip
    return out
