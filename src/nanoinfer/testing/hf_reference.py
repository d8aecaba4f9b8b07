"""Hugging Face transformers as the reference implementation: greedy decoding with its own model classes."""

from __future__ import annotations

import torch


def hf_greedy(model_dir, prompts: list[list[int]], num_tokens: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """transformers' own greedy decode, one prompt at a time (no padding), EOS ignored.
    Returns the generated ids and each prompt's first-step logits."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs, first_logits = [], []
    with torch.inference_mode():
        for prompt in prompts:
            out = model(torch.tensor([prompt]), use_cache=True)
            first_logits.append(out.logits[0, -1].float())
            past = out.past_key_values
            token = int(out.logits[0, -1].argmax())
            generated = [token]
            for _ in range(num_tokens - 1):
                out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                token = int(out.logits[0, -1].argmax())
                generated.append(token)
            outputs.append(generated)
    return outputs, first_logits
