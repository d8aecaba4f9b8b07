"""nanoinfer: offline batch generation for LLMs (a nano-vllm-style engine)."""

from nanoinfer.config import Config
from nanoinfer.errors import NanoInferError

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "LoRARequest", "Config", "NanoInferError"]
__version__ = "0.1.0"


def __getattr__(name):
    # LLM and SamplingParams import torch; keep `import nanoinfer` light for the CLI's fast paths.
    if name == "LLM":
        from nanoinfer.llm import LLM

        return LLM
    if name in ("SamplingParams", "StructuredOutputsParams"):
        from nanoinfer import sampling_params

        return getattr(sampling_params, name)
    if name == "LoRARequest":
        from nanoinfer.lora_request import LoRARequest

        return LoRARequest
    raise AttributeError(name)
