"""What n-gram (prompt lookup) speculative decoding saves on workload W, in steps and rows, without timing.

Written before speculation was built (stop 20) to decide whether to build it; it now takes its proposals
from the engine's own NgramProposer. Generates W greedily with nanoinfer (the outputs speculation must
reproduce), then replays each sequence as the proposer sees it: at every step, the continuation of the
latest earlier match of the sequence's last n tokens (n from --max-n down to --min-n) is proposed, up to k
tokens and up to what a step's row budget leaves (`--row-cap`: decode rows plus proposed tokens, the
GEMM's rows a step); the target model accepts the proposed tokens up to the first that differs from its
own greedy token, plus one token of its own. Prints, for each k: engine steps (every step streams all
weights once), sequence-steps (every one reads the sequence's whole KV once), rows computed, and accepted
tokens per sequence-step.

    python benchmarks/tools/ngram_speculation_sim.py --dtype bfloat16

No timing here: the numbers are what a cost model needs (weights a step, K/V a sequence-step, compute a
row), so they hold on any machine. Greedy outputs of a small model on random prompts loop a lot; real
prompts repeat less, so treat the result as an upper bound for W-like jobs.
"""

from __future__ import annotations

import argparse

from nanoinfer import LLM, SamplingParams, bench
from nanoinfer.config import DEFAULT_MODEL
from nanoinfer.engine.ngram_proposer import NgramProposer
from nanoinfer.model_source import resolve_model


class _Tokens:
    """What NgramProposer reads of a sequence: its token ids and its n-gram index."""

    def __init__(self, token_ids: list[int]):
        self.token_ids = token_ids
        self.ngram_index = None


def replay(prompts: list[list[int]], outputs: list[list[int]], k: int, max_n: int, min_n: int, row_cap: int) -> dict:
    """Steps, sequence-steps and rows of continuous batching with up to k proposed tokens a sequence."""
    seqs = [{"tokens": _Tokens(list(p)), "out": o, "done": 0} for p, o in zip(prompts, outputs)]
    proposer = NgramProposer(k, min_n, max_n)
    steps = seq_steps = rows = 0
    while True:
        active = [s for s in seqs if s["done"] < len(s["out"])]
        if not active:
            break
        budget = row_cap - len(active)
        for s in active:
            remaining = len(s["out"]) - s["done"] - 1  # never propose past the requested length
            draft = proposer.propose(s["tokens"], min(remaining, max(budget, 0))) if k else []
            budget -= len(draft)
            accepted = 0
            while accepted < len(draft) and draft[accepted] == s["out"][s["done"] + accepted]:
                accepted += 1
            new = s["out"][s["done"] : s["done"] + accepted + 1]
            s["tokens"].token_ids += new
            s["done"] += len(new)
            rows += 1 + len(draft)
        steps += 1
        seq_steps += len(active)
    return {"steps": steps, "seq_steps": seq_steps, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-n", type=int, default=3)
    parser.add_argument("--min-n", type=int, default=1)
    parser.add_argument("--row-cap", type=int, default=128, help="rows a step may compute (decode + proposed)")
    parser.add_argument("--k", type=int, nargs="+", default=[0, 2, 4, 8])
    args = parser.parse_args()

    workload = bench.make_workload(args.num_requests, (32, 256), (32, 256), 0, 49152)
    llm = LLM(str(resolve_model(DEFAULT_MODEL)), dtype=args.dtype, device="cpu")
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    outputs = [list(o.outputs[0].token_ids) for o in llm.generate(workload.prompt_token_ids, params)]
    total = sum(map(len, outputs))
    print(f"W ({args.num_requests} requests, {args.dtype} greedy): {total} output tokens; "
          f"n-grams {args.max_n}..{args.min_n}, row cap {args.row_cap}")
    print(f"{'k':>3} {'steps':>6} {'seq-steps':>10} {'rows':>7} {'tokens/seq-step':>16}")
    for k in args.k:
        r = replay(workload.prompt_token_ids, outputs, k, args.max_n, args.min_n, args.row_cap)
        print(f"{k:>3} {r['steps']:>6} {r['seq_steps']:>10} {r['rows']:>7} {total / r['seq_steps']:>16.2f}")


if __name__ == "__main__":
    main()
