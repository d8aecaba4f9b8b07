"""Embeddings: how a prompt's final hidden states become one vector (vLLM's pooling runner).

PoolingParams are the per-request knobs; `pooling_type` and `normalize` are the job's (Config), read from a
sentence-transformers folder (modules.json, 1_Pooling/config.json, a Normalize module) when the model has one,
as vLLM and sentence-transformers do. Pooler accumulates a sequence's rows chunk by chunk, so chunked prefill
and preemption give the vector the whole prompt would.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from nanoinfer.errors import ConfigError, ConfigProblem, RequestError
from nanoinfer.errors import short_repr as _show

POOLING_TYPES = ("last", "mean", "cls")
# sentence-transformers' pooling modes -> our names: 1_Pooling/config.json's `pooling_mode` (v6) or its
# pooling_mode_* switches (before); the others (max, weighted mean, ...) are refused
_ST_MODES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
_ST_SWITCHES = {f"pooling_mode_{name}": ours for name, ours in
                (("lasttoken", "last"), ("mean_tokens", "mean"), ("cls_token", "cls"))}  # fmt: skip
# The module classes nanoinfer runs, by class name: their import paths moved in sentence-transformers 6
_ST_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass
class PoolingParams:
    """How to embed one request (vLLM's names).

    Args:
        normalize: L2-normalize the vector (None: the job's setting).
        dimensions: keep the first this many dimensions (Matryoshka models; OpenAI's `dimensions`), before
            normalizing; None keeps all.
    """

    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self):
        problems = []
        if self.normalize is not None and not isinstance(self.normalize, bool):
            problems.append(f"normalize must be true or false, got {_show(self.normalize)}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            problems.append(f"dimensions must be a positive integer, got {_show(self.dimensions)}")
        if problems:
            raise RequestError("invalid pooling parameters: " + "; ".join(problems), code="invalid_pooling_params")


@dataclass
class SentenceTransformersFolder:
    """What a sentence-transformers folder says about embedding with it."""

    pooling_type: str | None  # None: a pooling nanoinfer does not do (max, weighted mean, several): `modes` says
    normalize: bool
    # sentence-transformers 6 renders plain text through the tokenizer's chat template, as a user message, when
    # the Transformer module's modality_config has a "message" modality (what it saves for a model with a template)
    renders_messages: bool = False
    modes: str = ""  # the folder's own pooling mode names


def read_sentence_transformers_folder(model_dir: str | Path) -> SentenceTransformersFolder | None:
    """The folder's sentence-transformers configuration (modules.json and the modules' configs, old or v6 layout),
    or None when it is not a sentence-transformers folder (or has no Pooling module).

    Raises:
        ConfigError: the folder asks for what nanoinfer cannot do (a Dense layer, max pooling, ...).
    """
    root = Path(model_dir)
    modules_path = root / "modules.json"
    if not modules_path.is_file():
        return None

    def problem(message: str) -> ConfigError:
        return ConfigError([ConfigProblem("pooling_type", str(modules_path), message)])

    def read(path: Path) -> dict:
        try:
            value = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise problem(f"names {path}, which cannot be read as JSON ({e}).") from None
        return value if isinstance(value, dict) else {}

    try:
        modules = {m["type"].rpartition(".")[2]: m for m in json.loads(modules_path.read_text())}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise problem(f"cannot be read as sentence-transformers' module list ({e}). Fix the file, or set "
                      "--pooling and --normalize and remove it.") from None
    unknown = [name for name in modules if name not in _ST_MODULES]
    if unknown:
        raise problem(f"has the module {unknown[0]}, which nanoinfer does not run (it runs Transformer, Pooling and "
                      "Normalize). Use a model without it.")
    if "Pooling" not in modules:
        return None
    config = read(root / modules["Pooling"].get("path", "1_Pooling") / "config.json")
    mode = config.get("pooling_mode")
    if mode is not None:  # v6: one name, or a list of them
        modes = [mode] if isinstance(mode, str) else list(mode) if isinstance(mode, list) else [repr(mode)]
    else:
        modes = [k.removeprefix("pooling_mode_") for k, v in config.items() if k.startswith("pooling_mode_") and v]
    ours = [_ST_MODES.get(m) or _ST_SWITCHES.get(f"pooling_mode_{m}") for m in modes]
    if config.get("include_prompt") is False:
        raise problem("excludes the prompt from pooling (include_prompt: false), which nanoinfer does not do.")
    transformer_path = root / (modules["Transformer"].get("path") or "") if "Transformer" in modules else root
    bert_config = transformer_path / "sentence_bert_config.json"
    modalities = read(bert_config).get("modality_config") if bert_config.is_file() else None
    return SentenceTransformersFolder(ours[0] if len(ours) == 1 else None, "Normalize" in modules,
                                      isinstance(modalities, dict) and "message" in modalities,
                                      ", ".join(map(str, modes)) or "nothing")


def first_pooled_position(pooling_type: str, num_prompt_tokens: int) -> int:
    """The first prompt position whose hidden state a vector needs: the prefix cache serves those before it."""
    return num_prompt_tokens - 1 if pooling_type == "last" else 0


class Pooler:
    """One pooled vector a sequence, fed the rows of its prompt a chunk at a time.

    `last` keeps the last row, `cls` the first, `mean` a float32 running sum; finish() gives the vector."""

    def __init__(self, pooling_type: str, normalize: bool):
        self.pooling_type = pooling_type
        self.normalize = normalize

    def rows_needed(self, start: int, end: int, num_prompt_tokens: int) -> tuple[int, int]:
        """The positions in [start, end) whose hidden states the vector needs, as a range (empty when none)."""
        if self.pooling_type == "cls":
            return start, min(end, 1)
        return max(start, first_pooled_position(self.pooling_type, num_prompt_tokens)), end

    def add(self, seq, hidden_states: torch.Tensor, start: int) -> None:
        """Rows for positions start .. start + len(hidden_states) - 1 of `seq`'s prompt."""
        if self.pooling_type == "mean":
            rows = hidden_states.float().sum(dim=0)
            seq.pooled = rows if seq.pooled is None or start == 0 else seq.pooled + rows
        elif self.pooling_type == "cls":
            if start == 0:
                seq.pooled = hidden_states[0].float()
        else:
            seq.pooled = hidden_states[-1].float()

    def finish(self, seq, params: PoolingParams) -> list[float]:
        vector = seq.pooled
        if self.pooling_type == "mean":
            vector = vector / seq.num_prompt_tokens
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        normalize = self.normalize if params.normalize is None else params.normalize
        if normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector.cpu().tolist()
