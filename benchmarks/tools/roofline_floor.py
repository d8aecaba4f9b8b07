"""The floor of the bench's workload on a GPU from the table, computed without one: the real scheduler steps the
workload with a stand-in for the model (which never changes what gets scheduled: EOS is ignored, every output
length is fixed), and each step's bytes and FLOPs (nanoinfer/roofline.py) are set against the card's ceilings.

What `nanoinfer bench` reports on that card as "floor" is this sum, step for step (same scheduler, same counts),
so the issue's estimate of the floor can be checked before a GPU is lent. Defaults: the CUDA bench (Qwen3-0.6B
shape, bfloat16, 256 requests, 100..1024 in and out, seed 0, the 4,508 KV blocks the H200 run allocated).

    python benchmarks/tools/roofline_floor.py                               # bfloat16 cache, H200
    python benchmarks/tools/roofline_floor.py --kv-cache-dtype fp8_e4m3     # the same memory holds 2x the blocks
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import transformers

from nanoinfer import memory, roofline
from nanoinfer.bench import make_workload
from nanoinfer.engine.block_manager import BlockManager
from nanoinfer.engine.engine import StepStats, _count_step
from nanoinfer.engine.scheduler import Scheduler
from nanoinfer.engine.sequence import Request
from nanoinfer.models import registry
from nanoinfer.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-config", default=str(ROOT / "configs/models/qwen3-0.6b/config.json"))
    parser.add_argument("--gpu", default="H200")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-dtype", default="bfloat16")
    parser.add_argument("--num-kvcache-blocks", type=int, default=None,
                        help="default: the H200 run's 4,508 in bfloat16, scaled by the cache's bytes")  # fmt: skip
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, nargs=2, default=(100, 1024))
    parser.add_argument("--output-len", type=int, nargs=2, default=(100, 1024))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--max-model-len", type=int, default=4096)
    args = parser.parse_args()

    hf_config = json.loads(Path(args.model_config).read_text())
    model_spec = registry.model_spec(
        transformers.AutoConfig.for_model(hf_config["model_type"], **{k: v for k, v in hf_config.items()
                                                                      if k != "model_type"})
    )
    blocks = args.num_kvcache_blocks or 4508 * 2 // memory.dtype_bytes(args.kv_cache_dtype)
    workload = make_workload(args.num_requests, tuple(args.input_len), tuple(args.output_len), args.seed,
                             hf_config["vocab_size"])  # fmt: skip
    scheduler = Scheduler(BlockManager(blocks, 256, True), max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len)
    for i, (prompt, n) in enumerate(zip(workload.prompt_token_ids, workload.output_lens)):
        scheduler.add_request(Request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)))

    name, spec = args.gpu, memory.GPU_TABLE[memory.lookup_gpu(args.gpu)[0]]
    flops = spec.fp32_tflops if args.dtype == "float32" else spec.bf16_tflops
    ceilings = roofline.Ceilings(name, spec.bandwidth_gbs * 1e9, flops * 1e12, "datasheet", "datasheet")
    shape = roofline.ModelShape.from_spec(model_spec, args.dtype, args.kv_cache_dtype)
    floor = roofline.Roofline(shape, ceilings)
    num_preempted = 0
    while scheduler.has_unfinished:
        out = scheduler.schedule()
        num_prefill, counts = _count_step(out.scheduled)
        floor.add(StepStats(num_prefill, out.num_scheduled_tokens - num_prefill, out.num_preempted, 0.0, 0, 0,
                            *counts))  # fmt: skip
        num_preempted += out.num_preempted
        sampled = {seq.seq_id: [7] for seq, n in out.scheduled if seq.num_computed_tokens + n == seq.num_tokens}
        scheduler.update(out, sampled)

    total = floor.all_steps
    print(f"{args.num_requests} requests, {workload.num_input_tokens:,} prompt and {workload.num_output_tokens:,} "
          f"output tokens; {args.dtype} weights, {args.kv_cache_dtype} cache ({shape.kv_bytes_per_token:,} bytes a "
          f"token), {blocks:,} blocks, {num_preempted} preemptions; {name}: {spec.bandwidth_gbs:,.0f} GB/s, "
          f"{flops:,.0f} TFLOP/s")  # fmt: skip
    print(f"{'class':16}{'steps':>7}{'floor ms':>11}{'ms/step':>9}{'GB':>9}{'KV read GB':>12}{'TFLOP':>8}  bound")
    for cls, totals in [*floor.ordered_classes(), ("all steps", total)]:
        print(f"{cls:16}{totals.steps:7,}{totals.floor_seconds * 1e3:11.1f}"
              f"{totals.floor_seconds / totals.steps * 1e3:9.2f}{totals.cost.total_bytes / 1e9:9.1f}"
              f"{totals.cost.kv_read_bytes / 1e9:12.1f}{totals.cost.flops / 1e12:8.1f}  {totals.bound}")  # fmt: skip
    print(f"floor of the run: {total.floor_seconds:.2f} s = {workload.num_output_tokens / total.floor_seconds:,.0f} "
          "output tok/s at the ceiling")  # fmt: skip


if __name__ == "__main__":
    main()
