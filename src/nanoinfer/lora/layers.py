"""The adapted layers' slots of adapter weights, and which slot each row of a step reads (which layers are adaptable,
and their names in a PEFT adapter: models/layers/adaptable.py).

A layer's `lora` (a LoRALayerWeights) holds every resident adapter's A and B in fixed slots, so one step's rows can
each use their own adapter in the same forward pass (Punica's batched LoRA): the platform's `add_lora` adds each
row's x A^T B^T (B scaled) to the base output. Fused layers (q/k/v, gate/up) hold one slice per projection, each
with its own A and B. Under tensor parallelism a slot is sharded like the layer: a column-parallel layer's B by
output rows, a row-parallel layer's A by input columns (its partial products then join the all-reduce the base
output already makes).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from nanoinfer.models.layers.linear import ColumnParallelLinear


class LoRAContext:
    """Which slot each row of the running step uses (-1: the base model), for every adapted layer.

    A layer reads the rows its input has: the step's rows, or the last layer's kept rows (the model runs the last
    o_proj and MLP for the rows the step reads only: DecoderModel.forward); told apart by count, as the kept rows
    are a strict subset when they differ. `active` is False when no row has an adapter: the layers then add nothing.
    """

    def __init__(self, max_rows: int, device: torch.device):
        # One buffer the step's slots are copied into, so a CUDA graph captured over it reads each replay's slots.
        self.buffer = torch.full((max_rows,), -1, dtype=torch.int32, device=device)
        self.row_slots = self.buffer[:0]
        self.kept_slots: torch.Tensor | None = None
        self.active = False
        self._dirty = False  # the buffer holds slots other than -1

    def set_step(self, row_slots: list[int] | None, kept_rows: torch.Tensor | None) -> None:
        """row_slots: one slot a row of the step (None: no row has an adapter)."""
        self.kept_slots = None
        self.active = row_slots is not None and any(slot >= 0 for slot in row_slots)
        if not self.active:  # a graph replay still reads the buffer: it must say -1 everywhere
            if self._dirty:
                self.buffer.fill_(-1)
                self._dirty = False
            self.row_slots = self.buffer[:0]
            return
        count = len(row_slots)
        if count > self.buffer.numel():  # a step has at most max_num_batched_tokens rows
            raise RuntimeError(f"a step of {count} rows; the LoRA row buffer holds {self.buffer.numel()}")
        self.buffer.fill_(-1)
        self.buffer[:count].copy_(torch.tensor(row_slots, dtype=torch.int32))
        self._dirty = True
        self.row_slots = self.buffer[:count]
        if kept_rows is not None:
            self.kept_slots = self.row_slots[kept_rows]

    def set_graph_rows(self, num_rows: int) -> None:
        """Rows of a CUDA graph being captured: its kernels read the buffer's first num_rows slots when replayed."""
        self.row_slots, self.kept_slots, self.active = self.buffer[:num_rows], None, True

    @contextmanager
    def row_window(self, num_rows: int, start: int, stop: int):
        """Layers called on rows start:stop of a num_rows input (the MLP's chunks of rows) read those rows' slots."""
        if not self.active:
            yield
            return
        saved = self.row_slots, self.kept_slots
        self.row_slots, self.kept_slots = self.slots_for(num_rows)[start:stop], None
        try:
            yield
        finally:
            self.row_slots, self.kept_slots = saved

    def slots_for(self, num_rows: int) -> torch.Tensor | None:
        if not self.active:
            return None
        if num_rows == self.row_slots.numel():
            return self.row_slots
        if self.kept_slots is not None and num_rows == self.kept_slots.numel():
            return self.kept_slots
        raise RuntimeError(f"a LoRA layer got {num_rows} rows; the step has {self.row_slots.numel()}")


class LoRALayerWeights:
    """One adapted layer's slots: lora_a [max_loras, slices * max_rank, in] and lora_b [max_loras, max_rank, out]
    (B transposed and scaled) of this rank's shard, zeros where a slot's adapter does not target a slice."""

    def __init__(self, layer: nn.Module, max_loras: int, max_rank: int, context: LoRAContext):
        self.layer = layer
        self.context = context
        self.max_rank = max_rank
        self.column_parallel = isinstance(layer, ColumnParallelLinear)
        weight = layer.weight
        sizes = layer.output_sizes if self.column_parallel else [weight.shape[0]]
        self.slice_offsets = tuple(sum(sizes[:i]) for i in range(len(sizes) + 1))
        self.lora_a = torch.zeros(max_loras, len(sizes) * max_rank, weight.shape[1], dtype=weight.dtype,
                                  device=weight.device)  # fmt: skip
        self.lora_b = torch.zeros(max_loras, max_rank, sum(sizes), dtype=weight.dtype, device=weight.device)

    def set_slot(self, slot: int, slices: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Slot `slot` <- one (A [rank, in], B [out, rank], scaled, whole-model sizes) a slice, None where the
        adapter leaves the slice alone."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        rank_id = self.layer.tp_rank
        for s, weights in enumerate(slices):
            if weights is None:
                continue
            a, b = weights
            rank = a.shape[0]
            lo, hi = self.slice_offsets[s], self.slice_offsets[s + 1]
            if self.column_parallel:  # B's rows follow the layer's output rows: this rank's share of them
                b = b.narrow(0, rank_id * (hi - lo), hi - lo)
            else:  # A's columns follow the layer's input columns
                a = a.narrow(1, rank_id * self.lora_a.shape[2], self.lora_a.shape[2])
            self.lora_a[slot, s * self.max_rank : s * self.max_rank + rank] = a
            self.lora_b[slot, :rank, lo:hi] = b.T

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += each row's adapter delta of x, in place (nothing when no row of the step has an adapter)."""
        row_slots = self.context.slots_for(x.shape[0])
        if row_slots is not None:
            self.layer.platform.add_lora(y, x, self.lora_a, self.lora_b, row_slots, self.slice_offsets)

    @property
    def nbytes_per_slot(self) -> int:
        return (self.lora_a[0].numel() + self.lora_b[0].numel()) * self.lora_a.element_size()
