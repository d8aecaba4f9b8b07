"""Decode attention variants against their HBM floor: which settings of kernels/paged_attention.py's decode
launcher read the KV cache fastest on this GPU, for the bench workload's shapes (Qwen3-0.6B: 16 query heads,
8 KV heads of 128, blocks of 256 tokens), with a bfloat16 and an fp8 (e4m3) cache.

Each shape (sequences x longest context; each sequence's context uniform in [context / 2, context], seeded) is
laid out as a CUDA graph runs it: block tables and max_seq_len for max_model_len. Every variant is first
checked against the default's output (a variant that differs is reported and never wins), then captured in a
CUDA graph and timed with triton.testing.do_bench (median, L2 flushed between runs); flash-attn and FlashInfer
are timed the same way when they import. A call's floor is the bytes it must move (each sequence's K and V
once, the queries and the output) over the card's bandwidth (memory.GPU_TABLE, or --bandwidth-gbs); each cell
gives microseconds and floor / time. The last lines name each shape's winner. scripts/gpu_check.sh runs this
as its decode-variants step.

    python benchmarks/tools/decode_variants.py --output-json gpu_logs/decode-variants.json
    TRITON_INTERPRET=1 python benchmarks/tools/decode_variants.py --smoke   # CPU: the code path on tiny shapes
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass

import torch

# name -> paged_decode_attention keywords. One knob at a time from the default, plus pairs worth trying.
VARIANTS: dict[str, dict] = {
    "default": {},
    "tile32": {"tile_n": 32},
    "tile128": {"tile_n": 128},
    "tile256": {"tile_n": 256},
    "warps2": {"num_warps": 2},
    "warps8": {"num_warps": 8},
    "tile128-warps8": {"tile_n": 128, "num_warps": 8},
    "stages1": {"num_stages": 1},
    "stages4": {"num_stages": 4},
    "splits1": {"num_splits": 1},
    "splits4": {"num_splits": 4},
    "splits16": {"num_splits": 16},
    "by-seq-len": {"split_by_seq_len": True},
    "by-seq-len-splits8": {"split_by_seq_len": True, "num_splits": 8},
}
EXTERNAL = ("flash-attn", "flashinfer")  # other libraries' paged decode, timed when they import
SMOKE_VARIANTS = ("default", "tile32", "by-seq-len-splits8")


@dataclass
class Result:
    cache: str  # "bfloat16" | "fp8_e4m3"
    variant: str
    shape: str  # "<sequences>x<context>"
    us: float | None  # median microseconds of one call, None when it did not run or did not match
    floor_us: float
    of_floor: float | None  # floor / time
    ok: bool  # ran and matched the default's output
    error: str | None = None  # why it did not run or match; for one that ran, a note on how it was timed


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="1x512,1x2048,32x512,32x2048,256x512,256x2048",
                        help="sequences x longest context, comma-separated")  # fmt: skip
    parser.add_argument("--heads", type=int, nargs=3, default=(16, 8, 128), metavar=("H_Q", "H_KV", "D"))
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=4096, help="the width CUDA graphs are captured for")
    parser.add_argument("--caches", default="bfloat16,fp8_e4m3")
    parser.add_argument("--variants", default=",".join([*VARIANTS, *EXTERNAL]))
    parser.add_argument("--bandwidth-gbs", type=float, default=None, help="default: the GPU table's")
    parser.add_argument("--no-graphs", action="store_true", help="time eager launches instead of graph replays")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="CPU under TRITON_INTERPRET=1: tiny shapes, three variants, one timed call each")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shapes, args.heads, args.max_model_len = "2x300", (4, 2, 64), 1024
        args.variants = ",".join(SMOKE_VARIANTS)
        args.bandwidth_gbs = args.bandwidth_gbs or 10.0
        args.no_graphs = True
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from nanoinfer.attention.metadata import AttentionMetadata
    from nanoinfer.attention.reference import paged_attention_reference
    from nanoinfer.platforms.cuda.kernels import paged_decode_attention, store_kvcache

    device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("decode_variants: no CUDA device (run with TRITON_INTERPRET=1 --smoke on a CPU)", file=sys.stderr)
        return 2
    num_heads, num_kv_heads, head_dim = args.heads
    block = args.block_size
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    caches = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
    cache_names = args.caches.split(",")
    names = args.variants.split(",")
    device_name, bandwidth = _bandwidth(device, args.bandwidth_gbs)
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)  # block orders
    data_gen = torch.Generator(device=device).manual_seed(args.seed)  # a GB of keys: drawn where they live
    max_blocks_per_seq = -(-args.max_model_len // block)

    # One cache for all shapes, as big as the largest needs; each shape's tables are a random draw of its blocks.
    layouts = {}
    for num_seqs, context in shapes:
        seq_lens = [rng.randint(max(1, context // 2), context) for _ in range(num_seqs)]
        layouts[num_seqs, context] = seq_lens
    num_blocks = max(sum(-(-n // block) for n in lens) for lens in layouts.values()) + 1
    kv_shape = (num_blocks * block, num_kv_heads, head_dim)
    keys = torch.randn(kv_shape, generator=data_gen, device=device).to(torch.bfloat16)
    values = torch.randn(kv_shape, generator=data_gen, device=device).to(torch.bfloat16)
    slots = torch.arange(num_blocks * block, device=device)

    results: list[Result] = []
    for cache_name in cache_names:
        cache_dtype = caches[cache_name]
        k_cache = torch.empty(num_blocks, block, num_kv_heads, head_dim, dtype=cache_dtype, device=device)
        v_cache = torch.empty_like(k_cache)
        store_kvcache(keys, values, k_cache, v_cache, slots)  # rounded as the engine stores them
        for (num_seqs, context), seq_lens in layouts.items():
            shape = f"{num_seqs}x{context}"
            order = torch.randperm(num_blocks - 1, generator=gen).tolist()
            tables = torch.zeros(num_seqs, max_blocks_per_seq, dtype=torch.int32)
            next_block = 0
            for i, n in enumerate(seq_lens):
                used = -(-n // block)
                tables[i, :used] = torch.tensor(order[next_block : next_block + used])
                next_block += used
            tables = tables.to(device)
            lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
            query = torch.randn(num_seqs, num_heads, head_dim, generator=data_gen, device=device).to(torch.bfloat16)
            scale = head_dim**-0.5
            moved = (sum(seq_lens) * 2 * num_kv_heads * head_dim * cache_dtype.itemsize
                     + 2 * query.numel() * query.element_size() + tables.numel() * 4)  # fmt: skip
            floor_us = moved / bandwidth * 1e6

            run = functools.partial(_decode, paged_decode_attention, query, k_cache, v_cache, tables, lens,
                                    args.max_model_len, scale)  # fmt: skip
            expected = run("default")
            if num_seqs == min(n for n, _ in shapes) and context == min(c for n, c in shapes if n == num_seqs):
                metadata = AttentionMetadata(
                    slot_mapping=lens.long(), query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32,
                                                                           device=device),
                    seq_lens=lens, block_tables=tables, max_query_len=1, max_seq_len=max(seq_lens),
                )  # fmt: skip
                reference = paged_attention_reference(query, k_cache, v_cache, metadata, scale)
                torch.testing.assert_close(expected.float(), reference.float(), atol=3e-2, rtol=3e-2)
            for name in names:
                if name in EXTERNAL:
                    fn, error = _external(name, query, k_cache, v_cache, tables, lens, scale, block)
                else:
                    fn, error = functools.partial(run, name), None
                results.append(_measure(name, fn, error, expected, cache_name, shape, floor_us, device,
                                        graphs=not args.no_graphs))  # fmt: skip
    report = _report(results, device_name, bandwidth, args, names, cache_names, shapes)
    print(report["text"])
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({k: v for k, v in report.items() if k != "text"}, f, indent=2)
            f.write("\n")
    return 0


def _decode(kernel, query, k_cache, v_cache, tables, lens, max_seq_len, scale, variant: str):
    return kernel(query, k_cache, v_cache, tables, lens, max_seq_len, scale, **VARIANTS[variant])


def _bandwidth(device: str, flag_gbs: float | None) -> tuple[str, float]:
    """(device name, bytes/s): the flag, else the GPU table's row for this card (or a probe: roofline.py)."""
    from nanoinfer.roofline import device_ceilings

    if flag_gbs is not None:
        return ("cpu" if device == "cpu" else torch.cuda.get_device_name(0)), flag_gbs * 1e9
    ceilings = device_ceilings(device, "bfloat16")
    return f"{ceilings.device} ({ceilings.bandwidth_source})", ceilings.bandwidth


