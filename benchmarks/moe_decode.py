"""One MoE layer's experts on CPU: nanoinfer's fused expert op (csrc/moe.cpp) against a dense gated MLP with the
same active parameters and against transformers' expert loop, each set against its roofline floor.

Shape: Qwen3-30B-A3B's layer by default (hidden 2048, 128 experts, top 8, expert width 768), tokens routed uniformly
at random (each token's k experts distinct, fresh routing every repetition, so the experts come from memory).
- moe:   the platform's expert method (platforms/cpu/moe.py) on experts packed as prepare_model packs them;
- dense: a gated MLP of width k x 768 through the platform's packed dense GEMM (platforms/cpu/linear.py), the
         same FLOPs, reading k experts' worth of weights whatever the routing;
- hf:    transformers' Qwen3MoeExperts (its eager loop over the experts hit; `--hf-impl` picks another of its
         implementations), on the same weights.
A floor is the longer of bytes / bandwidth (the weights a step reads: the experts hit, or the dense MLP) and
FLOPs / peak, both measured here by roofline.probe; "of floor" is floor / measured time.

    python benchmarks/moe_decode.py --dtype bfloat16 --tokens 1 8 32 256
    python benchmarks/moe_decode.py --hidden 64 --experts 8 --intermediate 32 --tokens 1 4 --reps 2   # smoke
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn


def timed(fn, inputs: list, reps: int) -> float:
    """Median seconds of fn(*inputs[i % len(inputs)]) over reps calls, after one warm-up call."""
    fn(*inputs[-1])
    times = []
    for rep in range(reps):
        start = time.perf_counter()
        fn(*inputs[rep % len(inputs)])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 256])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--hf-reps", type=int, default=3)
    parser.add_argument("--hf-impl", default="eager", help="transformers' experts implementation, or 'none' to skip")
    args = parser.parse_args()

    from nanoinfer import roofline
    from nanoinfer.models.layers.moe import FusedMoE
    from nanoinfer.platforms import select_platform
    from nanoinfer.platforms.cpu import linear as cpu_linear

    dtype = getattr(torch, args.dtype)
    platform = select_platform("cpu", args.dtype, cpu_kernels="wait")
    torch.manual_seed(0)
    E, H, I, k = args.experts, args.hidden, args.intermediate, args.top_k  # noqa: E741 (I: the expert width)
    bandwidth, peak = roofline.probe("cpu", args.dtype)
    print(f"{platform.kernels_description()}, {torch.get_num_threads()} threads, {args.dtype}; measured "
          f"{bandwidth / 1e9:.1f} GB/s, {peak / 1e9:.0f} GFLOP/s")  # fmt: skip

    layer = FusedMoE(E, H, I, "silu")
    w13 = (torch.randn(E, 2 * I, H) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, I) / I**0.5).to(dtype)
    hf = None
    if args.hf_impl != "none":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

        config = Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=k, moe_intermediate_size=I)
        config._experts_implementation = args.hf_impl
        hf = Qwen3MoeExperts(config)
        hf.gate_up_proj, hf.down_proj = nn.Parameter(w13, requires_grad=False), nn.Parameter(w2, requires_grad=False)
    layer.w13_weight.data, layer.w2_weight.data = w13, w2  # shared with hf's; packing releases only the layer's
    platform.prepare_model(nn.Sequential(layer))
    if getattr(layer, "packed_experts", None) is None:
        print("note: the experts are not packed here (no C++ kernels): 'moe' runs the reference")
    expert_bytes = roofline.expert_bytes(nn.Sequential(layer)) // E

    # The dense gated MLP of the same active width, packed as prepare_model packs a model's MLP.
    width = k * I
    kind = cpu_linear.packing_kind(dtype)
    gate_up_weight = (torch.randn(2 * width, H) / H**0.5).to(dtype)
    down_weight = (torch.randn(H, width) / width**0.5).to(dtype)
    gated = kind == "panels" and dtype == torch.float32
    gate_up = cpu_linear.pack_weight(gate_up_weight, "gated" if gated else kind) if kind else None
    down = cpu_linear.pack_weight(down_weight, kind) if kind else None

    def dense(x):
        if gated:
            hidden = cpu_linear.gated_linear(x, gate_up)
        else:
            hidden = platform.silu_and_mul(cpu_linear.linear(x, gate_up_weight, None, gate_up))
        return cpu_linear.linear(hidden, down_weight, None, down)

    dense_bytes = (gate_up_weight.numel() + down_weight.numel()) * gate_up_weight.element_size()

    def floor(num_bytes, num_tokens):
        return max(num_bytes / bandwidth, 2 * num_tokens * k * 3 * H * I / peak)

    print(f"{'tokens':>6} {'experts':>7} | {'moe ms':>8} {'floor':>7} {'of floor':>8} | {'dense ms':>8} {'floor':>7} "
          f"{'of floor':>8} | {'hf ms':>8}")  # fmt: skip
    with torch.inference_mode():
        for num_tokens in args.tokens:
            inputs = []
            for _ in range(max(args.reps, args.hf_reps)):
                x = torch.randn(num_tokens, H).to(dtype)
                ids = torch.rand(num_tokens, E).topk(k, dim=-1).indices
                weights = torch.rand(num_tokens, k)
                inputs.append((x, (weights / weights.sum(-1, keepdim=True)).to(dtype).float(), ids))
            hit = statistics.mean(len(torch.unique(ids)) for _, _, ids in inputs)
            moe_s = timed(lambda x, w, ids: platform.fused_moe(layer, x, w, ids), inputs, args.reps)
            dense_s = timed(lambda x, w, ids: dense(x), inputs, args.reps)
            hf_s = timed(lambda x, w, ids: hf(x, ids, w.to(dtype)), inputs, args.hf_reps) if hf is not None else None
            moe_floor, dense_floor = floor(hit * expert_bytes, num_tokens), floor(dense_bytes, num_tokens)
            hf_text = f"{hf_s * 1e3:8.2f}" if hf_s is not None else f"{'-':>8}"
            moe_text = f"{moe_s * 1e3:8.2f} {moe_floor * 1e3:7.2f} {moe_floor / moe_s:8.0%}"
            dense_text = f"{dense_s * 1e3:8.2f} {dense_floor * 1e3:7.2f} {dense_floor / dense_s:8.0%}"
            print(f"{num_tokens:6d} {hit:7.1f} | {moe_text} | {dense_text} | {hf_text}")


if __name__ == "__main__":
    main()
