"""SchedulerOutput -> batch tensors + AttentionMetadata -> model forward -> sampled token ids.

Owns the model and the KV cache (one (k, v) pair per layer that owns one, [num_blocks, block_size, H_kv, D]),
a hybrid model's state cache (one (conv_state, ssm_state) pair per linear-attention layer, one slot a sequence),
both made through the process's platform (platforms/, chosen by whoever builds the runner), which also says
whether a fused decode runner takes pure-decode steps.
Only sequences whose step reaches their last token are sampled; a prefill chunk that stops short
contributes KV to the cache and nothing else.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from nanoinfer import memory
from nanoinfer.attention.metadata import AttentionMetadata
from nanoinfer.engine.sampler import PROMPT_LOGPROBS_CHUNK, Sampler, prompt_logprobs
from nanoinfer.engine.scheduler import SchedulerOutput
from nanoinfer.engine.sequence import Sequence
from nanoinfer.lora.manager import WARM_UP_LORA, LoRAManager
from nanoinfer.models import registry
from nanoinfer.models.weights.loader import load_weights
from nanoinfer.platforms import current_platform
from nanoinfer.pooling import Pooler

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


class HiddenRows(NamedTuple):
    """A run of one sequence's prompt rows whose final hidden states the step keeps besides the sampled ones: for its
    prompt logprobs, or for its embedding. `offset` indexes ModelInputs.hidden_indices; `position` is the first
    row's."""

    seq: Sequence
    offset: int
    count: int
    position: int
    ends_prompt: bool = False  # the step reaches the end of the sequence's prompt (an embedding is then complete)


class ModelInputs(NamedTuple):
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    hidden_indices: torch.Tensor  # the rows whose final hidden states the step reads, ascending
    sample_seqs: list[Sequence]  # one a sampled row
    sample_rows: torch.Tensor | None  # where the sampled rows are in hidden_indices (None: all of them, in order)
    prompt_rows: list[HiddenRows]  # rows whose logits give prompt logprobs
    pooled_rows: list[HiddenRows]  # rows an embedding pools


def logits_in_chunks(model, hidden_states: torch.Tensor, consume) -> None:
    """The LM head over `hidden_states` PROMPT_LOGPROBS_CHUNK rows at a time, each chunk's full-vocabulary logits
    handed to consume(first row, logits) as it comes: a step's prompt rows never hold all their logits at once."""
    for start in range(0, hidden_states.shape[0], PROMPT_LOGPROBS_CHUNK):
        consume(start, model.compute_logits(hidden_states[start : start + PROMPT_LOGPROBS_CHUNK]))


class PromptRowsReader:
    """logits_in_chunks' consumer for a step with prompt logprobs: the prompt rows in each chunk get their logprobs
    at once, and the sampled rows' logits are kept for the sampler (sampled())."""

    def __init__(self, inputs: ModelInputs):
        self.inputs = inputs
        self.sample_rows = inputs.sample_rows.tolist() if inputs.sample_rows is not None else []
        self.kept: list[torch.Tensor] = []

    def __call__(self, first: int, logits: torch.Tensor) -> None:
        last = first + logits.shape[0]
        for run in self.inputs.prompt_rows:
            lo, hi = max(run.offset, first), min(run.offset + run.count, last)
            if lo < hi:
                seq, position = run.seq, run.position + lo - run.offset
                targets = seq.token_ids[position + 1 : position + 1 + hi - lo]
                seq.request.prompt_logprobs += prompt_logprobs(logits[lo - first : hi - first], targets,
                                                               seq.params.prompt_logprobs)  # fmt: skip
        rows = [r - first for r in self.sample_rows if first <= r < last]
        if rows:
            self.kept.append(logits[rows])

    def sampled(self) -> torch.Tensor | None:
        return torch.cat(self.kept) if self.kept else None


def kv_cache_dtype_of(config) -> torch.dtype:
    """The KV cache's torch dtype (a resolved Config's kv_cache_dtype names it: never auto or fp8)."""
    return TORCH_KV_CACHE_DTYPES[config.kv_cache_dtype]


