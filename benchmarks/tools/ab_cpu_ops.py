"""A/B two builds of nanoinfer's CPU kernels in one process, alternating, best of N.

This VM's speed drifts by 10-20% between runs (the same W run gave 118 and 144 tok/s ten minutes apart),
so a kernel change worth a few percent cannot be shown by two separate `nanoinfer bench` runs. Here both
builds are loaded side by side (torch's extension cache keeps every build, named by a digest of its
sources) and take turns on the same inputs:

- gemm: a decode step's linears (SmolLM2's four shapes) for 30 layers' distinct weights, at 16/32/64 rows
  (`--rows`);
- decode: whole engine decode steps on the default model (64 sequences, 150-250-token prompts);
- attention: paged decode attention alone, 30 layers' caches, `--batch` sequences x `--run-rows` rows.

Usage (build names as in ~/.cache/torch_extensions/<py>_cpu/; `python -c "from nanoinfer.platforms.cpu.ops import
cpu_ops; print(cpu_ops())"` prints the current one, and `git stash` + the same line builds the old one):

    python benchmarks/tools/ab_cpu_ops.py nanoinfer_cpu_ops_<old> nanoinfer_cpu_ops_<new> --what gemm
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import time

import torch


def load_build(name: str):
    from nanoinfer.platforms.cpu.ops import _build_dir

    path = _build_dir(name) / f"{name}.so"
    if not path.is_file():
        raise SystemExit(f"no build {path}: build it first (see this script's docstring)")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def turns(builds: dict, rep: int) -> list:
    """The builds in the order they take turn `rep`: reversed every other turn. In a fixed order the build that
    went first measured up to ~3% faster (stop 31: the same two builds, bfloat16 decode attention, 23.2 vs
    24.1 ms one way round, 23.3 vs 23.8 the other)."""
    items = list(builds.items())
    return items if rep % 2 == 0 else items[::-1]


def ab_gemm(builds: dict, reps: int, row_counts: list[int]) -> None:
    shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (K, N): qkv, o, gate_up, down
    first = next(iter(builds.values()))
    layers = [[first.pack_linear_weight(torch.randn(n, k) * 0.02) for k, n in shapes] for _ in range(30)]
    for rows in row_counts:
        x = {k: torch.randn(rows, k) for k, _ in shapes}
        flops = 2 * rows * sum(k * n for k, n in shapes) * len(layers)
        best = dict.fromkeys(builds, float("inf"))
        for rep in range(reps):
            for name, ops in turns(builds, rep):
                start = time.perf_counter()
                for weights in layers:
                    for (k, n), w in zip(shapes, weights):
                        ops.packed_linear(x[k], w, None, n)
                best[name] = min(best[name], time.perf_counter() - start)
        print(f"{rows:3d} rows  " + "  ".join(f"{n}: {flops / s / 1e9:6.1f} GFLOP/s" for n, s in best.items()))


class _WithFallback:
    """A build, with the functions it lacks (an older build than the Python code) taken from the other."""

    def __init__(self, build, other):
        self._build, self._other = build, other

    def __getattr__(self, name):
        return getattr(self._build, name) if hasattr(self._build, name) else getattr(self._other, name)


def ab_decode(builds: dict, reps: int, batch: int, dtype: str) -> None:
    import nanoinfer.platforms.cpu.ops as cpu_ops_module
    from nanoinfer.llm import LLM
    from nanoinfer.sampling_params import SamplingParams

    (a, ops_a), (b, ops_b) = builds.items()
    for name, ops, other in ((a, ops_a, ops_b), (b, ops_b, ops_a)):
        missing = sorted(set(dir(other)) - set(dir(ops)) - {"__file__", "__loader__", "__spec__", "__name__"})
        if missing:
            print(f"{name} lacks {', '.join(missing)}: taken from the other build")
    builds = {a: _WithFallback(ops_a, ops_b), b: _WithFallback(ops_b, ops_a)}

    cpu_ops_module._module = next(iter(builds.values()))  # the engine packs its weights with the first
    llm = LLM(model="smollm2-135m-instruct", dtype=dtype)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=48)
    per_step = {name: [] for name in builds}
    for rep in range(reps):
        for name, ops in turns(builds, rep):
            cpu_ops_module._module = ops
            for _ in range(batch):  # fresh prompts: no prefix-cache hits across turns
                llm.add_request([rng.randrange(49152) for _ in range(rng.randint(150, 250))], params)
            seconds, steps = 0.0, 0
            while llm.has_unfinished_requests():
                _, stats = llm.step()
                if not stats.num_prefill_tokens:
                    seconds, steps = seconds + stats.seconds, steps + 1
            per_step[name].append(seconds / steps * 1e3)
    for name, values in per_step.items():
        print(f"{name}: best {min(values):.1f} ms per decode step of {batch}, all {[round(v, 1) for v in values]}")


def ab_attention(builds: dict, reps: int, batch: int, run_rows: int, dtype: str, block_size: int = 16) -> None:
    """paged_decode alone over 30 layers' caches (too big for cache, as in W): `batch` sequences of 190-400
    tokens, each `run_rows` consecutive rows (speculative decoding's runs; 1 = lone rows), SmolLM2's heads;
    cache blocks of `block_size` tokens in random order (the engine's are 256 tokens, handed out in order
    on a fresh cache: a sequence's keys then lie in long runs the hardware prefetchers follow)."""
    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    num_kv_heads, num_heads, head_dim = 3, 9, 64
    lens = torch.randint(190, 400, (batch,), generator=gen).tolist()
    blocks = [-(-(n + run_rows) // block_size) for n in lens]
    shape = (sum(blocks), block_size, num_kv_heads, head_dim)
    layers = [(torch.randn(shape, generator=gen).to(torch_dtype), torch.randn(shape, generator=gen).to(torch_dtype))
              for _ in range(30)]  # fmt: skip
    order = torch.randperm(shape[0], generator=gen).tolist()
    tables, seq_lens, used = [], [], 0
    for n, b in zip(lens, blocks):
        table = order[used : used + b] + [0] * (max(blocks) - b)
        used += b
        for i in range(run_rows):
            tables.append(table)
            seq_lens.append(n + i + 1)
    tables_t = torch.tensor(tables, dtype=torch.int32)
    lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(torch_dtype)
    best = dict.fromkeys(builds, float("inf"))
    for rep in range(reps):
        for name, ops in turns(builds, rep):
            start = time.perf_counter()
            for k_cache, v_cache in layers:
                ops.paged_decode(query, k_cache, v_cache, tables_t, lens_t, head_dim**-0.5, 0, 0.0)
            best[name] = min(best[name], time.perf_counter() - start)
    print(f"{batch} sequences x {run_rows} rows, {dtype}, blocks of {block_size}, 30 layers: "
          + "  ".join(f"{n}: {s * 1e3:.1f} ms" for n, s in best.items()))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", help="build name of the CPU kernels, e.g. nanoinfer_cpu_ops_0123456789ab")
    parser.add_argument("b", help="the other build")
    parser.add_argument("--what", choices=("gemm", "decode", "attention"), default="gemm")
    parser.add_argument(
        "--reps", type=int, default=None, help="turns per build (default: 10 gemm, 7 attention, 3 decode)"
    )
    parser.add_argument("--batch", type=int, default=64, help="decode, attention: sequences per step")
    parser.add_argument("--run-rows", type=int, default=4, help="attention: consecutive rows a sequence")
    parser.add_argument("--block-size", type=int, default=16, help="attention: tokens a cache block (engine: 256)")
    parser.add_argument("--rows", default="16,32,64", help="gemm: the row counts, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="decode, attention: the dtype"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    builds = {"A": load_build(args.a), "B": load_build(args.b)}
    print(f"A = {args.a}, B = {args.b}, {args.threads} threads")
    if args.what == "gemm":
        ab_gemm(builds, args.reps or 10, [int(r) for r in args.rows.split(",")])
    elif args.what == "attention":
        ab_attention(builds, args.reps or 7, args.batch, args.run_rows, args.dtype, args.block_size)
    else:
        ab_decode(builds, args.reps or 3, args.batch, args.dtype)


if __name__ == "__main__":
    main()
