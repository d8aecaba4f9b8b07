"""Where W's time goes, by kind of engine step: the prefill, and decode steps by how many tokens they carry.

A W run (64 requests, the built-in model, greedy, speculation as given) is stepped by hand with timers around
the scheduler, input preparation, the forward pass, the LM head and the sampler. Per class of step it prints
how many steps, their mean tokens and the mean milliseconds of each part: what a big decode step costs
against a tail step (one or two sequences left) says whether the run is bound by compute, by the weights'
bytes, or by host work.

    python benchmarks/tools/step_classes.py --dtype bfloat16 --num-speculative-tokens 3
"""

from __future__ import annotations

import argparse
import collections
import time

from nanoinfer import LLM, SamplingParams, bench
from nanoinfer.config import DEFAULT_MODEL
from nanoinfer.model_source import resolve_model

CLASSES = ("prefill", "<16", "<64", "<128", ">=128")


def step_class(num_prefill_tokens: int, num_decode_tokens: int) -> str:
    if num_prefill_tokens:
        return "prefill"
    for bound, name in ((16, "<16"), (64, "<64"), (128, "<128")):
        if num_decode_tokens < bound:
            return name
    return ">=128"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=2)
    args = parser.parse_args()

    workload = bench.make_workload(64, (32, 256), (32, 256), 0, 49152)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in workload.output_lens]
    llm = LLM(str(resolve_model(DEFAULT_MODEL)), dtype=args.dtype, device="cpu", num_threads=args.num_threads,
              num_speculative_tokens=args.num_speculative_tokens)
    runner, scheduler = llm.engine.model_runner, llm.engine.scheduler
    parts: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*a, **kw):
            start = time.perf_counter()
            result = fn(*a, **kw)
            parts[name] = parts.get(name, 0.0) + time.perf_counter() - start
            return result

        return wrapper

    runner._forward = timed("forward", runner._forward)
    runner.model.compute_logits = timed("lm_head", runner.model.compute_logits)
    lm_head = runner.model.lm_head  # greedy float32 rows on AMX skip compute_logits (csrc/greedy_lm_head.cpp)
    lm_head.greedy_token_ids = timed("lm_head", lm_head.greedy_token_ids)
    runner.sampler = timed("sampler", runner.sampler)
    runner.prepare_inputs = timed("prepare", runner.prepare_inputs)
    scheduler.schedule = timed("schedule", scheduler.schedule)
    scheduler.update = timed("update", scheduler.update)

    llm.generate([[0] * 16], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    for prompt, p in zip(workload.prompt_token_ids, params):
        llm.add_request(prompt, p)
    totals = collections.defaultdict(lambda: collections.defaultdict(float))
    counts = collections.Counter()
    start = time.perf_counter()
    while llm.has_unfinished_requests():
        parts.clear()
        t = time.perf_counter()
        _, stats = llm.step()
        name = step_class(stats.num_prefill_tokens, stats.num_decode_tokens)
        counts[name] += 1
        for part, seconds in parts.items():
            totals[name][part] += seconds
        totals[name]["step"] += time.perf_counter() - t
        totals[name]["tokens"] += stats.num_decode_tokens + stats.num_prefill_tokens
    wall = time.perf_counter() - start
    print(f"W, {args.dtype}, k = {args.num_speculative_tokens}: {wall:.2f} s, "
          f"{sum(workload.output_lens) / wall:.1f} output tok/s, {sum(counts.values())} steps")
    for name in CLASSES:
        n = counts[name]
        if not n:
            continue
        t = totals[name]
        means = " ".join(f"{part} {t[part] / n * 1e3:.1f}" for part in
                         ("schedule", "prepare", "forward", "lm_head", "sampler", "update", "step"))
        print(f"{name:8s} {n:4d} steps, {t['tokens'] / n:7.1f} tokens, {t['step']:6.2f} s; ms a step: {means}")


if __name__ == "__main__":
    main()
