"""SchedulerOutput -> batch tensors + AttentionMetadata -> model forward -> sampled token ids.

Owns the model and the KV cache (one (k, v) pair per layer, [num_blocks, block_size, H_kv, D]).
Only sequences whose step reaches their last token are sampled; a prefill chunk that stops short
contributes KV to the cache and nothing else.
"""

from __future__ import annotations

import math
import mmap

import torch

from nanoinfer import memory
from nanoinfer.attention.backend import get_backend
from nanoinfer.attention.metadata import AttentionMetadata
from nanoinfer.engine.scheduler import SchedulerOutput
from nanoinfer.engine.sequence import Sequence
from nanoinfer.model.decoder import CausalLM, head_dim_of
from nanoinfer.model.layers import enable_triton_small_ops
from nanoinfer.model.loader import load_weights
from nanoinfer.model.sampler import Sampler
from nanoinfer.platforms.cpu.linear import prepack_linear_weights
from nanoinfer.platforms.cpu.ops import cpu_ops
from nanoinfer.platforms.cuda.cuda_graph import CUDAGraphCapturer, CUDAGraphRunner, graph_batch_sizes

# Config's dtype and kv_cache_dtype names (config.DTYPES, config.KV_CACHE_DTYPES, resolved) -> torch dtypes.
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TORCH_KV_CACHE_DTYPES = {**TORCH_DTYPES, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def max_num_sampled_rows(config) -> int:
    """memory.max_sampled_rows for a Config: sizes the CUDA graphs' batch buckets and the warm-up's logits."""
    return memory.max_sampled_rows(config.max_num_batched_tokens, config.max_num_seqs, config.num_speculative_tokens)


def group_by_sequence(sample_seqs: list[Sequence], token_ids: list[int]) -> dict[int, list[int]]:
    """One sampled token a row -> seq_id -> its tokens in order (a speculated sequence has several rows)."""
    sampled: dict[int, list[int]] = {}
    for seq, token_id in zip(sample_seqs, token_ids):
        tokens = sampled.get(seq.seq_id)
        if tokens is None:
            sampled[seq.seq_id] = [token_id]
        else:
            tokens.append(token_id)
    return sampled


def _on_ordinary_pages(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uncommitted CPU tensor on 4 KiB pages whatever the heap's history: its own mapping, MADV_NOHUGEPAGE.
    torch.empty would take freed heap memory, which may carry another library's MADV_HUGEPAGE (numpy asks it for
    large arrays, e.g. transformers' GGUF dequantization in the same process)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0 or not hasattr(mmap, "MADV_NOHUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes)  # zero pages, committed at their first write (commit_new_blocks)
    mapping.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(mapping, dtype=dtype).view(shape)  # the tensor keeps the mapping alive


def kv_cache_dtype_of(config) -> torch.dtype:
    """The KV cache's torch dtype (a resolved Config's kv_cache_dtype names it: never auto or fp8)."""
    return TORCH_KV_CACHE_DTYPES[config.kv_cache_dtype]


class ModelRunner:
    def __init__(self, config, num_blocks: int):
        self.config = config
        hf_config = config.hf_config
        self.device = torch.device(config.device)
        self.dtype = TORCH_DTYPES[config.dtype]
        self.kv_cache_dtype = kv_cache_dtype_of(config)
        self.block_size = config.kvcache_block_size
        self.backend = get_backend(config.attention_backend)
        with torch.device("cpu"):
            model = CausalLM(hf_config, self.backend, max_position=max(config.max_model_len, 1))
        load_weights(model, config.model, hf_config)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.model.model.layers[0].self_attn.rotary.to_device(self.device)  # shared by all layers
        if self.device.type == "cpu":
            # Build (first run on a machine, ~2 min) or load the C++ kernels now, as part of loading, rather
            # than inside the first step where it would count as generation time; the packing needs them.
            cpu_ops()
            self.num_packed_weights = prepack_linear_weights(self.model)
        self.triton_small_ops = enable_triton_small_ops(self.device, self.dtype)  # compiled once, before warm-up
        self.sampler = Sampler(config.seed)
        attn = self.model.model.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, head_dim_of(hf_config)
        self.graph_runner: CUDAGraphRunner | None = None
        self.allocate_kv_cache(num_blocks)

    @property
    def uses_cuda_graphs(self) -> bool:
        """Decode through CUDA graphs: on CUDA, unless enforce_eager, with a backend whose kernels capture."""
        config = self.config
        return (self.device.type == "cuda" and not config.enforce_eager and config.tensor_parallel_size == 1
                and self.backend.name in ("triton", "flash-attn"))  # fmt: skip

    def capture_cuda_graphs(self, capturer: CUDAGraphCapturer | None = None) -> None:
        """Capture the decode graphs over the current KV cache (call again after reallocating it)."""
        self.graph_runner = CUDAGraphRunner(
            lambda input_ids, positions, metadata: self.model(input_ids, positions, self.kv_caches, metadata),
            batch_sizes=graph_batch_sizes(max_num_sampled_rows(self.config)), max_model_len=self.config.max_model_len,
            block_size=self.block_size, hidden_size=self.config.hf_config.hidden_size, dtype=self.dtype,
            device=self.device, capturer=capturer,
        )  # fmt: skip
        self.graph_runner.capture()

    def release_cuda_graphs(self) -> None:
        self.graph_runner = None  # the graphs' memory pool goes with them

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.graph_runner = None  # captured graphs point at the old cache
        self.kv_caches = []  # drop the old cache before allocating the new one
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.num_blocks = num_blocks
        # CPU: which blocks' memory the OS has committed (commit_new_blocks); None on CUDA (zeroed up front).
        self.committed = torch.zeros(num_blocks, dtype=torch.bool) if self.device.type == "cpu" else None
        # On CPU the cache's pages are committed only as blocks are first written (torch.empty's untouched
        # memory, then commit_new_blocks), so a 4 GiB budget costs neither a 4 GiB memset at start-up nor 4 GiB
        # of resident memory for a small job (the planner already checked the budget against available RAM).
        # Every backend reads only slots below a sequence's length, which were written first.
        self.kv_caches = [
            tuple(self._allocate_cache_tensor(shape) for _ in range(2))
            for _ in range(self.config.hf_config.num_hidden_layers)
        ]

    def _allocate_cache_tensor(self, shape) -> torch.Tensor:
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
        # Ordinary 4 KiB pages, committed a block at a time (commit_new_blocks), not the weights' 2 MiB pages
        # (csrc/huge_pages.cpp): a huge page is committed whole at its first write, which made decode slower
        # where it was measured (benchmarks/README.md, seventeenth round).
        return _on_ordinary_pages(shape, self.kv_cache_dtype)

    def commit_new_blocks(self, slot_mapping: torch.Tensor) -> None:
        """Commit the memory of the blocks this step writes into for the first time, whole, before the
        step stores into them (CPU caches only; each tensor-parallel rank calls this for its own shard).

        Why: the cache is allocated untouched, so otherwise the OS commits it a 4 KiB page at a time inside
        the step's kernels, as decode writes one row a sequence a layer into fresh pages; committing ahead
        was faster or level (benchmarks/README.md, twenty-first round). A whole block is committed even where
        its sequence ends early: at most one partial block per sequence, and the planner counted every block
        against the memory budget anyway."""
        if self.committed is None:
            return
        blocks = torch.unique(slot_mapping[slot_mapping >= 0] // self.block_size)
        fresh = blocks[~self.committed[blocks]]
        if fresh.numel() == 0:
            return
        self.committed[fresh] = True
        # Runs of consecutive ids (fresh blocks mostly come in order), each zeroed as one memset on all
        # threads: index_fill_ wrote ~4.5 GB/s here, a run's zero_() ~3x that.
        ids = fresh.tolist()
        run_start = 0
        for i in range(1, len(ids) + 1):
            if i == len(ids) or ids[i] != ids[i - 1] + 1:
                first, last = ids[run_start], ids[i - 1]
                for k_cache, v_cache in self.kv_caches:
                    k_cache[first : last + 1].zero_()
                    v_cache[first : last + 1].zero_()
                run_start = i

    def run_model(self, input_ids, positions, metadata: AttentionMetadata, logits_indices=None) -> torch.Tensor:
        """The model's forward pass over this runner's cache (every rank's, eager): the final hidden states
        of every row, or of the rows in logits_indices (the model then skips the others' last-layer work)."""
        self.commit_new_blocks(metadata.slot_mapping)
        return self.model(input_ids, positions, self.kv_caches, metadata, logits_indices)

    @torch.inference_mode()
    def warmup(self) -> None:
        """One forward pass at max_num_batched_tokens (split over up to max_num_seqs sequences) to find the
        activation peak, and the logits of every row a step can sample. Needs a cache of at least
        max_num_batched_tokens tokens."""
        num_seqs = self.warmup_batch()
        rows = max_num_sampled_rows(self.config)
        if rows > num_seqs:
            # Speculation samples more rows than sequences: their logits, and the float32 copy a mixed batch's
            # sampler makes, are part of the peak the warm-up measures.
            hidden = torch.zeros(rows, self.config.hf_config.hidden_size, dtype=self.dtype, device=self.device)
            self.model.compute_logits(hidden).float()

    @torch.inference_mode()
    def warmup_batch(self) -> int:
        """The warm-up's forward pass (through self.execute); returns how many sequences it sampled."""
        from nanoinfer.engine.sequence import Request
        from nanoinfer.sampling_params import SamplingParams

        config = self.config
        num_tokens = min(config.max_num_batched_tokens, (self.num_blocks - 1) * self.block_size)
        # Enough sequences that none is longer than max_model_len - 1 (the rotary table's end).
        num_seqs = min(config.max_num_seqs, max(1, -(-num_tokens // max(config.max_model_len - 1, 1))))
        per_seq = min(num_tokens // num_seqs, config.max_model_len - 1)
        out = SchedulerOutput()
        next_block = 0
        for i in range(num_seqs):
            seq = Request(f"warmup-{i}", [0] * per_seq, SamplingParams(max_tokens=1)).sequences[0]
            num_blocks = -(-per_seq // self.block_size)
            seq.block_table = list(range(next_block, next_block + num_blocks))
            next_block += num_blocks
            out.scheduled.append((seq, per_seq))
        self.execute(out)
        return num_seqs

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[int, list[int]]:
        """Run one step; returns seq_id -> the token ids sampled for the sequences that reached their end
        (one each, or one per scheduled token of a speculated sequence)."""
        input_ids, positions, metadata, sample_indices, sample_seqs = self.prepare_inputs(out)
        self.sampler.prepare(sample_seqs, self.config.hf_config.vocab_size)  # grammar bitmasks, during forward
        hidden_states = self._forward(input_ids, positions, metadata, sample_indices)
        if not sample_seqs:
            return {}
        lm_head = self.model.lm_head
        if lm_head.has_greedy_kernel and all(s.params.is_plain_greedy for s in sample_seqs):
            return group_by_sequence(sample_seqs, lm_head.greedy_token_ids(hidden_states).tolist())
        logits = self.model.compute_logits(hidden_states)
        return group_by_sequence(sample_seqs, self.sampler(logits, sample_seqs))

    @torch.inference_mode()
    def compute_logits(self, out: SchedulerOutput) -> torch.Tensor:
        """Logits of the sequences that reach their end this step (for tests against transformers)."""
        input_ids, positions, metadata, sample_indices, _ = self.prepare_inputs(out)
        hidden_states = self._forward(input_ids, positions, metadata, sample_indices)
        return self.model.compute_logits(hidden_states).float()

    def _forward(self, input_ids, positions, metadata: AttentionMetadata, sample_indices) -> torch.Tensor:
        """The final hidden states of the rows in sample_indices, in that order."""
        if self.graph_runner is not None and self.graph_runner.can_run(metadata):
            return self.graph_runner.run(input_ids, positions, metadata)[sample_indices]
        return self.run_model(input_ids, positions, metadata, sample_indices)

    def prepare_inputs(self, out: SchedulerOutput):
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sample_indices: list[int] = []
        sample_seqs: list[Sequence] = []
        tables: list[list[int]] = []
        bs = self.block_size
        max_blocks = 0
        # Host work is paid on every step, before the GPU gets anything to do: plain list appends, a decode
        # row without the block loop, one tensor per field (the block tables were one tensor per sequence).
        for seq, num_new in out.scheduled:
            start = seq.num_computed_tokens
            end = start + num_new
            table = seq.block_table
            if seq.spec_token_ids:
                # A speculated sequence: its last token and the proposed ones, each laid out as a decode row of
                # its own (query length 1, the context up to and including it). Every backend's decode kernel
                # then verifies them, the fused CPU decode loop included; this step's rows are stored in the
                # cache before any row attends, so each sees the proposed tokens before it.
                tokens = [seq.token_ids[start], *seq.spec_token_ids]
                for i, token in enumerate(tokens):
                    pos = start + i
                    input_ids.append(token)
                    positions.append(pos)
                    slot_mapping.append(table[pos // bs] * bs + pos % bs)
                    query_lens.append(1)
                    seq_lens.append(pos + 1)
                    tables.append(table)
                    sample_indices.append(len(input_ids) - 1)
                    sample_seqs.append(seq)
                if len(table) > max_blocks:
                    max_blocks = len(table)
                continue
            if num_new == 1:
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slot_mapping.append(table[start // bs] * bs + start % bs)
            else:
                input_ids += seq.token_ids[start:end]
                positions += range(start, end)
                for block_index in range(start // bs, (end - 1) // bs + 1):
                    block_start = block_index * bs
                    lo, hi = max(start, block_start), min(end, block_start + bs)
                    base = table[block_index] * bs - block_start
                    slot_mapping += range(base + lo, base + hi)
            query_lens.append(num_new)
            seq_lens.append(end)
            tables.append(table)
            if len(table) > max_blocks:
                max_blocks = len(table)
            if end == seq.num_tokens:
                sample_indices.append(len(input_ids) - 1)
                sample_seqs.append(seq)
        padding = [0] * max_blocks
        block_tables = torch.tensor([t + padding[len(t) :] for t in tables], dtype=torch.int32)
        block_tables = block_tables.view(len(tables), max_blocks)  # [n, 0] when no sequence has a block yet
        query_start_loc = [0]
        for q in query_lens:
            query_start_loc.append(query_start_loc[-1] + q)
        dev = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=block_tables.to(dev),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        return (
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            metadata,
            torch.tensor(sample_indices, dtype=torch.long, device=dev),
            sample_seqs,
        )
