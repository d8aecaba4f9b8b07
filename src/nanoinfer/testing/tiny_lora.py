"""Random PEFT LoRA adapters for a tiny model (tests and benchmarks), saved by PEFT itself."""

from __future__ import annotations

from pathlib import Path


def build_tiny_adapter(model_dir: str | Path, path: str | Path, *, rank: int = 8, lora_alpha: float = 16,
                       target_modules: tuple[str, ...] | str = ("q_proj", "v_proj"), use_rslora: bool = False,
                       std: float = 0.2, seed: int = 0, **config) -> Path:  # fmt: skip
    """A LoRA adapter of `model_dir`'s model with random A and B (std `std`: large enough that its outputs differ
    from the base model's), saved with PeftModel.save_pretrained to `path`. `config`: more LoraConfig fields. The
    base model is built from its config.json alone (an adapter holds A and B only; a GGUF folder works too)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    model.config.name_or_path = str(model_dir)  # the adapter's base_model_name_or_path
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)  # a str: PEFT's regex
    lora = LoraConfig(r=rank, lora_alpha=lora_alpha, target_modules=targets, use_rslora=use_rslora,
                      init_lora_weights=False, **config)  # fmt: skip
    peft_model = get_peft_model(model, lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    peft_model.save_pretrained(path, safe_serialization=True)
    return Path(path)


def peft_greedy(model_dir: str | Path, adapter_dir: str | Path | None, prompts: list[list[int]], num_tokens: int,
                device: str = "cpu") -> list[list[int]]:  # fmt: skip
    """transformers (+ PEFT with the adapter; None: the base model) greedy tokens of each prompt, one at a time (no
    padding), float32: the argmax of each step's logits, as ignore_eos generates (generate()'s min_new_tokens would
    also forbid EOS, which ignore_eos may pick)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model = model.to(device).eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            out = model(torch.tensor([prompt], device=device), use_cache=True)
            token_ids = [int(out.logits[0, -1].argmax())]
            while len(token_ids) < num_tokens:
                out = model(torch.tensor([token_ids[-1:]], device=device), past_key_values=out.past_key_values,
                            use_cache=True)  # fmt: skip
                token_ids.append(int(out.logits[0, -1].argmax()))
            outs.append(token_ids)
    return outs
