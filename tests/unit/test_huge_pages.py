"""csrc/huge_pages.cpp: zero-filled tensors on 2 MiB pages (the packed weights use them)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from nanoinfer.platforms.cpu.ops import cpu_ops

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="the CPU kernels could not be built here")

_HUGE = 2 << 20


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def _anon_huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("shape", [[3, 5], [80, 256, 3, 64]])  # 15-60 bytes (torch::zeros); 3.9-15.7 MB (mapped)
def test_zero_filled_with_the_asked_shape_and_dtype(shape, dtype):
    t = cpu_ops().zeros_on_huge_pages(shape, dtype)
    assert list(t.shape) == shape and t.dtype == dtype and t.is_contiguous()
    assert not t.float().any()
    t.view(torch.uint8).fill_(7)  # writable across the whole extent
    assert bool((t.view(torch.uint8) == 7).all())


def test_large_tensors_start_on_a_huge_page_boundary_and_commit_as_written():
    if not sys.platform.startswith("linux"):
        pytest.skip("anonymous mappings with madvise are Linux's")
    before = _resident_bytes()
    t = cpu_ops().zeros_on_huge_pages([1 << 30], torch.uint8)  # 1 GiB, untouched
    assert t.data_ptr() % _HUGE == 0
    assert _resident_bytes() - before < 64 << 20  # not committed until written
    t[: 8 << 20].fill_(1)
    assert _resident_bytes() - before >= 8 << 20
    del t


def test_granted_huge_pages_where_linux_offers_them():
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("transparent huge pages are off here")
    t = cpu_ops().zeros_on_huge_pages([16 << 20], torch.uint8)
    t.fill_(1)
    assert _anon_huge_bytes_at(t.data_ptr()) >= _HUGE


def test_packed_weights_sit_on_huge_page_boundaries_and_the_cpu_kv_cache_on_ordinary_pages(default_model_dir):
    from nanoinfer import LLM, SamplingParams

    llm = LLM(str(default_model_dir), max_model_len=512, cpu_kvcache_space_gib=0.25, max_num_seqs=4)
    runner = llm.engine.model_runner
    caches = [t for pair in runner.kv_caches for t in pair]
    packed = [m.packed_weight.data for m in runner.model.modules() if getattr(m, "packed_weight", None) is not None]
    assert caches and packed
    # Every packed tensor over 2 MiB starts on a huge page (the smaller ones, e.g. a 1.1 MB qkv weight, need not).
    assert all(t.data_ptr() % _HUGE == 0 for t in packed if t.numel() * t.element_size() >= _HUGE)
    assert any(t.numel() * t.element_size() >= _HUGE for t in packed)
    # The cache is not asked for huge pages (platforms/cpu/kv_cache.py says why): where Linux grants them only on
    # request ("madvise", the common setting), none of its layers holds one after a request wrote into it.
    llm.generate([[1, 2, 3] * 20], SamplingParams(max_tokens=8))
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if mode.exists() and "[madvise]" in mode.read_text():
        assert all(_anon_huge_bytes_at(t.data_ptr()) == 0 for t in caches)
