"""Every Triton kernel, with the arguments our launchers pass (each dtype pairing the engine uses), compiles for
an H100/H200 (sm_90) on this GPU-less machine, through the ptxas in Triton's wheel. The interpreter tests
check what the kernels compute but not that the compiler takes them: a float32 x bfloat16 tl.dot, for one,
runs in the interpreter and fails to compile (without the widening in paged_attention.py this test failed on
6 of its then 33 launches). The launches include the fp8 caches (e4m3 and e5m2 under bfloat16, float16 and
float32 queries) and the decode variants benchmarks/tools/decode_variants.py measures on a GPU.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed: pip install -e '.[dev]'")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.is_file() and shutil.which("ptxas") is None, reason="no ptxas in this Triton")
def test_every_kernel_launch_compiles_for_sm90():
    # A fresh process without TRITON_INTERPRET: this test session's kernels are the interpreter's.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "nanoinfer.testing.triton_compile", "90"], env=env,
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "134 compiled, 0 failed" in result.stdout, result.stdout
    assert "fp8 e4m3 cache: _store_kvcache_kernel" in result.stdout and "fp8 e5m2 cache: _paged_decode" in result.stdout
    assert "experts bf16, decode tiles: _moe_gemm_kernel" in result.stdout  # the fused-MoE path (27 of the launches)
    # gated delta: linear attention's conv (decode and prefill tiles) and recurrent step (8 of the launches)
    assert "linear attention bf16, prefill: _causal_conv1d_kernel" in result.stdout
    assert "linear attention bf16, decode: _fused_recurrent_gated_delta_rule_kernel" in result.stdout
    # lora: batched multi-LoRA's shrink and expand, decode and prefill tiles, ranks 8 to 64 (16 of the launches)
    assert "lora bf16 rank 64, prefill tiles: _lora_shrink_kernel" in result.stdout
    assert "lora bf16 rank 8, decode tiles: _lora_expand_kernel" in result.stdout
