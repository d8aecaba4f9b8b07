"""Kernel tests run the Triton kernels in Triton's interpreter on CPU, so CI checks them without a GPU.

TRITON_INTERPRET must be set before the kernels are first imported, hence at import time here; it then holds
for the whole pytest process. On a CUDA machine, run with TRITON_INTERPRET=0 to check the same tests against
the compiled kernels (and to keep the interpreter away from other GPU tests in the same run).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import functools
import itertools
from dataclasses import dataclass

import pytest
import torch

from nanoinfer.attention.metadata import AttentionMetadata


@pytest.fixture(scope="session")
def device() -> str:
    """cpu under the interpreter, else cuda (skipped without one)."""
    if os.environ["TRITON_INTERPRET"] == "1":
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 compiles the kernels, which needs a CUDA device")
    return "cuda"


class NoLaunch:
    """A kernel stand-in that launches nothing: kernel[grid](...) only counts."""

    def __init__(self):
        self.launches = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches += 1

        return launch


@pytest.fixture
def no_launch(monkeypatch):
    """replace(module, names) puts a NoLaunch in place of each named kernel of module and returns them by name: a
    launcher run on the meta device then shows it reads no value back to the host (a CUDA graph can capture it)."""

    def replace(module, names) -> dict[str, NoLaunch]:
        stand_ins = {name: NoLaunch() for name in names}
        for name, stand_in in stand_ins.items():
            monkeypatch.setattr(module, name, stand_in)
        return stand_ins

    return replace


@dataclass
class PagedBatch:
    """One step's inputs: new tokens' query/key/value, a randomly filled paged cache, and the metadata."""

    query: torch.Tensor  # [num_tokens, H_q, D]
    key: torch.Tensor  # [num_tokens, H_kv, D]
    value: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, H_kv, D]
    v_cache: torch.Tensor
    metadata: AttentionMetadata


def make_paged_batch(
    specs: list[tuple[int, int]], *, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0, cache_dtype: torch.dtype | None = None,
) -> PagedBatch:
    """specs: (num_cached_tokens, query_len) per sequence. Blocks are handed out in a shuffled order so a
    kernel that assumes contiguous or ordered block ids reads the wrong keys. cache_dtype (default: dtype)
    is the caches' dtype, as kv_cache_dtype sets it."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [cached + query_len for cached, query_len in specs]
    blocks_per_seq = [-(-seq_len // block_size) for seq_len in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2  # two blocks nobody owns
    free = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq)
    tables, slots = [], []
    for (cached, query_len), n in zip(specs, blocks_per_seq):
        table = [free.pop() for _ in range(n)]
        slots += [table[pos // block_size] * block_size + pos % block_size for pos in range(cached, cached + query_len)]
        tables.append(table + [0] * (max_blocks - n))  # padded with 0, as the model runner does
    query_lens = [query_len for _, query_len in specs]
    num_tokens = sum(query_lens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
    return PagedBatch(
        query=randn(num_tokens, num_heads, head_dim),
        key=randn(num_tokens, num_kv_heads, head_dim),
        value=randn(num_tokens, num_kv_heads, head_dim),
        k_cache=randn(num_blocks, block_size, num_kv_heads, head_dim).to(cache_dtype or dtype),
        v_cache=randn(num_blocks, block_size, num_kv_heads, head_dim).to(cache_dtype or dtype),
        metadata=metadata,
    )


@pytest.fixture
def paged_batch(device):
    """make_paged_batch on the test device."""
    return functools.partial(make_paged_batch, device=device)
