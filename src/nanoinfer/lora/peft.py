"""PEFT LoRA folders: read adapter_config.json and adapter_model.safetensors, and check them against the model.

What nanoinfer adapts: the attention's q/k/v/o and the MLP's gate/up/down projections, or a checkpoint's fused
qkv_proj / gate_up_proj (Phi-3), at any rank up to max_lora_rank, scaled by lora_alpha / r (or / sqrt(r) with
use_rslora; alpha_pattern and rank_pattern per module). Everything else an adapter can hold is refused, with the
reason, before any weight is read: DoRA, modules_to_save, LoRA biases, embedding or LM-head targets, other PEFT
methods, and tensors whose shapes belong to another base model. `adapter_problems` lists every problem of a folder
at once (check-config); `read_adapter` raises them as one LoRAError.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from nanoinfer.errors import LoRAError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")
_DORA_WEIGHT = "a DoRA magnitude: DoRA adapters are not supported."
SUPPORTED_TARGETS = "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (or a fused qkv_proj / gate_up_proj)"


@dataclass(frozen=True)
class LoRATarget:
    """One adapted module: its name in the base model (HF's, e.g. model.layers.0.self_attn.q_proj), its rank and
    its scaling (lora_alpha / rank, or / sqrt(rank) with rsLoRA)."""

    module: str
    rank: int
    scaling: float


@dataclass(frozen=True)
class PeftAdapter:
    path: Path
    targets: tuple[LoRATarget, ...]

    @property
    def max_rank(self) -> int:
        return max(t.rank for t in self.targets)

    def read_weights(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """module -> (A [rank, in], B [out, rank] times the module's scaling), float32."""
        out = {}
        with safe_open(str(self.path / ADAPTER_WEIGHTS), framework="pt", device="cpu") as f:
            for t in self.targets:
                a = f.get_tensor(f"{_PREFIX}{t.module}.lora_A.weight").float()
                b = f.get_tensor(f"{_PREFIX}{t.module}.lora_B.weight").float() * t.scaling
                out[t.module] = (a, b)
        return out


def read_adapter(path: str | Path, max_lora_rank: int, lora_shapes: dict[str, tuple[int, int]],
                 name: str | None = None) -> PeftAdapter:  # fmt: skip
    """The adapter in `path`, checked against the model's adaptable modules (`ModelSpec.lora_shapes`: module ->
    (in, out)); a LoRAError listing every problem otherwise."""
    adapter, problems = _read(Path(path), max_lora_rank, lora_shapes)
    if problems:
        label = f"LoRA adapter {name!r} ({path})" if name else f"LoRA adapter {path}"
        raise LoRAError(f"{label} cannot be used:\n" + "\n".join(f"  - {p}" for p in problems))
    return adapter


def adapter_rank(path: str | Path) -> int | None:
    """The largest rank of the adapter in `path` (its config's r and rank_pattern), None where that is unreadable."""
    try:
        config = json.loads((Path(path) / ADAPTER_CONFIG).read_text())
        ranks = [config.get("r", 8), *(config.get("rank_pattern") or {}).values()]
        return max(int(r) for r in ranks)
    except (OSError, ValueError, TypeError, AttributeError):
        return None  # Config's check of the folder says what is wrong


def adapter_problems(path: str | Path, max_lora_rank: int, lora_shapes: dict[str, tuple[int, int]]) -> list[str]:
    """Every reason the adapter in `path` cannot run on this model (empty: it can)."""
    return _read(Path(path), max_lora_rank, lora_shapes)[1]


def _read(path: Path, max_lora_rank: int, lora_shapes: dict) -> tuple[PeftAdapter | None, list[str]]:
    if not path.is_dir():
        return None, [f"{path} is not a folder. Give the PEFT adapter's folder (adapter_config.json and "
                      f"{ADAPTER_WEIGHTS}), as saved by PeftModel.save_pretrained."]  # fmt: skip
    config, problems = _read_config(path)
    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file():
        hint = (" It has adapter_model.bin, a pickle nanoinfer does not load (it can run code): convert it with "
                "`PeftModel.from_pretrained(...).save_pretrained(folder, safe_serialization=True)`."
                if (path / "adapter_model.bin").is_file() else "")  # fmt: skip
        return None, problems + [f"{weights} is missing.{hint}"]
    if config is None:
        return None, problems
    try:
        with safe_open(str(weights), framework="pt", device="cpu") as f:
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except Exception as e:  # a truncated or foreign file: safetensors raises its own error types
        return None, problems + [f"{weights} is not a readable safetensors file ({str(e).splitlines()[0]})."]
    targets, weight_problems = _targets(shapes, config, max_lora_rank, lora_shapes)
    problems += weight_problems
    if not targets and not weight_problems:
        problems.append(f"{weights} holds no LoRA weights (lora_A / lora_B).")
    return (None if problems else PeftAdapter(path, tuple(targets))), problems


def _read_config(path: Path) -> tuple[dict | None, list[str]]:
    file = path / ADAPTER_CONFIG
    if not file.is_file():
        return None, [f"{file} is missing: is this a PEFT adapter folder?"]
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        return None, [f"{file} is not valid JSON ({e})."]
    if not isinstance(config, dict):
        return None, [f"{file} is not a JSON object."]
    problems = []
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        problems.append(f"peft_type is {peft_type!r}: nanoinfer runs LoRA adapters only.")
    if config.get("use_dora"):
        problems.append("use_dora is true: DoRA adapters (a learned magnitude per output) are not supported; "
                        "merge the adapter into the model (merge_and_unload) or train a plain LoRA.")  # fmt: skip
    if config.get("modules_to_save"):
        problems.append(f"modules_to_save is {config['modules_to_save']!r}: adapters that replace whole modules "
                        "are not supported; merge the adapter into the model (merge_and_unload) instead.")  # fmt: skip
    for name, what in (("layer_replication", "layer replication"), ("target_parameters", "LoRA on raw parameters "
                       "(MoE experts)"), ("alora_invocation_tokens", "activated LoRA (aLoRA)")):  # fmt: skip
        if config.get(name):
            problems.append(f"{name} is set: {what} is not supported.")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        problems.append("the adapter trains biases (bias / lora_bias): not supported; train with bias='none'.")
    for name in ("r", "lora_alpha"):
        value = config.get(name, 8)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            problems.append(f"{name} is {value!r}: expected a positive number.")
    return config, problems


def _targets(shapes: dict, config: dict, max_lora_rank: int, lora_shapes: dict) -> tuple[list[LoRATarget], list]:
    modules: dict[str, dict[str, tuple]] = {}
    foreign: dict[str, list[str]] = {}  # why a weight is not read -> those weights
    for key, shape in shapes.items():
        match = _KEY.match(key)
        if match is None:
            foreign.setdefault(_foreign_weight(key), []).append(key)
            continue
        modules.setdefault(match["module"], {})[match["which"]] = shape
    if config.get("use_dora"):  # already said, by the config check
        foreign.pop(_DORA_WEIGHT, None)
    problems = [f"{_some(keys)}: {why}" for why, keys in foreign.items()]
    base = config.get("base_model_name_or_path") or "another model"
    targets, unknown, too_wide, mismatched = [], [], [], []
    for module, pair in sorted(modules.items()):
        if module not in lora_shapes:
            unknown.append(module)
            continue
        if set(pair) != {"A", "B"}:
            problems.append(f"{module} has lora_{'AB'.replace(next(iter(pair)), '')} missing.")
            continue
        (rank, fan_in), (fan_out, rank_b) = pair["A"], pair["B"]
        if rank != rank_b:
            problems.append(f"{module}: lora_A has rank {rank}, lora_B {rank_b}.")
        elif (fan_in, fan_out) != lora_shapes[module]:
            mismatched.append(f"{module} maps {fan_in} -> {fan_out} features, this model's {lora_shapes[module][0]} "
                              f"-> {lora_shapes[module][1]}")  # fmt: skip
        elif rank > max_lora_rank:
            too_wide.append((rank, module))
        else:
            targets.append(LoRATarget(module, rank, _scaling(config, module, rank)))
    if mismatched:
        problems.append(f"the adapter was trained for {base}, not this model: {_some(mismatched)}.")
    if too_wide:
        rank = max(r for r, _ in too_wide)
        problems.append(f"rank {rank}, over max_lora_rank {max_lora_rank} ({_some([m for _, m in too_wide])}): raise "
                        f"max_lora_rank (--max-lora-rank {rank}) or use a smaller adapter.")  # fmt: skip
    if unknown:
        problems.append(f"targets modules nanoinfer does not adapt in this model: {_some(unknown)}. Supported "
                        f"targets: {SUPPORTED_TARGETS} of the decoder layers.")  # fmt: skip
    return targets, problems


def _some(names: list[str], shown: int = 3) -> str:
    """A few names of a list, and how many more."""
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _foreign_weight(key: str) -> str:
    if "lora_magnitude_vector" in key:
        return _DORA_WEIGHT
    if ".base_layer." in key:
        return "a base-model weight saved with the adapter (save_embedding_layers, a trained embedding or LM head): " \
               "not supported; merge the adapter into the model (merge_and_unload) instead."
    if "lora_embedding" in key or "embed_tokens" in key:
        return "an embedding target: nanoinfer adapts linear projections only (q/k/v/o, gate/up/down)."
    if "modules_to_save" in key:
        return "a whole module saved with the adapter (modules_to_save): not supported."
    if key.endswith(".bias"):
        return "a LoRA bias: not supported (train with bias='none')."
    return f"not a LoRA weight nanoinfer reads (expected {_PREFIX}<module>.lora_A.weight / .lora_B.weight)."


def _scaling(config: dict, module: str, rank: int) -> float:
    """PEFT's scaling of one module: its lora_alpha (alpha_pattern's first key matching the module's name, else
    lora_alpha) over its rank, or over sqrt(rank) with use_rslora."""
    alpha = config.get("lora_alpha", 8)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            alpha = value
            break
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
