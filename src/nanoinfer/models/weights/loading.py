"""One checkpoint into a model, whatever its format: names -> parameters through the layers' weight loaders, then a
check that names every missing and unexpected weight."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from nanoinfer.errors import ModelLoadError
from nanoinfer.models.layers.moe import expert_target

# Shard ids of a tensor holding every expert's projection (transformers' fused expert tensors): they fill all of
# the parameter's per-expert shards
_WHOLE_SHARDS = ("w13", "w2")


class WeightLoading:
    """One checkpoint into `model`, whatever its format (safetensors, GGUF): checkpoint tensor names (HF's) ->
    parameters through their weight loaders, then a check that every parameter was loaded and nothing was left."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.packed = getattr(model, "packed_modules", {})
        self.tied = getattr(model, "tie_word_embeddings", False)
        self.loaded: set[str] = set()
        self.unexpected: list[str] = []

    def load(self, name: str, tensor_fn) -> None:
        """Checkpoint tensor `name` (read by tensor_fn(), only if the model keeps it) through the family's
        name mapping (CausalLM.sanitize) into its parameters."""
        if getattr(self.model, "is_base_checkpoint", False) and not name.startswith("model."):
            name = f"model.{name}"  # a base model's checkpoint (registry.is_base_checkpoint)
        sanitize = getattr(self.model, "sanitize", None)
        pairs = sanitize(name, tensor_fn) if sanitize is not None else [(name, tensor_fn)]
        for new_name, fn in pairs:
            found = self.target(new_name)
            if found is not None:
                self.copy(new_name, *found, fn())

    def target(self, name: str) -> tuple[str, object] | None:
        """(parameter, shard id) the checkpoint tensor `name` fills, or None when it is not loaded (read it only
        if not None): the tied head, rotary tables, or a name the model does not have (reported by finish)."""
        if self.tied and name == "lm_head.weight":
            return None  # the head shares the embedding table
        if "rotary_emb.inv_freq" in name:
            return None  # recomputed from the config
        target, shard_id = expert_target(name) or target_name(name, self.packed)
        param = self.params.get(target)
        whole = shard_id in _WHOLE_SHARDS and hasattr(param, "shard_ids")  # every expert's tensor at once
        if param is None or (shard_id is not None and not whole
                             and shard_id not in getattr(param, "shard_ids", (shard_id,))):
            self.unexpected.append(name)  # not in the model, or a shard its layer does not hold (Gemma 4's k = v)
            return None
        return target, shard_id

    def copy(self, name: str, target: str, shard_id, tensor: torch.Tensor) -> None:
        param = self.params[target]
        loader = getattr(param, "weight_loader", None)
        with torch.no_grad():
            if loader is None:
                _check_shape(name, param, tensor)
                param.data.copy_(tensor)
            elif shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        if shard_id in _WHOLE_SHARDS and hasattr(param, "shard_ids"):
            self.loaded.update(f"{target}:{s}" for s in param.shard_ids)
        else:
            self.loaded.add(target if shard_id is None else f"{target}:{shard_id}")

    def finish(self, source: Path) -> None:
        """Every parameter loaded and nothing left over, or a ModelLoadError naming both lists."""
        _check_complete(self.model, self.packed, self.tied, self.loaded, self.unexpected, source)


def _check_complete(model: nn.Module, packed: dict, tied: bool, loaded: set[str], unexpected: list[str],
                    source: Path) -> None:
    expected = _expected_names(model, packed, tied)
    missing = sorted(expected - loaded)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing weights: {', '.join(missing[:20])}" + (" ..." if len(missing) > 20 else ""))
        if unexpected:
            parts.append(f"unexpected weights: {', '.join(unexpected[:20])}" + (" ..." if len(unexpected) > 20 else ""))
        raise ModelLoadError(
            f"the checkpoint in {source} does not match the {type(model).__name__} built from its config.json "
            f"({'; '.join(parts)}). Check that config.json belongs to these weights."
        )


def target_name(name: str, packed: dict) -> tuple[str, object]:
    for fragment, (fused, shard_id) in packed.items():
        if f".{fragment}." in name:
            return name.replace(f".{fragment}.", f".{fused}."), shard_id
    return name, None


def _expected_names(model: nn.Module, packed: dict, tied: bool) -> set[str]:
    names = set()
    shards_by_fused: dict[str, list] = {}
    for fused, shard_id in packed.values():
        shards_by_fused.setdefault(fused, []).append(shard_id)
    for name, param in model.named_parameters():
        if tied and name == "lm_head.weight":
            continue
        fused = next((f for f in shards_by_fused if f".{f}." in name), None)
        if fused is None and hasattr(param, "shard_ids"):  # experts: each expert's projections
            names.update(f"{name}:{s}" for s in param.shard_ids)
        elif fused is None:
            names.add(name)
        else:  # every shard of the fused name, or those its layer holds (Gemma 4's layers without v, or k and v)
            names.update(f"{name}:{s}" for s in getattr(param, "shard_ids", shards_by_fused[fused]))
    return names


def _check_shape(name: str, param: torch.Tensor, tensor: torch.Tensor) -> None:
    if param.shape != tensor.shape:
        raise ModelLoadError(f"weight {name} has shape {tuple(tensor.shape)}, the model expects {tuple(param.shape)}.")
