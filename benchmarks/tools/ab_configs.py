"""A/B two engine settings on workload W in one process, alternating runs (A, B, A, B, ...).

For a setting whose effect is smaller than this VM's run-to-run drift (10-20%): both settings see the same
machine state, turn by turn. Each run loads the engine afresh (load time excluded, as in `nanoinfer bench`)
and generates W exactly; the table gives each run's output tok/s, prefill and decode seconds.

    python benchmarks/tools/ab_configs.py --b kv_cache_dtype=bfloat16 --rounds 2
    python benchmarks/tools/ab_configs.py --a max_num_batched_tokens=16384 --b max_num_batched_tokens=2048

Values are parsed as YAML scalars (2048 is an int, true a bool). --num-requests etc. shrink the workload.

--a-build / --b-build run A or B on another build of the C++ kernels (names as in ab_cpu_ops.py), to
A/B a kernel change on whole W runs with the same settings:

    python benchmarks/tools/ab_configs.py --a-build nanoinfer_cpu_ops_<old> --b-build nanoinfer_cpu_ops_<new>

--a-env / --b-env set environment variables for A's or B's runs only, for a switch the code reads at run
time (not one read once at start-up, such as OMP_NUM_THREADS).
"""

from __future__ import annotations

import argparse
import os
import statistics
from contextlib import contextmanager

import yaml

from nanoinfer import bench
from nanoinfer.config import Config


def parse_settings(items: list[str]) -> dict:
    settings = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"expected NAME=VALUE, got {item!r}")
        settings[name] = yaml.safe_load(value)
    return settings


def parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"expected NAME=VALUE, got {item!r}")
        env[name] = value
    return env


@contextmanager
def environment(env: dict[str, str]):
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def load_build(name: str | None):
    """The named build of the C++ kernels, or None for the current sources' (built on first use)."""
    if name is None:
        return None
    from ab_cpu_ops import load_build as load_named

    return load_named(name)


def use_build(module) -> None:
    from nanoinfer.platforms.cpu import ops as cpu_ops

    cpu_ops._module = module if module is not None else None
    if module is None:
        cpu_ops.cpu_ops()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", nargs="*", default=[], help="settings of A (default: the defaults)")
    parser.add_argument("--b", nargs="*", default=[], help="settings of B")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--a-build", help="build of the C++ kernels for A (default: the current sources')")
    parser.add_argument("--b-build", help="build of the C++ kernels for B")
    parser.add_argument("--a-env", nargs="*", default=[], help="NAME=VALUE environment variables for A's runs")
    parser.add_argument("--b-env", nargs="*", default=[], help="NAME=VALUE environment variables for B's runs")
    args = parser.parse_args()

    base = {"device": "cpu", "num_threads": args.num_threads}
    configs = {"A": Config(**base, **parse_settings(args.a)), "B": Config(**base, **parse_settings(args.b))}
    vocab = configs["A"].hf_config.vocab_size
    workload = bench.make_workload(args.num_requests, tuple(args.input_len), tuple(args.output_len), 0, vocab)
    print(f"A: {args.a or 'defaults'}  B: {args.b or 'defaults'}  "
          f"W: {workload.num_requests} requests, {workload.num_output_tokens} output tokens")  # fmt: skip
    builds = {"A": load_build(args.a_build), "B": load_build(args.b_build)}
    envs = {"A": parse_env(args.a_env), "B": parse_env(args.b_env)}
    results = {"A": [], "B": []}
    for round_index in range(args.rounds):
        for name, config in configs.items():
            use_build(builds[name])
            with environment(envs[name]):
                result, _ = bench.run_nanoinfer(config, workload, warmup=True)
            results[name].append(result)
            r = result
            print(f"round {round_index + 1} {name}: {r.output_tok_s:7.1f} tok/s  "
                  f"prefill {r.prefill_seconds:5.1f} s  decode {r.decode_seconds:5.1f} s", flush=True)  # fmt: skip
    for name, runs in results.items():
        rates = [r.output_tok_s for r in runs]
        decode, prefill = min(r.decode_seconds for r in runs), min(r.prefill_seconds for r in runs)
        print(f"{name}: best {max(rates):.1f} tok/s, median {statistics.median(rates):.1f}; "
              f"decode best {decode:.1f} s, prefill best {prefill:.1f} s")  # fmt: skip
    ratio = max(r.output_tok_s for r in results["B"]) / max(r.output_tok_s for r in results["A"])
    print(f"B / A (best of {args.rounds}): {ratio:.3f}")


if __name__ == "__main__":
    main()