def _measure(name, fn, error, expected, cache_name, shape, floor_us, device, graphs: bool) -> Result:
    if error is not None:
        return Result(cache_name, name, shape, None, floor_us, None, False, error)
    try:
        out = fn()
        torch.testing.assert_close(out.float().reshape(expected.shape), expected.float(), atol=3e-2, rtol=3e-2)
    except Exception as e:  # a variant that fails is a result to report, not the end of the run
        return Result(cache_name, name, shape, None, floor_us, None, False, f"{type(e).__name__}: {e}"[:300])
    note = None
    try:
        us = _time_us(fn, device, graphs)
    except Exception as e:  # e.g. a library whose kernels will not be captured: time it eagerly instead
        note = f"timed eagerly, graph capture failed: {type(e).__name__}: {e}"[:300]
        us = _time_us(fn, device, False)
    return Result(cache_name, name, shape, us, floor_us, floor_us / us if us else None, True, note)


def _time_us(fn, device: str, graphs: bool) -> float:
    if device == "cpu":  # the smoke run: the interpreter's speed means nothing, one call shows the path works
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    import triton.testing

    timed = fn
    if graphs:  # as the engine runs decode: replays, no Python launch cost between kernels
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        timed = graph.replay
    return triton.testing.do_bench(timed, warmup=25, rep=100, return_mode="median") * 1e3


