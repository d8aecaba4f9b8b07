"""A model folder's weights into a model: its *.safetensors files, else its GGUF file (one model, possibly split
into *-0000i-of-0000N.gguf shards).

Only safetensors and GGUF files are read: pickle checkpoints (*.bin) can run code on load and are refused.
"""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open
from torch import nn

from nanoinfer.errors import ModelLoadError
from nanoinfer.models.weights import gguf
from nanoinfer.models.weights.loading import WeightLoading


def load_weights(model: nn.Module, model_dir: str | Path, hf_config=None) -> None:
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return load_safetensors(model, files, model_dir)
    ggufs = gguf.gguf_files(model_dir)
    if ggufs:
        return gguf.load_gguf_weights(model, gguf.model_file(model_dir, ggufs), hf_config)
    has_bin = any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt"))
    hint = (
        " It has pickle weights (*.bin), which nanoinfer does not load because unpickling can run code;"
        " convert them with `transformers` (model.save_pretrained(dir, safe_serialization=True))."
        if has_bin else ""
    )
    raise ModelLoadError(f"no *.safetensors weights in {model_dir}.{hint}")


def load_safetensors(model: nn.Module, files: list[Path], source: Path) -> None:
    loading = WeightLoading(model)
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                loading.load(name, lambda f=f, name=name: f.get_tensor(name))
    loading.finish(source)
