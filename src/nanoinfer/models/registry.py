"""Which family class runs a checkpoint: HF `architectures` (config.json), falling back to `model_type`, and GGUF
`general.architecture`; each family module is imported only when asked for.

Adding a family: one file in models/, one line in _MODELS (and _GGUF where llama.cpp writes it), see
docs/adding-a-model.md.
"""

from __future__ import annotations

import importlib

# HF architecture -> (module in nanoinfer.models, class, HF model_type)
_MODELS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM", "llama"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM", "mistral"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM", "qwen2"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM", "qwen3"),
    "GemmaForCausalLM": ("gemma", "GemmaForCausalLM", "gemma"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM", "gemma2"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM", "gemma3_text"),
    "Gemma3ForConditionalGeneration": ("gemma3", "Gemma3ForConditionalGeneration", "gemma3"),
    "Gemma4ForCausalLM": ("gemma4", "Gemma4ForCausalLM", "gemma4_text"),
    "Gemma4ForConditionalGeneration": ("gemma4", "Gemma4ForConditionalGeneration", "gemma4"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM", "phi3"),
    "SmolLM3ForCausalLM": ("smollm3", "SmolLM3ForCausalLM", "smollm3"),
    "Olmo2ForCausalLM": ("olmo2", "Olmo2ForCausalLM", "olmo2"),
    "Olmo3ForCausalLM": ("olmo3", "Olmo3ForCausalLM", "olmo3"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM", "mixtral"),
    # gpt-oss entry
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM", "gpt_oss"),
    "Qwen3NextForCausalLM": ("qwen3_next", "Qwen3NextForCausalLM", "qwen3_next"),
    "Qwen3_5ForCausalLM": ("qwen3_5", "Qwen3_5ForCausalLM", "qwen3_5_text"),
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", "Qwen3_5ForConditionalGeneration", "qwen3_5"),
    "Qwen3_5MoeForCausalLM": ("qwen3_5", "Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5", "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe"),
}
# GGUF general.architecture -> HF architecture
_GGUF = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    # gemma GGUF entries
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",  # the text model; llama.cpp puts a vision tower in a separate mmproj file
    # phi3 / olmo2 GGUF entries
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
}
# GGUF general.architecture -> HF architecture, for files with experts (expert_count > 0): llama.cpp's converter
# writes Mixtral as a llama with experts
_GGUF_WITH_EXPERTS = {"llama": "MixtralForCausalLM"}


def supported_architectures() -> list[str]:
    return list(_MODELS)


def supported_gguf_architectures() -> list[str]:
    return list(_GGUF)


def architecture_of(hf_config) -> str | None:
    """The registry's architecture for a config: its first listed architecture we run, else its model_type's."""
    for name in getattr(hf_config, "architectures", None) or []:
        if name in _MODELS:
            return name
    model_type = getattr(hf_config, "model_type", None)
    return next((name for name, entry in _MODELS.items() if entry[2] == model_type), None)


def is_base_checkpoint(hf_config) -> bool:
    """A base model's checkpoint (e.g. `Qwen3Model`, as many embedding models publish): the decoder without its LM
    head, its tensors named without the `model.` prefix. It runs as its family's causal LM for embeddings."""
    names = getattr(hf_config, "architectures", None) or []
    return not any(name in _MODELS for name in names) and any(
        name.endswith("Model") and name.removesuffix("Model") + "ForCausalLM" in _MODELS for name in names
    )


def describe_unsupported(hf_config) -> str:
    """What a config names that nanoinfer does not run, for an error message."""
    names = getattr(hf_config, "architectures", None) or []
    model_type = getattr(hf_config, "model_type", None)
    return f"architectures {names}, model_type {model_type!r}" if names else f"model_type {model_type!r}"


def text_config(hf_config):
    """(the config nanoinfer runs, a note or None): a vision-language checkpoint's text part (its family's
    `text_config`, which says what it left out), else the config itself."""
    architecture = architecture_of(hf_config)
    split = getattr(model_class(architecture), "text_config", None) if architecture else None
    return split(hf_config) if split is not None else (hf_config, None)


def model_class(architecture: str) -> type:
    module, cls, _ = _MODELS[architecture]
    return getattr(importlib.import_module(f"nanoinfer.models.{module}"), cls)


def gguf_architecture(general_architecture: str, has_experts: bool = False) -> str | None:
    """The HF architecture that runs a GGUF file's general.architecture (`has_experts`: its metadata's
    expert_count > 0), or None."""
    if has_experts and general_architecture in _GGUF_WITH_EXPERTS:
        return _GGUF_WITH_EXPERTS[general_architecture]
    return _GGUF.get(general_architecture)


def model_type_of(architecture: str) -> str:
    return _MODELS[architecture][2]


def build_model(hf_config, backend, max_position: int, dtype=None):
    """The family's model for a config (its architecture must be supported: Config checks it), its parameters made
    in `dtype` (torch's default dtype while it is built; None: float32). Made in the run's dtype, not converted
    after loading: a bfloat16 mixture of experts would otherwise need twice its size in RAM first. Tables a
    family computes at build time (rotary) name their dtype and do not follow the default."""
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype or torch.float32)
    try:
        model = model_class(architecture_of(hf_config))(hf_config, backend, max_position)
    finally:
        torch.set_default_dtype(previous)
    model.is_base_checkpoint = is_base_checkpoint(hf_config)  # its tensors lack the `model.` prefix
    return model


def model_spec(hf_config):
    """The ModelSpec of a config's model: built on the meta device (no memory, no weights) with one rank and the
    plain-torch platform, and read off its layers."""
    import torch

    from nanoinfer.platforms import plain_platform

    architecture = architecture_of(hf_config)
    with plain_platform(), torch.device("meta"):
        model = model_class(architecture)(hf_config, None, max_position=1)
    return model.describe(architecture)


def checked_model_spec(hf_config):
    """(ModelSpec, None) for a config nanoinfer runs, else (None, what is wrong and what to do), for Config and
    plan-memory to report: an architecture the registry lacks, or a config its family cannot build from."""
    architecture = architecture_of(hf_config)
    if architecture is None:
        return None, (f"its architecture ({describe_unsupported(hf_config)}) is not supported. nanoinfer runs "
                      f"{', '.join(supported_architectures())}; use a model of one of these architectures.")
    try:
        return model_spec(hf_config), None
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        return None, (f"its config.json does not describe a {architecture} that nanoinfer can build "
                      f"({type(e).__name__}: {e}). Check the config against the model's original one.")
