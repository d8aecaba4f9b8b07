"""Compile every Triton kernel for a GPU on a machine without one, with the arguments our launchers really pass.

The launchers run on CPU tensors with each kernel swapped for a recorder; every recorded launch is then
compiled ahead of time for an NVIDIA target (sm_90 by default: H100/H200) with the ptxas that ships inside
Triton's wheel. A kernel that would not compile on the GPU (a type clash in a branch, a float32 x bfloat16
tl.dot, an op the backend lacks) fails here, in CI, instead of in the first session that is lent a GPU.
The interpreter tests check what the kernels compute; this checks that the compiler takes them.

Run without TRITON_INTERPRET (the interpreter replaces @triton.jit functions, which the compiler cannot take):

    python -m nanoinfer.testing.triton_compile            # prints one line per launch, exit 1 on a failure
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
          torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}  # fmt: skip
_LAUNCH_OPTIONS = ("num_warps", "num_stages")  # launch keywords that are compiler options, not arguments


class _Recorder:
    """Stands in for a @triton.jit kernel: kernel[grid](*args, **kwargs) records the launch, runs nothing."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((self.kernel, args, kwargs))

        return launch


def signature_of(kernel, args: tuple, kwargs: dict) -> tuple[dict, dict]:
    """(signature, constexprs) for triton.compile from one launch's arguments."""
    values = dict(zip(kernel.arg_names, args)) | kwargs
    signature, constexprs = {}, {}
    for param in kernel.params:
        name, value = param.name, values[param.name]
        if param.is_constexpr:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{kernel.fn.__name__}: argument {name} of type {type(value).__name__}")
    return signature, constexprs


def record_launches() -> list[tuple[str, object, tuple, dict]]:
    """Run every launcher on small CPU inputs in each dtype combination the engine uses; (case, kernel, args,
    kwargs) for each launch."""
    from nanoinfer.platforms.cuda.kernels import fused_moe, fused_ops, gated_delta, paged_attention
    from nanoinfer.platforms.cuda.kernels import lora as lora_kernels

    store_module = sys.modules["nanoinfer.platforms.cuda.kernels.store_kvcache"]  # the package re-exports the function
    modules = {
        paged_attention: ("_paged_decode_kernel", "_merge_splits_kernel", "_paged_prefill_kernel"),
        store_module: ("_store_kvcache_kernel",),
        fused_ops: ("_rms_norm_kernel", "_silu_and_mul_kernel", "_rotary_kernel"),
        fused_moe: ("_moe_align_kernel", "_moe_gemm_kernel", "_moe_sum_kernel"),
        gated_delta: ("_causal_conv1d_kernel", "_fused_recurrent_gated_delta_rule_kernel"),
        lora_kernels: ("_lora_shrink_kernel", "_lora_expand_kernel"),
    }
    launches: list = []
    originals = {}
    for module, names in modules.items():
        for name in names:
            originals[module, name] = getattr(module, name)
            setattr(module, name, _Recorder(getattr(module, name), launches))
    recorded = []
    try:
        for case, run in _cases().items():
            before = len(launches)
            run()
            recorded += [(case, *launch) for launch in launches[before:]]
    finally:
        for (module, name), kernel in originals.items():
            setattr(module, name, kernel)
    return recorded


