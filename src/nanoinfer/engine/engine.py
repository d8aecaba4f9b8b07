"""LLMEngine: the one loop. add_request() queues token ids; step() schedules, runs the model and applies
the sampled tokens, returning the requests that finished. Sizes the KV cache through memory.py."""

from __future__ import annotations

import logging
import time
from concurrent import futures
from dataclasses import dataclass

from nanoinfer import memory
from nanoinfer.config import Config
from nanoinfer.engine.block_manager import BlockManager
from nanoinfer.engine.model_runner import kv_cache_dtype_of
from nanoinfer.engine.ngram_proposer import NgramProposer
from nanoinfer.engine.scheduler import Scheduler
from nanoinfer.engine.sequence import Request, Sequence
from nanoinfer.engine.tp_executor import make_executor
from nanoinfer.platforms import select_platform_for

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
    num_seqs_with_context: int = 0  # sequences with tokens computed before this step (a hybrid model reads their state)


class LLMEngine:
    def __init__(self, config: Config, eos_token_ids: set[int] = frozenset()):
        self.config = config
        self.platform = select_platform_for(config)
        self.platform.setup_process(config)
        block_bytes = memory.kv_block_bytes(
            config.model_spec, config.kvcache_block_size, config.tensor_parallel_size, kv_cache_dtype_of(config)
        )
        slot_bytes = memory.state_slot_bytes(config.model_spec, config.tensor_parallel_size, config.dtype)
        self.model_runner, self.plan = self.platform.build_runner(config, block_bytes, make_executor, slot_bytes)
        logger.info(self.plan.summary_line())
        for field, value, why in config.notes:
            if field == "enable_prefix_caching" and value is False:  # Config switched it off: say so, once a job
                logger.warning("prefix caching is %s", why)
        self.block_manager = BlockManager(self.plan.num_blocks, config.kvcache_block_size, config.enable_prefix_caching,
                                          num_state_slots=self.plan.num_state_slots)  # fmt: skip
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            eos_token_ids=eos_token_ids,
            proposer=_make_proposer(config),
            max_loras=config.max_loras if config.enable_lora else 0,
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

    def finish_on_stop_string(self, seq: Sequence, num_output_tokens: int, stop: str,
                              stats: StepStats) -> Request | None:
        """Finish `seq`, whose text hit stop string `stop` at its output token `num_output_tokens` in the step that
        `stats` describes (LLM.step looks for stop strings after each step). Returns its request when that has now
        finished."""
        num_accepted = self.scheduler.num_accepted_tokens
        request = self.scheduler.finish_on_stop_string(seq, num_output_tokens, stop)
        stats.num_accepted_tokens -= num_accepted - self.scheduler.num_accepted_tokens  # none past the stop string
        return request

    def close(self) -> None:
        """Stop the tensor-parallel worker processes, if any (idempotent; also runs at exit)."""
        self.model_runner.close()


def _is_decode(seq: Sequence, num_new: int) -> bool:
    # A speculated sequence is decoding, even when its last token is still the prompt's.
    decoding = seq.num_computed_tokens >= seq.num_prompt_tokens or bool(seq.spec_token_ids)
    return decoding and num_new == 1 + len(seq.spec_token_ids)


def _count_step(scheduled) -> tuple[int, tuple[int, int, int, int, int]]:
    """(prefill tokens, (sequences, context tokens, attention pairs, logits rows, sequences with context)) of a
    step, before update().

    One loop, as the prefill count alone had: it runs on every step. A speculated sequence's rows are each
    sampled; any other sequence has one row when this step reaches its last token."""
    num_prefill = num_context = num_pairs = num_rows = num_continuing = 0
    for seq, num_new in scheduled:
        start = seq.num_computed_tokens
        num_continuing += start > 0
        end = start + num_new
        if not _is_decode(seq, num_new):
            num_prefill += num_new
        num_context += end
        num_pairs += (end * (end + 1) - start * (start + 1)) // 2  # sum of (position + 1) over start..end-1
        num_rows += num_new if seq.spec_token_ids else end == seq.num_tokens
    return num_prefill, (len(scheduled), num_context, num_pairs, num_rows, num_continuing)


def _make_proposer(config: Config) -> NgramProposer | None:
    if config.num_speculative_tokens == 0:
        return None
    return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
