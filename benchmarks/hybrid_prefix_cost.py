"""What running a hybrid model without prefix caching costs on prompts that share a prefix.

nanoinfer switches prefix caching off for models with linear-attention layers (Qwen3-Next, Qwen3.5): a cached
prefix's KV blocks are of no use without the linear layers' state at the prefix's end, which is not kept. So N
prompts sharing a P-token prefix compute N x (P + T) prompt tokens where a cache with state snapshots (vLLM's way)
would compute about P + N x T.

Method: one process, the model's random bfloat16 weights (bench's random_weight_model), greedy, EOS ignored.
  shared:   N prompts = the same P-token prefix + a distinct T-token tail each, as nanoinfer runs them (the prefix
            recomputed for every prompt);
  snapshot: what a prefix cache with state snapshots would leave to compute, approximated by running one full
            prompt (P + T tokens) and N - 1 prompts of their T-token tails alone (a real hit would also attend over
            the cached prefix in the attention layers: a few percent of a layer's work at these lengths).
Each is timed end to end (wall clock, after a warm-up generate), the two alternated for --rounds rounds; the
medians are printed with their ratio.

    python benchmarks/hybrid_prefix_cost.py --model configs/models/qwen3.5-0.8b --num-threads 2
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from nanoinfer import LLM, SamplingParams
from nanoinfer.bench import needs_random_weights, random_weight_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="configs/models/qwen3.5-0.8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prefix", type=int, default=1024, help="shared prefix tokens (P)")
    parser.add_argument("--tail", type=int, default=64, help="distinct tail tokens a prompt (T)")
    parser.add_argument("--output", type=int, default=32, help="generated tokens a prompt")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=0)
    args = parser.parse_args()

    from pathlib import Path

    model = Path(args.model)
    if needs_random_weights(model):
        model = random_weight_model(model, args.dtype)
    llm = LLM(str(model), dtype=args.dtype, max_model_len=args.prefix + args.tail + args.output + 1,
              max_num_seqs=args.num_prompts, num_threads=args.num_threads)  # fmt: skip
    vocab = llm.config.hf_config.vocab_size
    rng = random.Random(0)
    prefix = [rng.randrange(3, vocab) for _ in range(args.prefix)]
    tails = [[rng.randrange(3, vocab) for _ in range(args.tail)] for _ in range(args.num_prompts)]
    shared = [prefix + tail for tail in tails]
    snapshot = [prefix + tails[0], *tails[1:]]
    params = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True)
    llm.generate(shared[:2], params)  # warm-up

    times: dict[str, list[float]] = {"shared": [], "snapshot": []}
    for _ in range(args.rounds):
        for name, prompts in (("shared", shared), ("snapshot", snapshot)):
            start = time.perf_counter()
            llm.generate(prompts, params)
            times[name].append(time.perf_counter() - start)
    shared_s, snapshot_s = (statistics.median(times[name]) for name in ("shared", "snapshot"))
    tokens = {name: sum(len(p) for p in prompts) for name, prompts in (("shared", shared), ("snapshot", snapshot))}
    print(f"prefix caching on: {llm.config.enable_prefix_caching}")
    print(f"{args.num_prompts} prompts, {args.prefix}-token shared prefix + {args.tail}-token tails, "
          f"{args.output} output tokens, {args.dtype}")  # fmt: skip
    for name, seconds in (("shared (as run)", shared_s), ("snapshot (estimate)", snapshot_s)):
        key = name.split()[0]
        print(f"  {name:22s} {tokens[key]:>7,} prompt tokens  {seconds:7.2f} s  (rounds: "
              f"{', '.join(f'{t:.2f}' for t in times[key])})")  # fmt: skip
    print(f"  cost of no prefix cache: {shared_s / snapshot_s:.2f}x the time")


if __name__ == "__main__":
    main()
