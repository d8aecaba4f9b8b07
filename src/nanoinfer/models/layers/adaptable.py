"""Which of a model's linear layers a LoRA adapter may target, and their names in a PEFT adapter (HF's module names):
the attention's q/k/v/o and the MLP's gate/up/down projections, fused here as qkv_proj and gate_up_proj. The slots
that hold the adapters' weights are lora/layers.py's.
"""

from __future__ import annotations

from torch import nn

from nanoinfer.models.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

# The projections a LoRA adapter may target, by our (fused) module's name: attention's and the MLP's.
ADAPTABLE = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def adaptable_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Our module path -> the decoder's linear layers LoRA adapts (not the LM head, experts or linear attention)."""
    return {name: module for name, module in model.named_modules()
            if name.rsplit(".", 1)[-1] in ADAPTABLE
            and isinstance(module, (ColumnParallelLinear, RowParallelLinear))}  # fmt: skip


def slice_names(model: nn.Module, path: str, layer: nn.Module) -> list[str]:
    """The PEFT module name of each slice of our layer at `path`, in slice order (q, k, v, or those a Gemma 4 layer
    holds; gate, up; or the layer itself)."""
    if not isinstance(layer, QKVParallelLinear) and (not isinstance(layer, ColumnParallelLinear)
                                                     or len(layer.output_sizes) == 1):  # fmt: skip
        return [path]
    prefix, fused = path.rsplit(".", 1)
    by_shard = {(f, shard): fragment for fragment, (f, shard) in model.packed_modules.items()}
    shards = layer.shards if isinstance(layer, QKVParallelLinear) else range(len(layer.output_sizes))
    return [f"{prefix}.{by_shard[(fused, shard)]}" for shard in shards]


def lora_targets(model: nn.Module) -> tuple[dict[str, tuple[int, int]], tuple[tuple[int, int, bool], ...]]:
    """(every module name an adapter may target (HF's: each slice, and a fused layer whole) -> (in, out) features;
    every slice a slot holds as (in, out, row-parallel)), of the whole model (a tensor-parallel rank's layers scaled
    back up). Read before the platform packs the weights."""
    shapes, slices = {}, []
    for path, layer in adaptable_layers(model).items():
        column = isinstance(layer, ColumnParallelLinear)
        fan_in = layer.weight.shape[1] * (1 if column else layer.tp_size)
        sizes = [size * layer.tp_size for size in layer.output_sizes] if column else [layer.weight.shape[0]]
        for name, size in zip(slice_names(model, path, layer), sizes):
            shapes[name] = (fan_in, size)
            slices.append((fan_in, size, not column))
        if len(sizes) > 1:
            shapes[path] = (fan_in, sum(sizes))  # the fused projection as one target (Phi-3's qkv_proj)
    return shapes, tuple(slices)
