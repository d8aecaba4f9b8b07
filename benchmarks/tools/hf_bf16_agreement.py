"""Greedy agreement of nanoinfer in bfloat16 with Hugging Face transformers in bfloat16 on the default model.

16 prompts of random token ids (32..256 tokens, seed 0), 64 greedy tokens each, ignore_eos; nanoinfer with
n-gram speculation (k = 3, as W is benchmarked). Prints how many prompts' outputs are identical and where the
others first differ. bfloat16 is not expected to match token for token (float32 is, and is tested); this is
the figure issue 8 asks to report.

    python benchmarks/tools/hf_bf16_agreement.py
"""

from __future__ import annotations

import random

import torch

from nanoinfer.llm import LLM
from nanoinfer.model_source import ensure_default_model
from nanoinfer.sampling_params import SamplingParams
from nanoinfer.testing.hf_reference import hf_model


def main() -> None:
    torch.set_num_threads(2)
    rng = random.Random(0)
    prompts = [[rng.randrange(49152) for _ in range(rng.randint(32, 256))] for _ in range(16)]
    llm = LLM(model="smollm2-135m-instruct", dtype="bfloat16", num_speculative_tokens=3)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=64))
    hf = hf_model(ensure_default_model(), torch.bfloat16)
    identical, first_differences = 0, []
    for prompt, output in zip(prompts, outputs):
        ours = list(output.outputs[0].token_ids)
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False)
        theirs = ids[0, len(prompt) :].tolist()
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if first is None:
            identical += 1
        else:
            first_differences.append(first)
    print(f"{identical} / {len(prompts)} identical over 64 tokens; first differences at {sorted(first_differences)}")


if __name__ == "__main__":
    main()
