"""LoRARequest: which adapter a request runs with (vLLM's names)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from nanoinfer.errors import LoRAError

MAX_LORA_INT_ID = 2**62 - 1  # ids hash into the prefix cache's 64-bit keys; larger ones are refused


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter for one request.

    lora_name: how records and OpenAI batch lines name it (`body.model`);
    lora_int_id: the adapter's identity in the engine, >= 1 (adapter cache, slots and the prefix cache key on it:
    one id, one adapter);
    lora_path: the PEFT folder (adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise LoRAError(f"LoRARequest's lora_name must be a non-empty string, got {self.lora_name!r}.")
        lora_id = self.lora_int_id
        if not isinstance(lora_id, int) or isinstance(lora_id, bool) or not 1 <= lora_id <= MAX_LORA_INT_ID:
            raise LoRAError(f"LoRARequest {self.lora_name!r}: lora_int_id must be an integer from 1 to 2**62 - 1 (0 "
                            f"is the base model), got {lora_id!r}.")  # fmt: skip
        if not isinstance(self.lora_path, (str, os.PathLike)):
            raise LoRAError(f"LoRARequest {self.lora_name!r}: lora_path must be a folder path, got {self.lora_path!r}.")
        object.__setattr__(self, "lora_path", os.path.abspath(os.path.expanduser(os.fspath(self.lora_path))))


def lora_requests(loras: dict) -> dict[str, LoRARequest]:
    """A job's adapters (Config.loras: name -> folder) as one LoRARequest each, ids 1, 2, ... in the mapping's order
    (every Ray replica and every bench run numbers them alike)."""
    return {name: LoRARequest(name, lora_int_id, path) for lora_int_id, (name, path) in enumerate(loras.items(), 1)}
