"""nanoinfer: offline batch generation for LLMs (a nano-vllm-style engine)."""

from nanoinfer.config import Config
from nanoinfer.errors import NanoInferError

__all__ = ["LLM", "SamplingParams", "Config", "NanoInferError"]
__version__ = "0.1.0"


def __getattr__(name):
    # LLM and SamplingParams import torch; keep `import nanoinfer` light for the CLI's fast paths.
    if name == "LLM":
        from nanoinfer.llm import LLM

        return LLM
    if name == "SamplingParams":
        from nanoinfer.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