def _cases() -> dict[str, Callable[[], None]]:
    from nanoinfer.platforms.cuda.kernels import (
        fused_ops,
        paged_decode_attention,
        paged_prefill_attention,
        store_kvcache,
    )

    def attention(dtype, cache_dtype, head_dim=128, group=2, variants=False, mask=None):
        def run():
            num_kv, block = 2, 256
            q = torch.zeros(3, num_kv * group, head_dim, dtype=dtype)
            cache = torch.zeros(8, block, num_kv, head_dim, dtype=cache_dtype)
            tables = torch.zeros(3, 4, dtype=torch.int32)
            lens = torch.tensor([1, 300, 900], dtype=torch.int32)
            masked = dict(mask or {})
            if masked.get("sinks"):  # sinks=True: one float32 logit a query head
                masked["sinks"] = torch.zeros(num_kv * group, dtype=torch.float32)
            paged_decode_attention(q, cache, cache, tables, lens, 1024, 0.1, num_splits=1, **masked)
            paged_decode_attention(q, cache, cache, tables, lens, 1024, 0.1, num_splits=4, **masked)
            if variants:  # the decode variants benchmarks/tools/decode_variants.py measures on a GPU
                for tile_n, warps, stages in ((32, 2, 2), (128, 8, 3), (256, 8, 2)):
                    paged_decode_attention(q, cache, cache, tables, lens, 1024, 0.1, num_splits=1, tile_n=tile_n,
                                           num_warps=warps, num_stages=stages)  # fmt: skip
                paged_decode_attention(q, cache, cache, tables, lens, 1024, 0.1, num_splits=4, split_by_seq_len=True)
            starts = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
            paged_prefill_attention(q, cache, cache, tables, lens, starts, 1, 0.1, **masked)
            key = torch.zeros(3, num_kv, head_dim, dtype=dtype)
            store_kvcache(key, key, cache, cache, torch.tensor([0, -1, 5]))

        return run

    def small_ops(dtype):
        def run():
            x = torch.zeros(4, 1024, dtype=dtype)
            weight = torch.ones(1024, dtype=dtype)
            fused_ops.rms_norm(x, weight, 1e-6)
            fused_ops.rms_norm(x, weight, 1e-6, x.clone())
            fused_ops.rms_norm(torch.zeros(4, 16, 128, dtype=dtype), torch.ones(128, dtype=dtype), 1e-6)
            fused_ops.silu_and_mul(torch.zeros(4, 2 * 3072, dtype=dtype))
            table = torch.zeros(64, 128)
            qkv = torch.zeros(4, 20 * 128, dtype=dtype)
            q, k = qkv[:, : 16 * 128].view(4, 16, 128), qkv[:, 16 * 128 : 18 * 128].view(4, 2, 128)
            fused_ops.rotary_embedding(torch.zeros(4, dtype=torch.long), q, k, table, table)

        return run

    def experts(dtype, config, activations=("silu", "gelu_tanh", "swigluoai")):
        # Qwen3-MoE's shape (E 128, k 8, H 2048, I 768); gpt-oss's clamped SwiGLU with its biases
        def run():
            from nanoinfer.platforms.cuda.kernels.fused_moe import fused_moe as moe

            num_experts, hidden, intermediate = 128, 2048, 768
            x = torch.zeros(4, hidden, dtype=dtype)
            w13 = torch.zeros(num_experts, 2 * intermediate, hidden, dtype=dtype)
            w2 = torch.zeros(num_experts, hidden, intermediate, dtype=dtype)
            topk_weights, topk_ids = torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.long)
            for activation in activations:
                biases = {}
                if activation == "swigluoai":
                    biases = dict(w13_bias=torch.zeros(num_experts, 2 * intermediate, dtype=dtype),
                                  w2_bias=torch.zeros(num_experts, hidden, dtype=dtype))  # fmt: skip
                moe(x, w13, w2, topk_weights, topk_ids, activation=activation, config=config, **biases)

        return run

    # --- gated delta (linear attention) ---------------------------------------------------------------------
    def linear_attention(dtype, max_query_len):
        # Qwen3-Next's shape: H_k 16, H_v 32, D_k = D_v = 128, conv over q, k and v (8192 channels), K 4; q, k and
        # v are views of the conv's output, as the model passes them
        def run():
            from types import SimpleNamespace

            from nanoinfer.platforms.cuda.kernels.gated_delta import causal_conv1d, fused_recurrent_gated_delta_rule

            num_seqs, channels = 3, 2 * 16 * 128 + 32 * 128
            metadata = SimpleNamespace(
                query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32) * max_query_len,
                seq_lens=torch.full((num_seqs,), 9, dtype=torch.int32),
                state_slots=torch.tensor([0, -1, 2], dtype=torch.int32), max_query_len=max_query_len)
            tokens = num_seqs * max_query_len
            x = causal_conv1d(torch.zeros(tokens, channels, dtype=dtype), torch.zeros(channels, 4, dtype=dtype),
                              torch.zeros(4, channels, 3, dtype=dtype), metadata)  # fmt: skip
            q, k, v = x.split([16 * 128, 16 * 128, 32 * 128], dim=-1)
            q, k, v = q.view(tokens, 16, 128), k.view(tokens, 16, 128), v.view(tokens, 32, 128)
            g, beta = torch.zeros(tokens, 32), torch.zeros(tokens, 32, dtype=dtype)
            fused_recurrent_gated_delta_rule(q, k, v, g, beta, torch.zeros(4, 32, 128, 128), metadata,
                                             torch.empty(v.shape, dtype=dtype))  # fmt: skip

        return run

    gated_delta_cases = {
        "linear attention bf16, decode": linear_attention(torch.bfloat16, 1),
        "linear attention bf16, prefill": linear_attention(torch.bfloat16, 100),
        "linear attention fp16, decode": linear_attention(torch.float16, 1),
        "linear attention fp32, decode": linear_attention(torch.float32, 1),
        "linear attention fp32, prefill": linear_attention(torch.float32, 100),
    }
    # --- end gated delta -------------------------------------------------------------------------------------

    # --- lora (batched multi-LoRA) ---------------------------------------------------------------------------
    def lora(dtype, num_rows, rank):
        # Qwen3-8B's adapted projections: qkv (S 3 uneven: 4096, 1024, 1024), gate_up (S 2: 12288 each) and down
        # (K 12288); 4 slots, rows interleaving two adapters and the base model. num_rows > 128: prefill tiles.
        def run():
            from nanoinfer.platforms.cuda.kernels.lora import add_lora

            num_slots, hidden = 4, 4096
            row_slots = torch.tensor([0, -1, 3], dtype=torch.int32).repeat(num_rows)[:num_rows]
            for offsets, k_in in (((0, 4096, 5120, 6144), hidden), ((0, 12288, 24576), hidden), ((0, hidden), 12288)):
                n_out, num_slices = offsets[-1], len(offsets) - 1
                add_lora(torch.empty(num_rows, n_out, dtype=dtype), torch.empty(num_rows, k_in, dtype=dtype),
                         torch.empty(num_slots, num_slices * rank, k_in, dtype=dtype),
                         torch.empty(num_slots, rank, n_out, dtype=dtype), row_slots, offsets)  # fmt: skip

        return run

    lora_cases = {
        "lora bf16 rank 8, decode tiles": lora(torch.bfloat16, 4, 8),
        "lora bf16 rank 64, decode tiles": lora(torch.bfloat16, 4, 64),
        "lora bf16 rank 8, prefill tiles": lora(torch.bfloat16, 512, 8),
        "lora bf16 rank 64, prefill tiles": lora(torch.bfloat16, 512, 64),
        "lora fp16 rank 16, decode tiles": lora(torch.float16, 4, 16),
        "lora fp32 rank 16, decode tiles": lora(torch.float32, 4, 16),
        "lora fp32 rank 16, prefill tiles": lora(torch.float32, 512, 16),
    }
    # --- end lora --------------------------------------------------------------------------------------------

    from nanoinfer.platforms.cuda.kernels.fused_moe import DECODE_CONFIG, PREFILL_CONFIG

    return {
        "attention bf16": attention(torch.bfloat16, torch.bfloat16, variants=True),
        "attention bf16 over an fp8 e4m3 cache": attention(torch.bfloat16, torch.float8_e4m3fn, variants=True),
        "attention fp16 over an fp8 e4m3 cache": attention(torch.float16, torch.float8_e4m3fn),
        "attention bf16 over an fp8 e5m2 cache": attention(torch.bfloat16, torch.float8_e5m2),
        "attention fp32 over an fp8 e4m3 cache": attention(torch.float32, torch.float8_e4m3fn),
        "attention fp16 head_dim 64, GQA 4": attention(torch.float16, torch.float16, head_dim=64, group=4),
        "attention fp32": attention(torch.float32, torch.float32),
        "attention fp32 over a bf16 cache": attention(torch.float32, torch.bfloat16),
        "attention bf16 over an fp32 cache": attention(torch.bfloat16, torch.float32),
        "attention bf16, sliding window and soft cap": attention(torch.bfloat16, torch.bfloat16,
                                                                 mask=dict(sliding_window=512, soft_cap=50.0)),
        "attention bf16, sliding window": attention(torch.bfloat16, torch.bfloat16, mask=dict(sliding_window=512)),
        "attention bf16 head_dim 256 (Gemma), sliding window": attention(torch.bfloat16, torch.bfloat16, head_dim=256,
                                                                          group=4, mask=dict(sliding_window=512)),
        "attention bf16 head_dim 64, GQA 8 (gpt-oss), sliding window and sinks": attention(
            torch.bfloat16, torch.bfloat16, head_dim=64, group=8, mask=dict(sliding_window=128, sinks=True)),
        "attention bf16 head_dim 64, GQA 8 (gpt-oss), sinks": attention(torch.bfloat16, torch.bfloat16, head_dim=64,
                                                                        group=8, mask=dict(sinks=True)),
        "attention bf16 head_dim 512 (Gemma 4's global layers)": attention(torch.bfloat16, torch.bfloat16,
                                                                            head_dim=512, group=8),
        "small ops bf16": small_ops(torch.bfloat16),
        "small ops fp16": small_ops(torch.float16),
        "experts bf16, decode tiles": experts(torch.bfloat16, DECODE_CONFIG),
        "experts bf16, prefill tiles": experts(torch.bfloat16, PREFILL_CONFIG),
        "experts fp16, decode tiles": experts(torch.float16, DECODE_CONFIG),
        "experts fp16, prefill tiles": experts(torch.float16, PREFILL_CONFIG),
        "experts fp32, decode tiles": experts(torch.float32, DECODE_CONFIG, activations=("silu",)),
        **gated_delta_cases,
        **lora_cases,
    }


