"""safetensors (or GGUF) checkpoint -> model parameters. Names every missing and unexpected weight in its error.

Only safetensors and GGUF files are read: pickle checkpoints (*.bin) can run code on load and are refused.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from nanoinfer.errors import ModelLoadError


def load_weights(model: nn.Module, model_dir: str | Path, hf_config=None) -> None:
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        from nanoinfer.model import gguf

        ggufs = gguf.gguf_files(model_dir)
        if len(ggufs) == 1:
            return gguf.load_gguf_weights(model, ggufs[0], hf_config)
        if len(ggufs) > 1:
            raise ModelLoadError(f"{model_dir} holds several GGUF files ({', '.join(p.name for p in ggufs)}); "
                                 "keep one model per folder (split GGUF files are not supported yet).")
        has_bin = any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt"))
        hint = (
            " It has pickle weights (*.bin), which nanoinfer does not load because unpickling can run code;"
            " convert them with `transformers` (model.save_pretrained(dir, safe_serialization=True))."
            if has_bin else ""
        )
        raise ModelLoadError(f"no *.safetensors weights in {model_dir}.{hint}")
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules", {})
    tied = getattr(model, "tie_word_embeddings", False)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if tied and name == "lm_head.weight":
                    continue  # the head shares the embedding table
                if "rotary_emb.inv_freq" in name:
                    continue  # recomputed from the config
                target, shard_id = target_name(name, packed)
                param = params.get(target)
                if param is None:
                    unexpected.append(name)
                    continue
                tensor = f.get_tensor(name)
                loader = getattr(param, "weight_loader", None)
                with torch.no_grad():
                    if loader is None:
                        _check_shape(name, param, tensor)
                        param.data.copy_(tensor)
                    elif shard_id is None:
                        loader(param, tensor)
                    else:
                        loader(param, tensor, shard_id)
                loaded.add(target if shard_id is None else f"{target}:{shard_id}")
    check_complete(model, packed, tied, loaded, unexpected, model_dir)


def check_complete(model: nn.Module, packed: dict, tied: bool, loaded: set[str], unexpected: list[str],
                   source: Path) -> None:
    """Every parameter loaded and nothing left over, or a ModelLoadError naming both lists."""
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
    for name, _ in model.named_parameters():
        if tied and name == "lm_head.weight":
            continue
        fused = next((f for f in shards_by_fused if f".{f}." in name), None)
        if fused is None:
            names.add(name)
        else:
            names.update(f"{name}:{s}" for s in shards_by_fused[fused])
    return names


def _check_shape(name: str, param: torch.Tensor, tensor: torch.Tensor) -> None:
    if param.shape != tensor.shape:
        raise ModelLoadError(f"weight {name} has shape {tuple(tensor.shape)}, the model expects {tuple(param.shape)}.")
