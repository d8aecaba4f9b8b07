"""Config: the seed's dataclass (nano-vllm's config.py) plus the fields nanoinfer needs.

Every user-facing settings check lives here and reports all problems at once (ConfigError). The seed's
placeholders (hf_config, eos, max_model_len clamping) are filled in by `__post_init__`, and each change is
recorded in `notes` so `check-config` can show what was filled in and from where.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nanoinfer.errors import ConfigError, ConfigProblem

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(slots=True)
class Config:
    """Engine settings. Field names and defaults of the first eleven are the seed's (nano-vllm).

    Args:
        model: a local Hugging Face folder, the built-in default `smollm2-135m-instruct`, or a hub repo id.
        max_num_batched_tokens: most tokens in one forward pass, summed over the scheduled sequences.
        max_num_seqs: most sequences in one forward pass.
        max_model_len: most tokens (prompt + output) in one sequence; clamped to max_position_embeddings.
        gpu_memory_utilization: fraction of device memory the engine may use in all (CUDA).
        tensor_parallel_size: processes the weights are sharded over (1..8).
        enforce_eager: True disables CUDA graphs for decode.
        hf_config: loaded from `model/config.json`; never passed by hand.
        eos: placeholder; filled from the tokenizer.
        kvcache_block_size: tokens per KV-cache block, a multiple of 256.
        num_kvcache_blocks: total KV blocks; -1 sizes the cache from memory.
        device: auto | cpu | cuda.
        dtype: auto | float32 | bfloat16 | float16 (auto: bfloat16 on CUDA, float32 on CPU).
        attention_backend: auto | torch | triton | flash-attn.
        seed: global seed for sampling when a request gives none.
        cpu_kvcache_space_gib: KV-cache memory budget on CPU, in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE).
        enable_prefix_caching: reuse KV blocks of identical prompt prefixes.
        num_threads: torch intra-op threads on CPU; 0 means one per physical core.
        trust_remote_code: never turned on by nanoinfer itself; only for tokenizers that need it.
    """

    model: str = DEFAULT_MODEL
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    hf_config: Any = None
    eos: int = -1
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1
    # nanoinfer's own fields
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"
    seed: int = 0
    cpu_kvcache_space_gib: float = 4.0
    enable_prefix_caching: bool = True
    num_threads: int = 0
    trust_remote_code: bool = False
    # What __post_init__ filled in or clamped: (field, value, reason). Not a user setting.
    notes: list = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self):
        from nanoinfer.model_source import resolve_model

        problems: list[ConfigProblem] = []
        model_dir = None
        try:
            model_dir = resolve_model(self.model)
        except ConfigError as e:
            problems += e.problems
        if model_dir is not None:
            if str(model_dir) != self.model:
                self.notes.append(("model", str(model_dir), f"resolved from {self.model!r}"))
            self.model = str(model_dir)
            from transformers import AutoConfig

            self.hf_config = AutoConfig.from_pretrained(self.model)
            max_pos = getattr(self.hf_config, "max_position_embeddings", None)
            if max_pos is not None and self.max_model_len > max_pos:
                self.notes.append(
                    ("max_model_len", max_pos, f"clamped from {self.max_model_len} to the model's max_position_embeddings")
                )
                self.max_model_len = max_pos
        if self.device == "auto":
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
            self.notes.append(("device", self.device, "auto-detected"))
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.device == "cuda" else "float32"
            self.notes.append(("dtype", self.dtype, f"auto for {self.device}"))
        if problems:
            raise ConfigError(problems)

    def to_dict(self) -> dict:
        """User-settable fields and their resolved values (hf_config and notes left out)."""
        return {f: getattr(self, f) for f in user_fields()}


def user_fields() -> list[str]:
    return [f for f in Config.__dataclass_fields__ if f not in ("hf_config", "notes")]
