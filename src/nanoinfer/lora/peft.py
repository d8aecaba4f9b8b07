"""PEFT LoRA folders: read adapter_config.json and adapter_model.safetensors, and check them against the model.

What nanoinfer adapts: the attention's q/k/v/o and the MLP's gate/up/down projections, or a checkpoint's fused
qkv_proj / gate_up_proj (Phi-3), at any rank up to max_lora_rank, scaled by lora_alpha / r (or / sqrt(r) with
use_rslora; alpha_pattern and rank_pattern per module). An adapter of a vision-language checkpoint names its text
model's modules model.language_model.* (transformers 5) or language_model.model.* (before): read as the text model's;
its vision or audio tower's targets are skipped (text prompts never reach them: the text output is PEFT's).
Everything else an adapter can hold is refused, with the reason, before any weight is read: DoRA, modules_to_save,
LoRA biases, embedding or LM-head targets, other PEFT methods, malformed config values and tensors,
and tensors whose shapes belong to another base model. `adapter_problems` lists every problem of a folder at once
(check-config); `read_adapter` raises them as one LoRAError.
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
_BIAS_WEIGHT = "a LoRA bias: not supported (train with bias='none')."
_SAVED_MODULE = "a whole module saved with the adapter (modules_to_save): not supported."
SUPPORTED_TARGETS = "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (or a fused qkv_proj / gate_up_proj)"
# A vision-language checkpoint's language model, by transformers 5's name and the older one: its text model's modules
_LANGUAGE_MODEL_PREFIXES = ("model.language_model.", "language_model.model.")
# The parts of a vision-language checkpoint besides its language model, which nanoinfer does not run
_TOWERS = {"vision_tower": "the vision tower", "visual": "the vision tower", "embed_vision": "the vision embedding",
           "multi_modal_projector": "the multimodal projector", "audio_tower": "the audio tower",
           "embed_audio": "the audio embedding"}  # fmt: skip


@dataclass(frozen=True)
class LoRATarget:
    """One adapted module: its name in the base model (HF's, e.g. model.layers.0.self_attn.q_proj), its rank and
    its scaling (lora_alpha / rank, or / sqrt(rank) with rsLoRA); file_module: its name in the adapter's file where
    that differs (a vision-language checkpoint's model.language_model.layers.0.self_attn.q_proj)."""

    module: str
    rank: int
    scaling: float
    file_module: str | None = None


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
        try:
            with safe_open(str(self.path / ADAPTER_WEIGHTS), framework="pt", device="cpu") as f:
                for t in self.targets:
                    key = f"{_PREFIX}{t.file_module or t.module}"
                    a = f.get_tensor(f"{key}.lora_A.weight").float()
                    b = f.get_tensor(f"{key}.lora_B.weight").float() * t.scaling
                    out[t.module] = (a, b)
        except Exception as e:  # checked when admitted, so the file changed or broke since
            raise LoRAError(f"LoRA adapter {self.path}: {ADAPTER_WEIGHTS} cannot be read ({_first_line(e)}). Was "
                            "it changed after it was checked? Restore the folder, or save the adapter again."
                            ) from None  # fmt: skip
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
    except (OSError, ValueError, TypeError, AttributeError, OverflowError):
        return None  # Config's check of the folder says what is wrong


def adapter_problems(path: str | Path, max_lora_rank: int, lora_shapes: dict[str, tuple[int, int]]) -> list[str]:
    """Every reason the adapter in `path` cannot run on this model (empty: it can)."""
    return _read(Path(path), max_lora_rank, lora_shapes)[1]


def _read(path: Path, max_lora_rank: int, lora_shapes: dict) -> tuple[PeftAdapter | None, list[str]]:
    try:
        return _read_folder(path, max_lora_rank, lora_shapes)
    except Exception as e:  # what no check below foresaw in a config or a header: a problem, never a traceback
        return None, [f"{path} is not a PEFT LoRA adapter this nanoinfer reads: {_first_line(e)}."]


def _read_folder(path: Path, max_lora_rank: int, lora_shapes: dict) -> tuple[PeftAdapter | None, list[str]]:
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
        return None, problems + [f"{weights} is not a readable safetensors file ({_first_line(e)})."]
    modules, weight_problems = _modules(shapes, config, max_lora_rank, lora_shapes)
    problems += weight_problems
    if not modules and not weight_problems:
        problems.append(f"{weights} holds no LoRA weights (lora_A / lora_B).")
    if problems:
        return None, problems
    # Scaled only now: alpha_pattern is known to be valid. PEFT matches it against the names in the adapter's file.
    targets = tuple(LoRATarget(module, rank, _scaling(config, file_module, rank),
                               file_module if file_module != module else None)
                    for module, file_module, rank in modules)  # fmt: skip
    return PeftAdapter(path, targets), []


def _read_config(path: Path) -> tuple[dict | None, list[str]]:
    file = path / ADAPTER_CONFIG
    if not file.is_file():
        return None, [f"{file} is missing: is this a PEFT adapter folder?"]
    try:
        text = file.read_text()
    except OSError as e:
        return None, [f"{file} cannot be read ({e})."]
    try:
        config = json.loads(text)
    except ValueError as e:
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
    if _trains_biases(config):
        problems.append("the adapter trains biases (bias / lora_bias): not supported; train with bias='none'.")
    for name in ("r", "lora_alpha"):
        value = config.get(name, 8)
        if not _is_positive_number(value):
            problems.append(f"{name} is {value!r}: expected a positive number. {_RESAVE}")
    if config.get("use_rslora") not in (None, True, False):
        problems.append(f"use_rslora is {config['use_rslora']!r}: expected true or false. {_RESAVE}")
    problems += _pattern_problems("rank_pattern", config.get("rank_pattern"), "rank")
    problems += _pattern_problems("alpha_pattern", config.get("alpha_pattern"), "lora_alpha")
    return config, problems


_RESAVE = f"Fix it in {ADAPTER_CONFIG}, or save the adapter again with PeftModel.save_pretrained."


def _pattern_problems(name: str, patterns, what: str) -> list[str]:
    """rank_pattern / alpha_pattern: PEFT's mapping of module-name regular expressions to a rank / lora_alpha each."""
    if not patterns:
        return []
    if not isinstance(patterns, dict):
        return [f"{name} is {patterns!r}: expected a mapping of module-name patterns (regular expressions) to a "
                f"{what} each, e.g. {{\"q_proj\": 16}}. {_RESAVE}"]  # fmt: skip
    problems = []
    for pattern, value in patterns.items():
        try:
            re.compile(rf"(.*\.)?({pattern})$")  # as PEFT matches it (peft.utils.other.get_pattern_key)
        except re.error as e:
            problems.append(f"{name} key {pattern!r} is not a valid regular expression ({e}): PEFT matches it "
                            f"against module names. {_RESAVE}")  # fmt: skip
        if not _is_positive_number(value):
            problems.append(f"{name}[{pattern!r}] is {value!r}: expected a positive number (the {what} of the "
                            f"modules it matches). {_RESAVE}")  # fmt: skip
    return problems


def _is_positive_number(value) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value) and value > 0
    except OverflowError:  # an integer past float's range
        return False


def _modules(shapes: dict, config: dict, max_lora_rank: int, lora_shapes: dict) -> tuple[list, list[str]]:
    """The adapter's modules nanoinfer runs, as (model's module name, name in the file, rank), and every problem."""
    modules: dict[str, dict[str, tuple]] = {}  # module in the file -> "A" / "B" -> shape
    foreign: dict[str, list[str]] = {}  # why a weight is not read -> those weights
    saved = _saved_modules(config)
    for key, shape in shapes.items():
        match = _KEY.match(key)
        if match is None:
            if not _is_saved_module(key, saved):  # a module modules_to_save names: the config check said it
                foreign.setdefault(_foreign_weight(key), []).append(key)
            continue
        modules.setdefault(match["module"], {})[match["which"]] = shape
    for why, said in ((_DORA_WEIGHT, config.get("use_dora")), (_BIAS_WEIGHT, _trains_biases(config)),
                      (_SAVED_MODULE, saved)):  # fmt: skip
        if said:  # the config check already said it: one problem, not two
            foreign.pop(why, None)
    problems = [f"{_some(keys)}: {why}" for why, keys in foreign.items()]
    base = config.get("base_model_name_or_path") or "another model"
    found, unknown, too_wide, mismatched, malformed = [], [], [], [], []
    towers: dict[str, list[str]] = {}  # which tower -> its modules the adapter targets
    by_module: dict[str, str] = {}  # the model's module -> its name in the file
    for name, pair in sorted(modules.items()):
        tower = next((_TOWERS[part] for part in name.split(".") if part in _TOWERS), None)
        if tower is not None:
            towers.setdefault(tower, []).append(name)
            continue
        module = _text_module(name)
        if module not in lora_shapes:
            unknown.append(name)
            continue
        if module in by_module:
            problems.append(f"{by_module[module]} and {name} both adapt this model's {module}: an adapter names each "
                            "module once. Save the adapter again with PeftModel.save_pretrained.")  # fmt: skip
            continue
        by_module[module] = name
        if set(pair) != {"A", "B"}:
            problems.append(f"{name} has lora_{'AB'.replace(next(iter(pair)), '')} missing.")
            continue
        if len(pair["A"]) != 2 or len(pair["B"]) != 2 or min(pair["A"] + pair["B"]) < 1:
            malformed.append(f"{name} (lora_A {list(pair['A'])}, lora_B {list(pair['B'])})")
            continue
        (rank, fan_in), (fan_out, rank_b) = pair["A"], pair["B"]
        if rank != rank_b:
            problems.append(f"{name}: lora_A has rank {rank}, lora_B {rank_b}.")
        elif (fan_in, fan_out) != lora_shapes[module]:
            mismatched.append(f"{name} maps {fan_in} -> {fan_out} features, this model's {lora_shapes[module][0]} "
                              f"-> {lora_shapes[module][1]}")  # fmt: skip
        elif rank > max_lora_rank:
            too_wide.append((rank, name))
        else:
            found.append((module, name, rank))
    if malformed:
        problems.append(f"tensors that are no LoRA matrices: {_some(malformed)}. LoRA's lora_A is [rank, in_features] "
                        "and lora_B [out_features, rank], rank 1 or more; save the adapter again with "
                        "PeftModel.save_pretrained.")  # fmt: skip
    if mismatched:
        problems.append(f"the adapter was trained for {base}, not this model: {_some(mismatched)}.")
    if too_wide:
        rank = max(r for r, _ in too_wide)
        problems.append(f"rank {rank}, over max_lora_rank {max_lora_rank} ({_some([m for _, m in too_wide])}): raise "
                        f"max_lora_rank (--max-lora-rank {rank}) or use a smaller adapter.")  # fmt: skip
    if towers and not found and not problems and not unknown:  # the towers' deltas are skipped: text never meets them
        problems.append(f"targets only {', '.join(towers)} ({_some([n for names in towers.values() for n in names])}),"
                        " which nanoinfer does not run (it runs the text model only): train the adapter on the language"
                        " model's modules (e.g. target_modules=r\".*language_model.*\\.(q_proj|v_proj)\").")
    if unknown:
        problems.append(f"targets modules nanoinfer does not adapt in this model: {_some(unknown)}. Supported "
                        f"targets: {SUPPORTED_TARGETS} of the decoder layers.")  # fmt: skip
    return found, problems


def _text_module(name: str) -> str:
    """The text model's name of a module an adapter names (a vision-language checkpoint's language model -> model.)."""
    for prefix in _LANGUAGE_MODEL_PREFIXES:
        if name.startswith(prefix):
            return "model." + name[len(prefix) :]
    return name


def _some(names: list[str], shown: int = 3) -> str:
    """A few names of a list, and how many more."""
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _first_line(error: Exception) -> str:
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _trains_biases(config: dict) -> bool:
    return config.get("bias", "none") != "none" or bool(config.get("lora_bias"))


def _saved_modules(config: dict) -> list[str]:
    """The module names modules_to_save gives (PEFT writes a list; one name is taken too)."""
    saved = config.get("modules_to_save")
    if isinstance(saved, str):
        return [saved]
    return [name for name in saved if isinstance(name, str)] if isinstance(saved, list) else []


def _is_saved_module(key: str, saved: list[str]) -> bool:
    """A weight of a module modules_to_save names (PEFT saves base_model.model.lm_head.weight for "lm_head")."""
    module = key.removeprefix(_PREFIX).rsplit(".", 1)[0]
    return any(module == name or module.endswith("." + name) for name in saved)


def _foreign_weight(key: str) -> str:
    if "lora_magnitude_vector" in key:
        return _DORA_WEIGHT
    if ".base_layer." in key:
        return "a base-model weight saved with the adapter (save_embedding_layers, a trained embedding or LM head): " \
               "not supported; merge the adapter into the model (merge_and_unload) instead."
    if "lora_embedding" in key or "embed_tokens" in key:
        return "an embedding target: nanoinfer adapts linear projections only (q/k/v/o, gate/up/down)."
    if "modules_to_save" in key:
        return _SAVED_MODULE
    if key.endswith(".bias"):
        return _BIAS_WEIGHT
    return f"not a LoRA weight nanoinfer reads (expected {_PREFIX}<module>.lora_A.weight / .lora_B.weight)."


def _scaling(config: dict, module: str, rank: int) -> float:
    """PEFT's scaling of one module (its name in the adapter's file): its lora_alpha (alpha_pattern's first key
    matching the module's name, else lora_alpha) over its rank, or over sqrt(rank) with use_rslora."""
    alpha = config.get("lora_alpha", 8)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            alpha = value
            break
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