def _external(name, query, k_cache, v_cache, tables, lens, scale, block):
    """(fn, None) running another library's paged decode on our cache layout, or (None, why not)."""
    if k_cache.dtype != query.dtype and name == "flash-attn":
        return None, "flash-attn reads the cache in the query's dtype"
    try:
        if name == "flash-attn":
            from flash_attn import flash_attn_with_kvcache

            q4 = query.unsqueeze(1)  # [B, 1, H, D]
            return (lambda: flash_attn_with_kvcache(q4, k_cache, v_cache, cache_seqlens=lens, block_table=tables,
                                                    softmax_scale=scale, causal=True)), None  # fmt: skip
        import flashinfer

        seq_lens = lens.tolist()
        pages = [-(-n // block) for n in seq_lens]
        indptr = torch.tensor([0, *itertools.accumulate(pages)], dtype=torch.int32, device=query.device)
        indices = torch.cat([tables[i, :p] for i, p in enumerate(pages)]).to(torch.int32)
        last = torch.tensor([(n - 1) % block + 1 for n in seq_lens], dtype=torch.int32, device=query.device)
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device=query.device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(indptr, indices, last, query.shape[1], k_cache.shape[2], query.shape[2], block,
                     q_data_type=query.dtype, kv_data_type=k_cache.dtype, sm_scale=scale)  # fmt: skip
        return (lambda: wrapper.run(query, (k_cache, v_cache))), None
    except Exception as e:  # absent, or another version's API: say so in the table
        return None, f"{type(e).__name__}: {e}"[:300]


def _report(results: list[Result], device_name, bandwidth, args, names, cache_names, shapes) -> dict:
    shape_names = [f"{n}x{c}" for n, c in shapes]
    lines = [f"decode attention on {device_name}, {bandwidth / 1e9:,.0f} GB/s; {args.heads[0]} query heads, "
             f"{args.heads[1]} KV heads x {args.heads[2]}, blocks of {args.block_size}, max_seq_len "
             f"{args.max_model_len}, {'eager launches' if args.no_graphs else 'CUDA graph replays'}; "
             "cells: median us, floor / time"]  # fmt: skip
    by_key = {(r.cache, r.variant, r.shape): r for r in results}
    winners = {}
    for cache in cache_names:
        lines.append("")
        lines.append(f"{cache} cache".ljust(20) + "".join(s.rjust(17) for s in shape_names))
        for name in names:
            cells = []
            for shape in shape_names:
                r = by_key.get((cache, name, shape))
                cells.append("-".rjust(17) if r is None or not r.ok else f"{r.us:9.1f} {r.of_floor:5.0%}".rjust(17))
            lines.append(name.ljust(20) + "".join(cells))
        for name in names:
            noted = [r for r in results if r.cache == cache and r.variant == name and r.error]
            if noted:
                lines.append(f"  {name}: {noted[0].error}")
        for shape in shape_names:
            ok = [r for r in results if r.cache == cache and r.shape == shape and r.ok]
            if not ok:
                continue
            best = min(ok, key=lambda r: r.us)
            default = by_key.get((cache, "default", shape))
            winners[f"{cache} {shape}"] = {"variant": best.variant, "us": best.us, "of_floor": best.of_floor,
                                           "default_us": default.us if default and default.ok else None,
                                           "default_of_floor": default.of_floor if default and default.ok else None}
    lines.append("")
    for key, w in winners.items():
        versus = f"; default {w['default_of_floor']:.0%}" if w["default_of_floor"] is not None else ""
        lines.append(f"winner {key}: {w['variant']} at {w['of_floor']:.0%} of the HBM floor ({w['us']:.1f} us{versus})")
    return {"schema": "nanoinfer-decode-variants/1", "device": device_name, "bandwidth_gbs": bandwidth / 1e9,
            "heads": list(args.heads), "block_size": args.block_size, "max_model_len": args.max_model_len,
            "graphs": not args.no_graphs, "shapes": shape_names, "variants": {n: VARIANTS.get(n) for n in names},
            "results": [asdict(r) for r in results], "winners": winners, "text": "\n".join(lines),
            "all_ok": all(r.ok for r in results if r.variant not in EXTERNAL),
            "floor_note": "bytes = each sequence's K and V once + queries + outputs + block tables"}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
