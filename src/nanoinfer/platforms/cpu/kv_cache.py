"""The CPU KV cache: allocated untouched on ordinary 4 KiB pages, each block committed whole at its first write.

A 4 GiB budget then costs neither a 4 GiB memset at start-up nor 4 GiB of resident memory for a small job (the
planner already checked the budget against available RAM). Not the weights' 2 MiB pages (csrc/huge_pages.cpp):
a huge page is committed whole at its first write, which made decode slower (benchmarks/README.md).
"""

from __future__ import annotations

import math
import mmap

import torch

from nanoinfer.platforms.interface import KVCache


class LazyKVCache(KVCache):
    def __init__(self, shapes: list[tuple[int, ...]], dtype: torch.dtype):
        super().__init__([(on_ordinary_pages(shape, dtype), on_ordinary_pages(shape, dtype))
                          for shape in shapes])  # fmt: skip
        self.committed = torch.zeros(shapes[0][0], dtype=torch.bool)  # which blocks' memory the OS has committed
        self.block_size = shapes[0][1]

    def before_step(self, slot_mapping: torch.Tensor) -> None:
        self.commit_new_blocks(slot_mapping)

    def commit_new_blocks(self, slot_mapping: torch.Tensor) -> None:
        """Zero, whole, the blocks this step writes into for the first time, before the step stores into them
        (each tensor-parallel rank for its own shard).

        Otherwise the OS commits them a 4 KiB page at a time inside the step's kernels, as decode writes one row a
        sequence a layer into fresh pages; committing ahead was faster or level (benchmarks/README.md). A whole
        block is committed even where its sequence ends early: the planner counted every block anyway."""
        blocks = torch.unique(slot_mapping[slot_mapping >= 0] // self.block_size)
        fresh = blocks[~self.committed[blocks]]
        if fresh.numel() == 0:
            return
        self.committed[fresh] = True
        # Runs of consecutive ids (fresh blocks mostly come in order), each zeroed as one memset on all threads,
        # several times faster than index_fill_.
        ids = fresh.tolist()
        run_start = 0
        for i in range(1, len(ids) + 1):
            if i == len(ids) or ids[i] != ids[i - 1] + 1:
                first, last = ids[run_start], ids[i - 1]
                for k_cache, v_cache in self.layers:
                    k_cache[first : last + 1].zero_()
                    v_cache[first : last + 1].zero_()
                run_start = i


def on_ordinary_pages(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uncommitted CPU tensor on 4 KiB pages whatever the heap's history: its own mapping, MADV_NOHUGEPAGE.
    torch.empty would take freed heap memory, which may carry another library's MADV_HUGEPAGE (numpy asks it for
    large arrays, e.g. transformers' GGUF dequantization in the same process)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0 or not hasattr(mmap, "MADV_NOHUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes)  # zero pages, committed at their first write (commit_new_blocks)
    mapping.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(mapping, dtype=dtype).view(shape)  # the tensor keeps the mapping alive
