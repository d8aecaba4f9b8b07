"""The CPU KV cache's memory (engine/host_memory.py): huge-page mappings where Linux grants them, torch.empty
otherwise, with the same tensor either way."""

from __future__ import annotations

import gc
import sys

import pytest
import torch

from nanoinfer.engine import host_memory
from nanoinfer.engine.host_memory import HUGE_PAGE, empty_huge_pages


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_tensors_have_the_shape_and_dtype_asked_and_hold_what_is_written(dtype):
    shape = (5, 256, 3, 64)
    a, b = empty_huge_pages(shape, dtype), empty_huge_pages(shape, dtype)
    assert a.shape == shape and a.dtype == dtype and a.is_contiguous() and a.device.type == "cpu"
    a.view(torch.uint8).fill_(1)
    b.view(torch.uint8).fill_(2)  # separate memory: writing b leaves a alone
    assert int(a.view(torch.uint8).sum()) == a.numel() * dtype.itemsize


def test_a_view_keeps_the_mapping_alive_after_its_base_is_dropped():
    cache = empty_huge_pages((8, 256, 3, 64), torch.float32)
    cache.fill_(3.0)
    block = cache[2]
    del cache
    gc.collect()
    assert float(block.sum()) == 3.0 * block.numel()


@pytest.mark.skipif(sys.platform != "linux", reason="anonymous mappings with madvise: Linux")
def test_on_linux_the_tensor_starts_on_a_huge_page_boundary():
    try:
        t = host_memory._huge_page_tensor((1024, 1024), torch.float32, 4 << 20)
    except OSError as e:  # a kernel without transparent huge pages refuses the advice
        pytest.skip(f"madvise(MADV_HUGEPAGE) refused here: {e}")
    assert t.data_ptr() % HUGE_PAGE == 0
    t.fill_(1.0)
    assert float(t.sum()) == 1024 * 1024


def test_falls_back_to_torch_empty_when_the_mapping_fails(monkeypatch):
    def refuse(*args):
        raise OSError(22, "madvise(MADV_HUGEPAGE) failed")

    monkeypatch.setattr(host_memory, "_huge_page_tensor", refuse)
    t = empty_huge_pages((3, 4), torch.float32)
    t.fill_(1.0)
    assert t.shape == (3, 4) and float(t.sum()) == 12.0


def test_the_environment_switch_and_empty_shapes_take_torch_empty(monkeypatch):
    calls = []
    monkeypatch.setattr(host_memory, "_huge_page_tensor", lambda *a: calls.append(a))
    assert empty_huge_pages((0, 5), torch.float32).shape == (0, 5)
    monkeypatch.setenv("NANOINFER_DISABLE_HUGEPAGES", "1")
    assert empty_huge_pages((2, 5), torch.float32).shape == (2, 5)
    assert calls == []