def compile_all(arch: int = 90) -> list[tuple[str, str, str | None, str]]:
    """(case, kernel name, None or the error, resource usage) for every recorded launch, compiled for sm_<arch>:
    the usage line gives registers, stack and local memory (spills) and shared memory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")
    target = GPUTarget("cuda", arch, 32)
    results, seen = [], set()
    for case, kernel, args, kwargs in record_launches():
        signature, constexprs = signature_of(kernel, args, kwargs)
        options = {k: kwargs[k] for k in _LAUNCH_OPTIONS if k in kwargs}
        key = (kernel.fn.__name__, tuple(signature.items()), tuple(sorted(constexprs.items())),
               tuple(sorted(options.items())))  # fmt: skip
        if key in seen:
            continue
        seen.add(key)
        try:
            compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=target, options=options)
        except Exception as e:  # report every kernel, not only the first failure
            results.append((case, kernel.fn.__name__, f"{type(e).__name__}: {e}", ""))
            continue
        results.append((case, kernel.fn.__name__, None, _resource_usage(compiled)))
    return results


def _resource_usage(compiled) -> str:
    """Registers, stack (spills) and shared memory of a compiled kernel, read from its cubin with the cuobjdump
    in Triton's wheel (no GPU to load it on); empty when that tool is missing."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.is_file():
        return ""
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        dump = subprocess.run([str(tool), "--dump-resource-usage", str(cubin)], capture_output=True, text=True).stdout
    usage = dict(re.findall(r"\b(REG|STACK|LOCAL):(\d+)", dump))
    return (f"{usage.get('REG', '?')} registers, {usage.get('STACK', '?')} B stack, "
            f"{usage.get('LOCAL', '?')} B local, {compiled.metadata.shared} B shared")  # fmt: skip


def main() -> int:
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns unless the default is explicit
    results = compile_all(int(sys.argv[1]) if len(sys.argv) > 1 else 90)
    for case, name, error, facts in results:
        detail = f" ({facts})" if error is None else f"\n{error}"
        print(f"{'ok  ' if error is None else 'FAIL'} {case}: {name}{detail}")
    failed = sum(error is not None for _, _, error, _ in results)
    print(f"{len(results) - failed} compiled, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
