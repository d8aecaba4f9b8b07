"""One Gated DeltaNet layer's decode step (or, with --prefill, a step of prompts) on CPU: nanoinfer's kernels
(csrc/gated_delta.cpp, through the platform's causal_conv1d and gated_delta_rule as the model calls them) against
the reference (attention/gated_delta.py: the recurrent step in plain torch, a sequence at a time; the convolution
likewise).

Shape: Qwen3.5-0.8B's linear-attention layer by default (16 key and 16 value heads of 128, a convolution of width
4 over 2 x 16 x 128 + 16 x 128 channels), float32 state, q/k/v as views of the convolution's output as the model
passes them. Each repetition uses other slots of a state cache larger than the last-level cache (--cache-mib), so
its states come from memory, as in a model's step, where each of the 18 such layers has its own cache.

State traffic: the kernel reads each state from memory once (its second pass re-reads a head's columns from the
core's cache) and writes it once, 2 x B x H_v x D_k x D_v x 4 bytes a step; GB/s is that over the median time,
"of bw" that against the read bandwidth measured by roofline.probe (a sum over 256 MiB). The reference moves
more (each of its torch ops a pass over the state), but is given the same count for comparison.

    python benchmarks/gated_delta_decode.py                         # batch 1, 8, 32, float32 inputs
    python benchmarks/gated_delta_decode.py --dtype bfloat16
    python benchmarks/gated_delta_decode.py --batch 1 --reps 3 --ref-reps 1 --cache-mib 16   # smoke

--prefill: a step of prompts instead (--seqs prompts, lengths drawn uniformly from --min-len..--max-len with
seed 0, no context), through the prefill kernels against the reference (per sequence; the rule in its chunked
form). GFLOP/s counts the recurrent form's 6 D_k D_v FLOPs a token and value head (S^T k, S^T q, the update).

    python benchmarks/gated_delta_decode.py --prefill                     # 64 prompts of 32..256 tokens
    python benchmarks/gated_delta_decode.py --prefill --dtype bfloat16
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from types import SimpleNamespace

import torch


def timed(op, inputs: tuple, metadata: list, reps: int) -> float:
    """Median seconds of op(*inputs, metadata[rep]) over reps calls (each on other slots), after a warm-up call."""
    op(*inputs, metadata[reps])
    times = []
    for rep in range(reps):
        start = time.perf_counter()
        op(*inputs, metadata[rep])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="q, k, v, conv dtype")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--heads-k", type=int, default=16)
    parser.add_argument("--heads-v", type=int, default=16)
    parser.add_argument("--dim-k", type=int, default=128)
    parser.add_argument("--dim-v", type=int, default=128)
    parser.add_argument("--conv-width", type=int, default=4)
    parser.add_argument("--cache-mib", type=int, default=512, help="the state cache (float32 states)")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--ref-reps", type=int, default=5)
    parser.add_argument("--prefill", action="store_true", help="a step of prompts (see above)")
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=256)
    args = parser.parse_args()
    if args.prefill:
        return prefill(args)

    from nanoinfer import roofline
    from nanoinfer.attention import gated_delta as reference
    from nanoinfer.platforms import select_platform

    dtype = getattr(torch, args.dtype)
    platform = select_platform("cpu", args.dtype, cpu_kernels="wait")
    bandwidth, _ = roofline.probe("cpu", args.dtype)
    print(f"{platform.kernels_description()}, {torch.get_num_threads()} threads, {args.dtype} inputs, float32 state; "
          f"measured read bandwidth {bandwidth / 1e9:.1f} GB/s")  # fmt: skip

    Hk, Hv, Dk, Dv = args.heads_k, args.heads_v, args.dim_k, args.dim_v
    channels, width = 2 * Hk * Dk + Hv * Dv, args.conv_width
    state_bytes = Hv * Dk * Dv * 4
    num_slots = max(max(args.batch), args.cache_mib * 2**20 // state_bytes)
    gen = torch.Generator().manual_seed(0)
    ssm_state = torch.randn(num_slots, Hv, Dk, Dv, generator=gen) * 0.1  # written: its pages are real
    conv_state = torch.randn(num_slots, channels, width - 1, generator=gen).to(dtype)
    conv_weight = (torch.randn(channels, width, generator=gen) / 2).to(dtype)

    print(f"{'batch':>5} | {'rule ms':>8} {'GB/s':>6} {'of bw':>6} | {'ref ms':>8} {'GB/s':>6} {'speedup':>7} | "
          f"{'conv ms':>8} {'ref ms':>8} {'speedup':>7}")  # fmt: skip
    with torch.inference_mode():
        for B in args.batch:
            mixed = torch.randn(B, channels, generator=gen).to(dtype)
            q, k, v = mixed.split([Hk * Dk, Hk * Dk, Hv * Dv], dim=1)
            rule_inputs = (q.view(B, Hk, Dk), k.view(B, Hk, Dk), v.view(B, Hv, Dv), -torch.rand(B, Hv, generator=gen),
                           torch.rand(B, Hv, generator=gen).to(dtype), ssm_state)  # fmt: skip
            conv_inputs = (torch.randn(B, channels, generator=gen).to(dtype), conv_weight, conv_state)
            metadata = [
                SimpleNamespace(state_slots=torch.tensor([(rep * B + i) % num_slots for i in range(B)]).int(),
                                query_lens_cpu=[1] * B, seq_lens_cpu=[100] * B)
                for rep in range(max(args.reps, args.ref_reps) + 1)
            ]  # fmt: skip
            rule_s = timed(platform.gated_delta_rule, rule_inputs, metadata, args.reps)
            ref_s = timed(reference.gated_delta_rule, rule_inputs, metadata, args.ref_reps)
            conv_s = timed(platform.causal_conv1d, conv_inputs, metadata, args.reps)
            conv_ref_s = timed(reference.causal_conv1d, conv_inputs, metadata, args.ref_reps)
            traffic = 2 * B * state_bytes
            print(f"{B:5d} | {rule_s * 1e3:8.3f} {traffic / rule_s / 1e9:6.1f} {traffic / rule_s / bandwidth:6.0%} | "
                  f"{ref_s * 1e3:8.3f} {traffic / ref_s / 1e9:6.1f} {ref_s / rule_s:6.1f}x | "
                  f"{conv_s * 1e3:8.3f} {conv_ref_s * 1e3:8.3f} {conv_ref_s / conv_s:6.1f}x")  # fmt: skip


def prefill(args) -> None:
    """One layer's step of --seqs prompts: kernels against the reference, the rule and the conv."""
    from nanoinfer.attention import gated_delta as reference
    from nanoinfer.platforms import select_platform
    from nanoinfer.platforms.cpu.ops import cpu_ops

    dtype = getattr(torch, args.dtype)
    platform = select_platform("cpu", args.dtype, cpu_kernels="wait")
    Hk, Hv, Dk, Dv = args.heads_k, args.heads_v, args.dim_k, args.dim_v
    channels, width = 2 * Hk * Dk + Hv * Dv, args.conv_width
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(args.min_len, args.max_len + 1, (args.seqs,), generator=gen).tolist()
    T = sum(lens)
    print(f"{platform.kernels_description()}, {torch.get_num_threads()} threads, {args.dtype} inputs, float32 state; "
          f"{args.seqs} prompts of {min(lens)}..{max(lens)} tokens, {T} in all")  # fmt: skip
    ssm_state = torch.zeros(args.seqs, Hv, Dk, Dv)
    conv_state = torch.zeros(args.seqs, channels, width - 1, dtype=dtype)
    conv_weight = (torch.randn(channels, width, generator=gen) / 2).to(dtype)
    x = torch.randn(T, channels, generator=gen).to(dtype)  # the conv's input and, split, the rule's q, k, v
    q, k, v = x.split([Hk * Dk, Hk * Dk, Hv * Dv], dim=1)
    rule_inputs = (q.view(T, Hk, Dk), k.view(T, Hk, Dk), v.view(T, Hv, Dv), -torch.rand(T, Hv, generator=gen),
                   torch.rand(T, Hv, generator=gen).to(dtype), ssm_state)  # fmt: skip
    metadata = SimpleNamespace(state_slots=torch.arange(args.seqs, dtype=torch.int32), query_lens_cpu=lens,
                               seq_lens_cpu=lens)  # fmt: skip
    # The kernels alone, into outputs written before: through the platform each call's output is a fresh tensor,
    # whose pages the kernel's first writes fault in (as any fresh tensor of this size, the reference's too).
    ops = cpu_ops()
    starts = torch.tensor([0, *itertools.accumulate(lens)])
    no_context = torch.zeros(args.seqs, dtype=torch.bool)
    rule_out, conv_out = torch.empty(T, Hv, Dv, dtype=dtype), torch.empty_like(x)
    g, beta = rule_inputs[3], rule_inputs[4].float()

    def rule_alone(meta):
        ops.gated_delta_prefill(*rule_inputs[:3], g, beta, ssm_state, meta.state_slots, starts, rule_out, no_context)

    def conv_alone(meta):
        ops.causal_conv1d_prefill(x, conv_weight, conv_state, meta.state_slots, starts, conv_out, no_context)

    reps = max(args.reps // 10, 3)
    rows = []
    with torch.inference_mode():
        for name, op, inputs, kernel, work, unit in (
            ("delta rule", platform.gated_delta_rule, rule_inputs, rule_alone, 6 * Dk * Dv * Hv * T, "GFLOP/s"),
            ("conv", platform.causal_conv1d, (x, conv_weight, conv_state), conv_alone,
             2 * T * channels * x.element_size(), "GB/s"),  # its input read and its output written
        ):  # fmt: skip
            times = (timed(kernel, (), [metadata] * (reps + 1), reps), timed(op, inputs, [metadata] * (reps + 1), reps),
                     timed(getattr(reference, op.__name__), inputs, [metadata] * 2, 1))  # fmt: skip
            rows.append((name, times, work, unit))
    print(f"{'':10} | {'kernel alone':>22} | {'through the platform':>22} | {'reference':>22} | speedup")
    for name, times, work, unit in rows:
        cells = " | ".join(f"{t * 1e3:7.1f} ms {work / t / 1e9:6.1f} {unit:7}" for t in times)
        print(f"{name:10} | {cells} | {times[2] / times[1]:5.1f}x")


if __name__ == "__main__":
    main()
