"""LLMEngine: the one loop. add_request() queues token ids; step() schedules, runs the model and applies
the sampled tokens, returning the requests that finished. Sizes the KV cache through memory.py."""

from __future__ import annotations

import logging
import os
import time
from concurrent import futures
from dataclasses import dataclass

import torch

from nanoinfer import memory
from nanoinfer.config import Config
from nanoinfer.distributed.executor import TensorParallelExecutor
from nanoinfer.engine.block_manager import BlockManager
from nanoinfer.engine.model_runner import ModelRunner, kv_cache_dtype_of
from nanoinfer.engine.ngram_proposer import NgramProposer
from nanoinfer.engine.scheduler import Scheduler
from nanoinfer.engine.sequence import Request, Sequence
from nanoinfer.platforms.cpu.ops import keep_freed_memory_for_reuse

logger = logging.getLogger("nanoinfer")


@dataclass
class StepStats:
    num_prefill_tokens: int  # tokens of sequences still catching up with their prompt (or recompute)
    num_decode_tokens: int  # one per sequence generating its next token, plus its proposed tokens
    num_preempted: int
    seconds: float
    num_draft_tokens: int = 0  # tokens proposed by n-gram speculation this step
    num_accepted_tokens: int = 0  # of those, the ones the model confirmed
    # What the step read and computed, for bench's roofline (nanoinfer/roofline.py):
    num_seqs: int = 0
    num_context_tokens: int = 0  # KV-cache tokens attention read: each sequence's context up to this step's end
    num_attention_pairs: int = 0  # causal (query, key) pairs: over the step's tokens, their position + 1
    num_logits_rows: int = 0  # rows the LM head ran on


class LLMEngine:
    def __init__(self, config: Config, stop_string_checker=None, eos_token_ids: set[int] = frozenset()):
        self.config = config
        _setup_cpu_process(config)
        block_bytes = memory.kv_block_bytes(
            config.hf_config, config.kvcache_block_size, config.tensor_parallel_size, kv_cache_dtype_of(config)
        )
        if config.device == "cpu":
            self.plan = memory.plan_cpu_kv_cache(config, block_bytes)
            memory.check_fits(self.plan, config.max_model_len)
            self.model_runner = _make_runner(config, self.plan.num_blocks)
        else:
            self.model_runner, self.plan = _build_cuda_runner(config, block_bytes)
        logger.info(self.plan.summary_line())
        self.block_manager = BlockManager(self.plan.num_blocks, config.kvcache_block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            eos_token_ids=eos_token_ids,
            stop_string_checker=stop_string_checker,
            proposer=_make_proposer(config),
        )

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> tuple[list[Request], StepStats]:
        start = time.perf_counter()
        out = self.scheduler.schedule()
        if out.is_empty:
            # Nothing to run but grammars still compiling: wait for one instead of spinning against the compiler.
            futures.wait(self.scheduler.pending_grammars(), timeout=0.05, return_when=futures.FIRST_COMPLETED)
        sampled = self.model_runner.execute(out) if not out.is_empty else {}
        num_prefill, shape = _count_step(out.scheduled)
        num_decode = out.num_scheduled_tokens - num_prefill
        scheduler = self.scheduler
        drafts_before = (scheduler.num_draft_tokens, scheduler.num_accepted_tokens)
        finished = scheduler.update(out, sampled)
        return finished, StepStats(
            num_prefill, num_decode, out.num_preempted, time.perf_counter() - start,
            scheduler.num_draft_tokens - drafts_before[0], scheduler.num_accepted_tokens - drafts_before[1], *shape,
        )  # fmt: skip

    def close(self) -> None:
        """Stop the tensor-parallel worker processes, if any (idempotent; also runs at exit)."""
        if isinstance(self.model_runner, TensorParallelExecutor):
            self.model_runner.close()


def _make_runner(config: Config, num_blocks: int):
    if config.tensor_parallel_size > 1:
        return TensorParallelExecutor(config, num_blocks)  # same surface; rank 0 of a sharded model
    return ModelRunner(config, num_blocks)


def _is_decode(seq: Sequence, num_new: int) -> bool:
    # A speculated sequence is decoding, even when its last token is still the prompt's.
    decoding = seq.num_computed_tokens >= seq.num_prompt_tokens or bool(seq.spec_token_ids)
    return decoding and num_new == 1 + len(seq.spec_token_ids)