class ModelRunner:
    def __init__(self, config, num_blocks: int, num_state_slots: int = 0):
        self.config = config
        hf_config = config.hf_config
        self.device = torch.device(config.device)
        self.dtype = TORCH_DTYPES[config.dtype]
        self.kv_cache_dtype = kv_cache_dtype_of(config)
        self.block_size = config.kvcache_block_size
        self.platform = current_platform()
        self.backend = self.platform.attention_backend(config.attention_backend)
        with torch.device("cpu"):
            model = registry.build_model(hf_config, self.backend, max_position=max(config.max_model_len, 1),
                                         dtype=self.dtype)  # fmt: skip
        load_weights(model, config.model, hf_config)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        for rotary in self.model.rotary_embeddings():
            rotary.to_device(self.device)
        # Adapters' slots in every adaptable layer, made before the weights are packed (lora/manager.py)
        self.lora_manager = LoRAManager(self.model, config.max_loras, config.max_lora_rank, config.max_cpu_loras,
                                        config.max_num_batched_tokens, self.device) if config.enable_lora else None
        self.num_packed_weights = self.platform.prepare_model(self.model)
        self.sampler = Sampler(config.seed)
        self.pooler = Pooler(config.pooling_type, config.normalize) if config.runner == "pooling" else None
        # Each layer's cache shape (this rank's KV heads, its head size): layers may differ.
        self.kv_head_shapes = [(a.num_kv_heads, a.head_dim) for a in self.model.attention_layers()]
        # A layer that reads an earlier layer's keys and values (Gemma 4's KV sharing) owns no cache: it is handed
        # that layer's tensors (and stores nothing into them).
        self.kv_shared_from = [getattr(a, "kv_shared_from", None) for a in self.model.attention_layers()]
        # Which decoder layers hold a state slot rather than a KV cache (a hybrid model's linear-attention ones)
        self.is_linear_layer = [getattr(layer.self_attn, "is_linear_attention", False)
                                for layer in self.model.model.layers]  # fmt: skip
        self.graph_runner = None  # a CUDAGraphRunner once captured
        self.allocate_kv_cache(num_blocks, num_state_slots)

    @property
    def uses_cuda_graphs(self) -> bool:
        """Decode through CUDA graphs: on CUDA, unless enforce_eager, with a backend whose kernels capture."""
        return self.platform.uses_cuda_graphs(self.config, self.backend.name)

    def capture_cuda_graphs(self, capturer=None) -> None:
        """Capture the decode graphs over the current KV cache (call again after reallocating it)."""
        from nanoinfer.platforms.cuda.cuda_graph import CUDAGraphRunner, graph_batch_sizes

        lora = self.lora_manager.context if self.lora_manager is not None else None

        def forward(input_ids, positions, metadata):
            if lora is not None:  # the graph's adapter kernels read the slots each replay's step copies in
                lora.set_graph_rows(input_ids.shape[0])
            return self.model(input_ids, positions, self.kv_caches, metadata)

        self.graph_runner = CUDAGraphRunner(
            forward,
            batch_sizes=graph_batch_sizes(max_num_sampled_rows(self.config)), max_model_len=self.config.max_model_len,
            block_size=self.block_size, hidden_size=self.config.hf_config.hidden_size, dtype=self.dtype,
            device=self.device, capturer=capturer, uses_state_slots=self.state_cache is not None,
        )  # fmt: skip
        self.graph_runner.capture()

    def close(self) -> None:
        """Nothing to stop (the tensor-parallel executor's close stops its workers)."""

    def release_cuda_graphs(self) -> None:
        self.graph_runner = None  # the graphs' memory pool goes with them

    def allocate_kv_cache(self, num_blocks: int, num_state_slots: int = 0) -> None:
        self.graph_runner = None  # captured graphs point at the old cache
        self.decode_runner = None
        self.kv_cache = self.kv_caches = self.state_cache = None  # drop the old caches before allocating new ones
        owners = [i for i, source in enumerate(self.kv_shared_from) if source is None]
        shapes = [(num_blocks, self.block_size, *self.kv_head_shapes[i]) for i in owners]
        self.num_blocks = num_blocks
        self.kv_cache = self.platform.allocate_kv_cache(shapes, self.kv_cache_dtype, self.device)
        self.kv_caches = self.kv_cache.layers
        if len(owners) < len(self.kv_shared_from):  # one (k, v) pair a layer, a sharing layer's its source's
            owned = dict(zip(owners, self.kv_cache.layers))
            self.kv_caches = [owned[i if source is None else source] for i, source in enumerate(self.kv_shared_from)]
        self.num_state_slots = num_state_slots
        linear = self.model.linear_attention_layers()
        if linear:
            shapes = [layer.state_shapes(num_state_slots) for layer in linear]
            self.state_cache = self.platform.allocate_state_cache(shapes, self.dtype, self.device)
            self.kv_caches = self.layer_caches(self.kv_caches, self.state_cache)
        self.decode_runner = self.platform.decode_runner(self.model, self.kv_caches, self.backend)

    def layer_caches(self, kv_caches: list, state_cache: list) -> list:
        """One cache a decoder layer, in layer order: its (k, v) pair, or a linear-attention layer's (conv_state,
        ssm_state)."""
        kv, state = iter(kv_caches), iter(state_cache)
        return [next(state) if linear else next(kv) for linear in self.is_linear_layer]

    def run_model(self, input_ids, positions, metadata: AttentionMetadata, logits_indices=None) -> torch.Tensor:
        """The model's forward pass over this runner's cache (every rank's, eager): the final hidden states
        of every row, or of the rows in logits_indices (the model then skips the others' last-layer work)."""
        self.kv_cache.before_step(metadata.slot_mapping)
        if metadata.kv_block_copies:
            self.kv_cache.copy_rows(metadata.kv_block_copies)
        self.set_lora_rows(metadata, logits_indices)
        if self.decode_runner is not None and metadata.is_pure_decode:
            return self.decode_runner.run(input_ids, positions, metadata, logits_indices)
        return self.model(input_ids, positions, self.kv_caches, metadata, logits_indices)

    def add_lora(self, lora) -> None:
        """Read and check an adapter before a request using it is queued (a LoRAError if it cannot run)."""
        self.lora_manager.add_adapter(lora)

    def set_lora_rows(self, metadata: AttentionMetadata, kept_rows) -> None:
        """Give the adapted layers this step's adapter a row (the adapters loaded into slots first)."""
        if self.lora_manager is not None:
            self.lora_manager.set_step(metadata.lora_rows, kept_rows)

    @torch.inference_mode()
    def warmup(self) -> None:
        """One forward pass at max_num_batched_tokens (split over up to max_num_seqs sequences) to find the
        activation peak, and the logits of every row a step can sample. Needs a cache of at least
        max_num_batched_tokens tokens."""
        num_seqs = self.warmup_batch()
        if self.pooler is not None:
            return  # embeddings compute no logits
        rows = max(max_num_sampled_rows(self.config), PROMPT_LOGPROBS_CHUNK)
        if rows > num_seqs:
            # Speculation samples more rows than sequences, and prompt logprobs take a chunk of rows at a time:
            # their logits, the float32 copy and its log-softmax are part of the peak the warm-up measures.
            hidden = torch.zeros(rows, self.config.hf_config.hidden_size, dtype=self.dtype, device=self.device)
            torch.log_softmax(self.model.compute_logits(hidden).float(), dim=-1)

    @torch.inference_mode()
    def warmup_batch(self) -> int:
        """The warm-up's forward pass (through self.execute); returns how many sequences it sampled."""
        from nanoinfer.engine.sequence import Request
        from nanoinfer.sampling_params import SamplingParams

        num_seqs, per_seq = memory.warmup_shape(self.config, self.num_blocks)
        if self.state_cache is not None:
            num_seqs = min(num_seqs, self.num_state_slots)  # one state slot each
        out = SchedulerOutput()
        next_block = 0
        lora = WARM_UP_LORA if self.config.enable_lora else None  # the adapters' work is part of the peak too
        for i in range(num_seqs):
            seq = Request(f"warmup-{i}", [0] * per_seq, SamplingParams(max_tokens=1), lora_request=lora).sequences[0]
            num_blocks = -(-per_seq // self.block_size)
            seq.block_table = list(range(next_block, next_block + num_blocks))
            seq.state_slot = i if self.state_cache is not None else -1
            next_block += num_blocks
            out.scheduled.append((seq, per_seq))
        self.execute(out)
        return num_seqs

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[int, list[int]]:
        """Run one step; returns seq_id -> the token ids sampled for the sequences that reached their end
        (one each, or one per scheduled token of a speculated sequence)."""
        inputs = self.prepare_inputs(out)
        sample_seqs = inputs.sample_seqs
        self.sampler.prepare(sample_seqs, self.config.hf_config.vocab_size)  # grammar bitmasks, during forward
        hidden_states = self._forward(inputs.input_ids, inputs.positions, inputs.metadata, inputs.hidden_indices)
        self.read_pooled_rows(inputs, hidden_states)
        if inputs.prompt_rows:  # every row's logits, a chunk at a time: the sampled ones among them
            reader = PromptRowsReader(inputs)
            logits_in_chunks(self.model, hidden_states, reader)
            return group_by_sequence(sample_seqs, self.sampler(reader.sampled(), sample_seqs)) if sample_seqs else {}
        if not sample_seqs:
            return {}
        if inputs.sample_rows is not None:
            hidden_states = hidden_states[inputs.sample_rows]
        lm_head = self.model.lm_head
        if lm_head.has_greedy_kernel and all(s.params.is_plain_greedy for s in sample_seqs):
            return group_by_sequence(sample_seqs, lm_head.greedy_token_ids(hidden_states).tolist())
        logits = self.model.compute_logits(hidden_states)
        return group_by_sequence(sample_seqs, self.sampler(logits, sample_seqs))

    def read_pooled_rows(self, inputs: ModelInputs, hidden_states: torch.Tensor) -> None:
        """Give the step's pooled rows to their sequences' embeddings (complete at the end of a prompt)."""
        for run in inputs.pooled_rows:
            seq = run.seq
            if run.count:
                self.pooler.add(seq, hidden_states[run.offset : run.offset + run.count], run.position)
            if run.ends_prompt:
                seq.embedding = self.pooler.finish(seq, seq.request.pooling)

    @torch.inference_mode()
    def compute_logits(self, out: SchedulerOutput) -> torch.Tensor:
        """Logits of the sequences that reach their end this step (for tests against transformers)."""
        inputs = self.prepare_inputs(out)
        hidden_states = self._forward(inputs.input_ids, inputs.positions, inputs.metadata, inputs.hidden_indices)
        if inputs.sample_rows is not None:
            hidden_states = hidden_states[inputs.sample_rows]
        return self.model.compute_logits(hidden_states).float()

    def _forward(self, input_ids, positions, metadata: AttentionMetadata, hidden_indices) -> torch.Tensor:
        """The final hidden states of the rows in hidden_indices, in that order."""
        if self.graph_runner is not None and self.graph_runner.can_run(metadata):
            if metadata.kv_block_copies:
                self.kv_cache.copy_rows(metadata.kv_block_copies)
            self.set_lora_rows(metadata, None)
            return self.graph_runner.run(input_ids, positions, metadata)[hidden_indices]
        return self.run_model(input_ids, positions, metadata, hidden_indices)

    def prepare_inputs(self, out: SchedulerOutput) -> ModelInputs:
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        hidden_indices: list[int] = []  # every row the step reads (the sampled ones and the prompt rows kept)
        sample_rows: list[int] = []  # where the sampled rows are in hidden_indices
        sample_seqs: list[Sequence] = []
        prompt_rows: list[HiddenRows] = []
        pooled_rows: list[HiddenRows] = []
        tables: list[list[int]] = []
        state_slots: list[int] = []
        lora_rows: list = []  # each row's adapter, with LoRA enabled
        with_lora = self.lora_manager is not None and any(s.request.lora_request for s, _ in out.scheduled)
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
                if with_lora:
                    lora_rows += [seq.request.lora_request] * len(tokens)
                for i, token in enumerate(tokens):
                    pos = start + i
                    input_ids.append(token)
                    positions.append(pos)
                    slot_mapping.append(table[pos // bs] * bs + pos % bs)
                    query_lens.append(1)
                    seq_lens.append(pos + 1)
                    tables.append(table)
                    sample_rows.append(len(hidden_indices))
                    hidden_indices.append(len(input_ids) - 1)
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
            state_slots.append(seq.state_slot)
            if with_lora:
                lora_rows += [seq.request.lora_request] * num_new
            if len(table) > max_blocks:
                max_blocks = len(table)
            if seq.wants_prompt_logprobs or seq.request.pooling is not None:
                # Rows kept for the prompt, in row order before the sampled one: the row of position p gives the
                # logprob of token p + 1, up to the prompt's last token; a pooled prompt keeps what its vector needs.
                row0 = len(input_ids) - num_new - start
                if seq.request.pooling is None:
                    first, stop = max(start, len(seq.request.prompt_logprobs) - 1), min(end, seq.num_prompt_tokens - 1)
                    runs = prompt_rows
                else:
                    first, stop = self.pooler.rows_needed(start, end, seq.num_prompt_tokens)
                    runs = pooled_rows
                ends_prompt = end == seq.num_prompt_tokens and seq.request.pooling is not None
                if first < stop or ends_prompt:
                    count = max(stop - first, 0)
                    runs.append(HiddenRows(seq, len(hidden_indices), count, first, ends_prompt))
                    hidden_indices += range(row0 + first, row0 + first + count)
            if end == seq.num_tokens and not seq.is_prefill_only:
                sample_rows.append(len(hidden_indices))
                hidden_indices.append(len(input_ids) - 1)
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
            state_slots=torch.tensor(state_slots, dtype=torch.int32, device=dev) if self.state_cache else None,
            kv_block_copies=out.kv_block_copies or None,
            lora_rows=lora_rows or None,
        )
        extra_rows = len(sample_rows) < len(hidden_indices)
        return ModelInputs(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            metadata,
            torch.tensor(hidden_indices, dtype=torch.long, device=dev),
            sample_seqs,
            torch.tensor(sample_rows, dtype=torch.long, device=dev) if extra_rows else None,
            prompt_rows,
            pooled_rows,
        )
