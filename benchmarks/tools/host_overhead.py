"""Host time of one engine step: scheduler, prepare_inputs, sampler and bookkeeping, with the model's forward
replaced by a stub, on a tiny random model on CPU.

On a GPU this time is paid on every step before the device has anything to do (no step overlaps the next),
so it bounds decode speed however fast the kernels are: the H200 bench's 1,019 decode steps averaged
10.5 ms each. Measuring it needs no GPU.

    python benchmarks/tools/host_overhead.py                  # 256 sequences decoding, 60 steps
    python benchmarks/tools/host_overhead.py --num-seqs 64 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import tempfile
import time

import torch

from nanoinfer import LLM, SamplingParams
from nanoinfer.testing.tiny_models import build_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(100, 1000))
    parser.add_argument("--profile", action="store_true", help="cProfile the second half of the steps")
    args = parser.parse_args()

    torch.set_num_threads(1)
    folder = tempfile.mkdtemp(prefix="nanoinfer-host-overhead-")
    path = build_tiny_model("qwen3", folder, num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1,
                            head_dim=32, intermediate_size=128)  # fmt: skip
    llm = LLM(str(path), max_model_len=2048, max_num_seqs=args.num_seqs, max_num_batched_tokens=16384,
              cpu_kvcache_space_gib=2)  # fmt: skip
    runner = llm.engine.model_runner
    hidden_size = llm.config.hf_config.hidden_size
    runner._forward = lambda input_ids, positions, metadata, rows: torch.zeros(len(rows), hidden_size)

    rng = random.Random(0)
    vocab = llm.config.hf_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)  # none finishes while timed
    for _ in range(args.num_seqs):
        llm.add_request([rng.randrange(vocab) for _ in range(rng.randint(*args.prompt_len))], params)
    while llm.step()[1].num_prefill_tokens:  # prompts first: only decode steps are timed
        pass

    profiler = cProfile.Profile()
    times = []
    for i in range(args.steps):
        if args.profile and i == args.steps // 2:
            profiler.enable()
        start = time.perf_counter()
        _, stats = llm.step()
        times.append(time.perf_counter() - start)
    profiler.disable()
    median_ms, min_ms = statistics.median(times) * 1e3, min(times) * 1e3
    print(f"decode steps of {stats.num_decode_tokens} sequences, host only: median {median_ms:.2f} ms, "
          f"min {min_ms:.2f} ms over {len(times)} steps")  # fmt: skip
    if args.profile:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(20)


if __name__ == "__main__":
    main()