def _count_step(scheduled) -> tuple[int, tuple[int, int, int, int]]:
    """(prefill tokens, (sequences, context tokens, attention pairs, logits rows)) of a step, before update().

    One loop, as the prefill count alone had: it runs on every step. A speculated sequence's rows are each
    sampled; any other sequence has one row when this step reaches its last token."""
    num_prefill = num_context = num_pairs = num_rows = 0
    for seq, num_new in scheduled:
        start = seq.num_computed_tokens
        end = start + num_new
        if not _is_decode(seq, num_new):
            num_prefill += num_new
        num_context += end
        num_pairs += (end * (end + 1) - start * (start + 1)) // 2  # sum of (position + 1) over start..end-1
        num_rows += num_new if seq.spec_token_ids else end == seq.num_tokens
    return num_prefill, (len(scheduled), num_context, num_pairs, num_rows)


def _make_proposer(config: Config) -> NgramProposer | None:
    if config.num_speculative_tokens == 0:
        return None
    return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)


def _setup_cpu_process(config: Config) -> None:
    """CPU process setup: the thread count, and malloc keeping large freed blocks (cpu_ops)."""
    if config.device != "cpu":
        return
    keep_freed_memory_for_reuse()
    threads = config.num_threads or _physical_cores()
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def _physical_cores() -> int:
    try:
        cores = set()
        with open("/proc/cpuinfo") as f:
            phys = core = None
            for line in f:
                if line.startswith("physical id"):
                    phys = line.split(":")[1].strip()
                elif line.startswith("core id"):
                    core = line.split(":")[1].strip()
                    cores.add((phys, core))
        if cores:
            return len(cores)
    except OSError:
        pass
    return os.cpu_count() or 1


def _build_cuda_runner(config: Config, block_bytes: int):
    """Load the model, measure the activation peak with a warm-up pass, then size and allocate the cache."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    free_before, total = torch.cuda.mem_get_info()
    other_bytes = total - free_before
    # A minimal cache for the warm-up: enough blocks for max_num_batched_tokens tokens.
    warmup_blocks = -(-config.max_num_batched_tokens // config.kvcache_block_size) + 1
    runner = _make_runner(config, warmup_blocks)
    weights_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    warmup_cache_bytes = warmup_blocks * block_bytes
    runner.warmup()
    peak = torch.cuda.max_memory_allocated()
    activation_bytes = max(peak - weights_bytes - warmup_cache_bytes, 0)
    graphs = getattr(runner, "uses_cuda_graphs", False)  # the tensor-parallel executor runs eager
    graph_bytes = _measure_cuda_graph_bytes(runner) if graphs else 0
    plan = memory.plan_kv_cache(
        total_bytes=total, utilization=config.gpu_memory_utilization, weights_bytes=weights_bytes,
        activation_bytes=activation_bytes, other_bytes=other_bytes, block_bytes=block_bytes,
        block_size=config.kvcache_block_size, max_model_len=config.max_model_len,
        num_kvcache_blocks=config.num_kvcache_blocks, graph_bytes=graph_bytes,
    )  # fmt: skip
    memory.check_fits(plan, config.max_model_len)
    runner.allocate_kv_cache(plan.num_blocks)
    if graphs:
        runner.capture_cuda_graphs()  # over the final cache: graphs keep the addresses they were captured on
    return runner, plan


def _measure_cuda_graph_bytes(runner: ModelRunner) -> int:
    """Capture the decode graphs once over the warm-up cache and see how much memory they hold: their private
    pool (torch's allocator) and the instantiated graphs themselves (the driver's, seen only by mem_get_info)."""

    def settled() -> tuple[int, int]:
        # torch.cuda.graph() empties the allocator's cache on entry: without emptying it here too, the warm-up
        # pass's cached activations, released during the capture, would cancel out the graphs' own memory
        # (an H200 run measured 0 bytes that way).
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()

    free_before, reserved_before = settled()
    runner.capture_cuda_graphs()
    free_after, reserved_after = settled()
    runner.release_cuda_graphs()
    torch.cuda.empty_cache()
    return max(free_before - free_after, reserved_after - reserved_before, 0)
