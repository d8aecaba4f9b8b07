"""The LoRA manager of one model runner (every tensor-parallel rank has its own, fed the same requests): adapters read
from their folders into an LRU cache in host memory (max_cpu_loras), the ones a step runs copied into the layers'
device slots (max_loras, LRU among those the step does not use), and each row's slot handed to the layers.

vLLM's LRUCacheWorkerLoRAManager, on nanoinfer's layers.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from nanoinfer.errors import LoRAError
from nanoinfer.lora.layers import LoRAContext, LoRALayerWeights
from nanoinfer.lora.peft import PeftAdapter, read_adapter
from nanoinfer.lora_request import MAX_LORA_INT_ID, LoRARequest
from nanoinfer.models.layers.adaptable import adaptable_layers, lora_targets, slice_names


class _WarmUpLoRA(LoRARequest):
    """The warm-up's rows: they run through slot 0 whatever it holds (ModelRunner.warmup_batch), reading no folder.
    Its id is past any a LoRARequest may have, and it equals no LoRARequest (dataclass equality compares classes)."""

    def __post_init__(self):
        pass


WARM_UP_LORA = _WarmUpLoRA("nanoinfer-warm-up", MAX_LORA_INT_ID + 1, "")


class LoRAManager:
    """Adapters from checked folders to the layers' slots. An adapter is checked once (its config and tensor shapes:
    add_adapter, at admission), its weights read when a step first needs them and kept in host memory up to
    max_cpu_loras adapters; a step's adapters are copied into slots (activate)."""

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int, max_rows: int,
                 device: torch.device):  # fmt: skip
        """Give every adaptable layer of `model` its slots. Call before the platform packs the weights (a layer
        whose activation a GEMM would fuse is then packed without it: the deltas join before the activation)."""
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.context = LoRAContext(max_rows, device)
        self.shapes, _ = lora_targets(model)
        self.layers: dict[str, tuple[LoRALayerWeights, list[str]]] = {}  # our (fused) module name -> its slices'
        for path, layer in adaptable_layers(model).items():
            layer.lora = LoRALayerWeights(layer, max_loras, max_lora_rank, self.context)
            layer.fused_activation = None  # gate_up: the deltas join before the activation, so no GEMM may fuse it
            self.layers[path] = (layer.lora, slice_names(model, path, layer))
        self.cpu_cache: OrderedDict[int, dict] = OrderedDict()  # lora_int_id -> module -> (A, B), least recent first
        self.slots: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> device slot, least recent first
        self.checked: dict[int, tuple[LoRARequest, PeftAdapter]] = {}  # every adapter seen, by id
        self.num_slot_loads = 0  # adapters copied into a slot, over the engine's life

    @property
    def nbytes(self) -> int:
        """The slots' memory on this rank."""
        return sum(w.nbytes_per_slot for w, _ in self.layers.values()) * self.max_loras

    def add_adapter(self, lora: LoRARequest) -> PeftAdapter:
        """Check the adapter against the model (its config and tensor shapes; once an id): a LoRAError if it cannot
        run. Its weights are read when a step first runs it."""
        if lora.lora_int_id in self.checked:
            known, adapter = self.checked[lora.lora_int_id]
            if known.lora_path != lora.lora_path:
                raise LoRAError(f"lora_int_id {lora.lora_int_id} names two adapters ({known.lora_name}: "
                                f"{known.lora_path}; {lora.lora_name}: {lora.lora_path}). Give each its own id.")
            return adapter
        adapter = read_adapter(lora.lora_path, self.max_lora_rank, self.shapes, lora.lora_name)
        self.checked[lora.lora_int_id] = lora, adapter
        return adapter

    def _weights(self, lora: LoRARequest) -> dict:
        """The adapter's weights from the host cache, read on a miss (the least recently used one not in a slot
        dropped past max_cpu_loras: a slot's can be read again)."""
        if lora.lora_int_id in self.cpu_cache:
            self.cpu_cache.move_to_end(lora.lora_int_id)
            return self.cpu_cache[lora.lora_int_id]
        weights = self.add_adapter(lora).read_weights()
        self.cpu_cache[lora.lora_int_id] = weights
        while len(self.cpu_cache) > self.max_cpu_loras:
            evicted = next((i for i in self.cpu_cache if i not in self.slots and i != lora.lora_int_id), None)
            if evicted is None:
                break
            del self.cpu_cache[evicted]
        return weights

    def activate(self, loras: list[LoRARequest]) -> dict[int, int]:
        """Give each adapter of a step a device slot (at most max_loras adapters a step: the scheduler's rule);
        returns lora_int_id -> slot."""
        wanted = {lora.lora_int_id: lora for lora in loras}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step with {len(wanted)} adapters; max_loras is {self.max_loras}")
        for lora_id, lora in wanted.items():
            if lora_id in self.slots:
                self.slots.move_to_end(lora_id)
                continue
            weights = self._weights(lora)
            if len(self.slots) < self.max_loras:
                slot = len(self.slots)
            else:  # the least recently used slot of an adapter this step does not run
                evicted = next(id_ for id_ in self.slots if id_ not in wanted)
                slot = self.slots.pop(evicted)
            self._load_slot(slot, weights)
            self.slots[lora_id] = slot
            self.num_slot_loads += 1
        return {lora_id: self.slots[lora_id] for lora_id in wanted}

    def set_step(self, row_loras: list[LoRARequest | None] | None, kept_rows: torch.Tensor | None) -> None:
        """One adapter (or None) a row of the coming step (None: no row has one); kept_rows: the rows the last layer
        keeps (or None)."""
        if not row_loras:
            self.context.set_step(None, kept_rows)
            return
        warm_up = WARM_UP_LORA.lora_int_id
        present = {lora.lora_int_id: lora for lora in row_loras if lora is not None and lora.lora_int_id != warm_up}
        slots = {**self.activate(list(present.values())), WARM_UP_LORA.lora_int_id: 0}
        self.context.set_step([-1 if lora is None else slots[lora.lora_int_id] for lora in row_loras], kept_rows)

    def _load_slot(self, slot: int, weights: dict) -> None:
        for path, (layer_weights, names) in self.layers.items():
            fused = None if len(names) == 1 else weights.get(path)
            if fused is not None:  # one A for every slice, B split by the slices' rows
                a, b = fused
                sizes = [hi - lo for lo, hi in zip(layer_weights.slice_offsets, layer_weights.slice_offsets[1:])]
                tp = layer_weights.layer.tp_size
                parts = b.split([size * tp for size in sizes])
                layer_weights.set_slot(slot, [(a, part) for part in parts])
            else:
                layer_weights.set_slot(slot, [weights.get(name) for name in names])
