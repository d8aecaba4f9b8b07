"""Hugging Face transformers as the reference implementation: greedy decoding with its own model classes."""

from __future__ import annotations

import torch


def hf_model(model_dir, dtype: torch.dtype = torch.float32, config=None):
    """transformers' model class on the folder's weights: its safetensors, or its GGUF through transformers' own
    GGUF loader (dequantized by the gguf package, as nanoinfer's; `config` for what its metadata cannot say)."""
    from pathlib import Path

    import transformers

    folder = Path(model_dir)
    ggufs = sorted(folder.glob("*.gguf")) if not any(folder.glob("*.safetensors")) else []
    kwargs = {"gguf_file": ggufs[0].name} if ggufs else {}
    if config is not None:
        kwargs["config"] = config
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, **kwargs).eval()


def hf_greedy(model_dir, prompts: list[list[int]], num_tokens: int, dtype: torch.dtype = torch.float32, top_k: int = 0,
              config=None) -> tuple[list[list[int]], list[torch.Tensor]] | tuple[list[list[int]], list, list]:
    """transformers' own greedy decode, one prompt at a time (no padding), EOS ignored.
    Returns the generated ids and each prompt's first-step logits; with top_k > 0 also, per prompt, the
    set of the top_k token ids at every step (for check_logprobs_close)."""
    model = hf_model(model_dir, dtype, config)
    outputs, first_logits, top_sets = [], [], []
    with torch.inference_mode():
        for prompt in prompts:
            out = model(torch.tensor([prompt]), use_cache=True)
            first_logits.append(out.logits[0, -1].float())
            past = out.past_key_values
            token = int(out.logits[0, -1].argmax())
            generated, tops = [token], [set(out.logits[0, -1].topk(top_k).indices.tolist())] if top_k else []
            for _ in range(num_tokens - 1):
                out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                token = int(out.logits[0, -1].argmax())
                generated.append(token)
                if top_k:
                    tops.append(set(out.logits[0, -1].topk(top_k).indices.tolist()))
            outputs.append(generated)
            top_sets.append(tops)
    return (outputs, first_logits, top_sets) if top_k else (outputs, first_logits)


def check_logprobs_close(ours: list[tuple[list[int], list[set[int]]]], theirs: list[tuple[list[int], list[set[int]]]],
                         names: tuple[str, str]) -> int:  # fmt: skip
    """vLLM's rule for low-precision runs: walk each sequence to its first differing token; there each side's
    token must be among the other side's top-k, and the comparison of that sequence stops (after a different
    token the two continue from different contexts). Returns how many sequences diverged."""
    num_diverged = 0
    for i, ((ids_0, top_0), (ids_1, top_1)) in enumerate(zip(ours, theirs, strict=True)):
        for pos, (id_0, id_1) in enumerate(zip(ids_0, ids_1, strict=True)):
            if id_0 == id_1:
                continue
            assert id_0 in top_1[pos], (
                f"prompt {i}, token {pos}: {names[0]} chose {id_0}, not in {names[1]}'s top-k {sorted(top_1[pos])}"
            )
            assert id_1 in top_0[pos], (
                f"prompt {i}, token {pos}: {names[1]} chose {id_1}, not in {names[0]}'s top-k {sorted(top_0[pos])}"
            )
            num_diverged += 1
            break
    return num_diverged


def hf_greedy_logprobs(model_dir, prompts: list[list[int]], num_tokens: int,
                       dtype: torch.dtype = torch.float32) -> tuple[list[list[int]], list[list[float]]]:  # fmt: skip
    """transformers' greedy decode (as hf_greedy) with the log-probability of each chosen token."""
    model = hf_model(model_dir, dtype)
    tokens, logprobs = [], []
    with torch.inference_mode():
        for prompt in prompts:
            out = model(torch.tensor([prompt]), use_cache=True)
            generated, chosen = [], []
            for step in range(num_tokens):
                logits = out.logits[0, -1].float()
                token = int(logits.argmax())
                generated.append(token)
                chosen.append(float(torch.log_softmax(logits, dim=-1)[token]))
                if step + 1 < num_tokens:
                    out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
            tokens.append(generated)
            logprobs.append(chosen)
    return tokens, logprobs
