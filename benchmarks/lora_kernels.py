"""One linear layer's batched multi-LoRA delta on CPU: nanoinfer's kernel (csrc/lora.cpp, the op CpuKernelPlatform.
add_lora calls) against the reference (Platform.add_lora: each adapter's rows gathered, two matmuls, added back).

Shapes: SmolLM2-135M's four adapted layers (hidden 576, intermediate 1536; qkv 576 + 192 + 192 outputs in 3 slices,
o_proj 576, gate_up 2 x 1536 in 2 slices, down 1536 -> 576), rank --rank, float32 by default. Two steps:
- decode: --decode-rows rows (one a sequence) over --adapters adapters, interleaved (row t has adapter t mod L);
- prefill: --prefill-rows rows in --adapters contiguous segments (one prompt chunk an adapter).
GFLOP/s counts 2 T (K S R + R N) FLOPs a call (shrink x [T, K] by A^T [K, S R], expand h by B [R, N]).

    python benchmarks/lora_kernels.py
    python benchmarks/lora_kernels.py --dtype bfloat16 --rank 64
    python benchmarks/lora_kernels.py --reps 20 --ref-reps 2      # smoke
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

# name: (in_features, output slice widths) of SmolLM2-135M
LAYERS = {"qkv": (576, (576, 192, 192)), "o_proj": (576, (576,)), "gate_up": (576, (1536, 1536)),
          "down": (1536, (576,))}  # fmt: skip


def timed(op, inputs: tuple, reps: int) -> float:
    """Median seconds of op(*inputs) over reps calls, after a warm-up call."""
    op(*inputs)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        op(*inputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cpu_description() -> str:
    """The CPU and the instruction sets the kernels use, as the CPU platform describes them (bench records too)."""
    from nanoinfer.platforms.cpu import CpuPlatform

    info = CpuPlatform().describe()
    return f"{info['cpu']} ({', '.join(info['cpu_features']) or 'no AVX2'})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--decode-rows", type=int, default=64)
    parser.add_argument("--prefill-rows", type=int, default=512)
    parser.add_argument("--reps", type=int, default=500)
    parser.add_argument("--ref-reps", type=int, default=20)
    args = parser.parse_args()

    from nanoinfer.platforms.cpu.ops import cpu_ops
    from nanoinfer.platforms.interface import Platform

    ops = cpu_ops()
    if ops is None:
        raise SystemExit("the CPU kernels are not available here (see the warning above)")
    dtype, rank, num_adapters = getattr(torch, args.dtype), args.rank, args.adapters
    print(f"{cpu_description()}; kernels {ops.simd}, {torch.get_num_threads()} threads, {args.dtype}, rank {rank}, "
          f"{num_adapters} adapters")  # fmt: skip
    print(f"{'step':>7} {'layer':>7} {'T':>4} {'K':>5} {'N':>5} {'S':>2} | {'kernel us':>9} {'GFLOP/s':>7} | "
          f"{'ref us':>8} {'GFLOP/s':>7} | {'speedup':>7}")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    reference = Platform()
    for step, num_rows in (("decode", args.decode_rows), ("prefill", args.prefill_rows)):
        rows = torch.arange(num_rows)
        slots = rows % num_adapters if step == "decode" else rows * num_adapters // num_rows
        slots = slots.to(torch.int32)
        for name, (in_features, widths) in LAYERS.items():
            num_slices, out_features = len(widths), sum(widths)
            offsets = [sum(widths[:i]) for i in range(num_slices + 1)]
            x = torch.randn(num_rows, in_features, generator=gen).to(dtype)
            y = torch.randn(num_rows, out_features, generator=gen).to(dtype)
            lora_a = (torch.randn(num_adapters, num_slices * rank, in_features, generator=gen) * 0.02).to(dtype)
            lora_b = (torch.randn(num_adapters, rank, out_features, generator=gen) * 0.02).to(dtype)
            with torch.inference_mode():
                kernel_s = timed(ops.add_lora, (y, x, lora_a, lora_b, slots, offsets), args.reps)
                ref_s = timed(reference.add_lora, (y, x, lora_a, lora_b, slots, tuple(offsets)), args.ref_reps)
            gflop = 2 * num_rows * (in_features * num_slices * rank + rank * out_features) / 1e9
            print(f"{step:>7} {name:>7} {num_rows:4d} {in_features:5d} {out_features:5d} {num_slices:2d} | "
                  f"{kernel_s * 1e6:9.1f} {gflop / kernel_s:7.1f} | {ref_s * 1e6:8.1f} {gflop / ref_s:7.1f} | "
                  f"{ref_s / kernel_s:6.1f}x")  # fmt: skip


if __name__ == "__main__":
    main()
