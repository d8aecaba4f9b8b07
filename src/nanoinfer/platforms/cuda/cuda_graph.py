"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket (nano-vllm's and vLLM's scheme).

A decode step of a small model is bound by kernel launches, not by the GPU: about a dozen kernels per
layer, each a few microseconds of work. Capturing the whole forward pass once per batch size and
replaying it costs one launch per step. A graph replays fixed device addresses, so the step's inputs
are copied into static buffers the graph was captured on, and a batch of n sequences runs the graph of
the smallest bucket >= n with the extra rows padded:
- padded rows write nothing: slot_mapping = -1 (store_kvcache skips it), whatever ran there before;
- padded rows attend over one cache slot of block 0 (seq_len 1) and their outputs are dropped;
- a hybrid model's padded rows have state slot -1: its linear-attention kernels read and write nothing for them;
- the attention kernels' launch grids depend only on the row count and max_seq_len, which is fixed at
  max_model_len when capturing (kernels.paged_attention's decode kernel is written for this).
All buckets share one memory pool (captured largest first), so graphs cost about one decode step's
activations; the engine measures that before sizing the KV cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanoinfer.attention.metadata import AttentionMetadata

MAX_GRAPH_BATCH_SIZE = 512


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16 up to min(max_num_seqs, 512), which is always included."""
    limit = max(1, min(max_num_seqs, MAX_GRAPH_BATCH_SIZE))
    sizes = [s for s in (1, 2, 4, 8) if s <= limit] + list(range(16, limit + 1, 16))
    if sizes[-1] != limit:
        sizes.append(limit)  # so that every batch the scheduler can form has a graph
    return sizes


class CUDAGraphCapturer:
    """torch.cuda.CUDAGraph behind a two-call surface, so the runner's buffer logic is testable on CPU."""

    def capture(self, fn: Callable[[], None], pool) -> tuple[Callable[[], None], object]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            fn()
        return graph.replay, graph.pool()

    def synchronize(self) -> None:
        torch.cuda.synchronize()


class CUDAGraphRunner:
    """Static input buffers + one captured forward pass per bucket; run() replays the right one."""

    def __init__(self, forward: Callable, *, batch_sizes: list[int], max_model_len: int, block_size: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device,
                 capturer: CUDAGraphCapturer | None = None, uses_state_slots: bool = False):  # fmt: skip
        """forward(input_ids, positions, metadata) -> hidden states [num_tokens, hidden_size]. uses_state_slots: the
        model has linear-attention layers (metadata.state_slots)."""
        self.forward = forward
        self.batch_sizes = sorted(batch_sizes)
        self.max_batch_size = self.batch_sizes[-1]
        self.max_model_len = max_model_len
        self.capturer = capturer or CUDAGraphCapturer()
        n, width = self.max_batch_size, -(-max_model_len // block_size)
        zeros = dict(device=device)
        self.input_ids = torch.zeros(n, dtype=torch.long, **zeros)
        self.positions = torch.zeros(n, dtype=torch.long, **zeros)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, **zeros)
        self.seq_lens = torch.ones(n, dtype=torch.int32, **zeros)
        self.block_tables = torch.zeros(n, width, dtype=torch.int32, **zeros)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, **zeros)  # one query token per row
        self.state_slots = torch.full((n,), -1, dtype=torch.int32, **zeros) if uses_state_slots else None
        self.outputs = torch.zeros(n, hidden_size, dtype=dtype, **zeros)
        self.graphs: dict[int, Callable[[], None]] = {}

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs],
            max_query_len=1, max_seq_len=self.max_model_len,
            state_slots=None if self.state_slots is None else self.state_slots[:bs],
        )  # fmt: skip

    def _step_fn(self, bs: int) -> Callable[[], None]:
        metadata = self._metadata(bs)

        def step() -> None:
            self.outputs[:bs] = self.forward(self.input_ids[:bs], self.positions[:bs], metadata)

        return step

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so the smaller ones reuse its memory pool."""
        pool = None
        for bs in reversed(self.batch_sizes):
            step = self._step_fn(bs)
            step()  # compiles/autotunes the kernels outside the capture (Triton JIT cannot run inside it)
            self.capturer.synchronize()
            self.graphs[bs], pool = self.capturer.capture(step, pool)
        self.capturer.synchronize()

    def can_run(self, metadata: AttentionMetadata) -> bool:
        return bool(self.graphs) and metadata.max_query_len == 1 and metadata.num_seqs <= self.max_batch_size

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states of a pure-decode step of n <= max_batch_size sequences (a view of `outputs`)."""
        n = metadata.num_seqs
        bs = next(size for size in self.batch_sizes if size >= n)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = metadata.slot_mapping
        self.slot_mapping[n:bs] = -1  # padded rows must not overwrite a previous step's cache slots
        self.seq_lens[:n] = metadata.seq_lens
        self.seq_lens[n:bs] = 1
        width = metadata.block_tables.shape[1]
        self.block_tables[:bs] = 0
        self.block_tables[:n, :width] = metadata.block_tables
        if self.state_slots is not None:
            self.state_slots[:n] = metadata.state_slots
            self.state_slots[n:bs] = -1  # padded rows must not touch a running sequence's state
        self.graphs[bs]()
        return self.outputs[:n]
