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
# sentence-transformers' 1_Pooling/config.json switches -> our names; the others (max, weighted mean, ...) are refused
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


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


def read_sentence_transformers_pooling(model_dir: str | Path) -> tuple[str, bool] | None:
    """(pooling_type, normalize) from a sentence-transformers folder, or None when the folder is not one.

    Raises:
        ConfigError: the folder asks for what nanoinfer cannot do (a Dense layer, max pooling, ...).
    """
    root = Path(model_dir)
    modules_path = root / "modules.json"
    if not modules_path.is_file():
        return None

    def problem(message: str) -> ConfigError:
        return ConfigError([ConfigProblem("pooling_type", str(modules_path), message)])

    try:
        modules = json.loads(modules_path.read_text())
        types = [m["type"] for m in modules]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise problem(f"cannot be read as sentence-transformers' module list ({e}). Fix the file, or set "
                      "--pooling and --normalize and remove it.") from None
    unknown = [t for t in types if t not in (_ST_TRANSFORMER, _ST_POOLING, _ST_NORMALIZE)]
    if unknown:
        raise problem(f"has the module {unknown[0]}, which nanoinfer does not run (it runs Transformer, Pooling and "
                      "Normalize). Use a model without it.")
    if _ST_POOLING not in types:
        return None
    pooling = next(m for m in modules if m["type"] == _ST_POOLING)
    config_path = root / pooling.get("path", "1_Pooling") / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise problem(f"names the pooling config {config_path}, which cannot be read ({e}).") from None
    modes = [name for key, name in _ST_MODES.items() if config.get(key)]
    others = [k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in _ST_MODES]
    if others or len(modes) != 1:
        chosen = ", ".join(others + [k for k, v in config.items() if k in _ST_MODES and v]) or "none"
        raise problem(f"pools by {chosen}; nanoinfer pools by exactly one of last token, mean or cls. Set --pooling "
                      "to one of them and remove the sentence-transformers files, or use another model.")
    if config.get("include_prompt") is False:
        raise problem("excludes the prompt from pooling (include_prompt: false), which nanoinfer does not do.")
    return modes[0], _ST_NORMALIZE in types


class Pooler:
    """One pooled vector a sequence, fed the rows of its prompt a chunk at a time.

    `last` keeps the last row, `cls` the first, `mean` a float32 running sum; finish() gives the vector."""

    def __init__(self, pooling_type: str, normalize: bool):
        self.pooling_type = pooling_type
        self.normalize = normalize

    def first_needed_position(self, num_prompt_tokens: int) -> int:
        """The first prompt position whose hidden state the vector needs: the prefix cache serves those before."""
        return num_prompt_tokens - 1 if self.pooling_type == "last" else 0

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
