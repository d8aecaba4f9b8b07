"""Continuous batching: which sequences run this step and how many tokens each, under three limits.

No prefill/decode modes (vLLM v1's idea): every sequence has num_computed_tokens and num_tokens, and a step
lets the first catch up with the second. So chunked prefill (for any number of sequences), prefix-cache
hits and decode are one code path. When the cache runs out, the most recently admitted running sequence
is preempted by recompute: its blocks are freed and it goes back to the front of the queue.

With n-gram speculation on (engine/ngram_proposer.py), a greedy sequence ready for its next token may get
proposed tokens too: it is scheduled for 1 + k tokens (its last token and the proposal), the model samples
its greedy token at each, and update() keeps the proposal up to the first token that differs, plus the
model's own token there. Every kept token is the one plain decoding would have produced.

Stop strings are looked for in the text after each step (nanoinfer/detokenizer.py, from LLM.step), which then
finishes a sequence that hit one through finish_on_stop_string().
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from nanoinfer.engine.block_manager import BlockManager
from nanoinfer.engine.ngram_proposer import NgramProposer
from nanoinfer.engine.sequence import Request, Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens this step)
    num_preempted: int = 0
    # KV rows shared from a partly filled block, copied before the forward pass: (source, destination, rows)
    kv_block_copies: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: set[int] = frozenset(),
        proposer: NgramProposer | None = None,
        max_loras: int = 0,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.proposer = proposer
        self.max_loras = max_loras  # most LoRA adapters among running sequences (0: LoRA off)
        self.num_draft_tokens = 0  # tokens proposed by speculation, and how many of them the model kept
        self.num_accepted_tokens = 0
        # seq_id -> (proposed tokens the model kept, tokens appended) of the last update, for a stop string found after
        self._last_drafts: dict[int, tuple[int, int]] = {}
        self._finished_at_admission: list[Request] = []
        self._num_unfinished_requests = 0
        self._unapplied_copies: list[tuple[int, int, int]] = []  # KV rows shared in a step not yet updated

    # ---- admission -------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request LLM.add_request admitted."""
        # Admitted: not empty and shorter than max_model_len, which the whole KV cache holds (memory.check_fits).
        assert 0 < len(request.prompt_token_ids) < self.max_model_len, len(request.prompt_token_ids)
        if request.sampling_params.max_tokens == 0 and request.prompt_logprobs is None and request.pooling is None:
            for seq in request.sequences:  # nothing to generate, score or embed: done without a forward pass
                self._finish(seq, "length")
            self._finished_at_admission.append(request)
            return
        self._num_unfinished_requests += 1
        self.waiting.extend(request.sequences)

    @property
    def has_unfinished(self) -> bool:
        return self._num_unfinished_requests > 0 or bool(self._finished_at_admission)

    @property
    def num_unfinished_requests(self) -> int:
        return self._num_unfinished_requests

    # ---- one step ----------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        # Running sequences first, oldest first; preempt from the back when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not bm.allocate_slots(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.num_preempted += 1
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, num_new))
                budget -= num_new
                i += 1

        # Then waiting sequences, in order, while budget, sequence slots and blocks last. Not after a
        # preemption: the cache is already short. One whose grammar still compiles stays, and the rest go on; so
        # does one whose adapter would make more than max_loras among the running sequences (vLLM's rule: its turn
        # comes when an adapter's sequences have all finished).
        set_aside: list[Sequence] = []
        loras = {s.request.lora_int_id for s in self.running} - {0}
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.num_preempted:
            seq = self.waiting[0]
            lora_id = seq.request.lora_int_id
            if lora_id and lora_id not in loras and len(loras) >= self.max_loras:
                set_aside.append(self.waiting.popleft())
                continue
            if seq.grammar is None and seq.request.structured_output is not None:
                if not self._start_grammar(seq, set_aside):
                    continue
            computed, share = [], None
            if seq.num_computed_tokens == 0:  # not those whose hidden states this step must produce
                limit, root = seq.max_cached_tokens, seq.request.cache_root
                computed = bm.get_computed_blocks(seq.token_ids, root)[: limit // bm.block_size]
                share = bm.find_partial_share(seq.token_ids, computed, limit, root)
            num_cached = len(computed) * bm.block_size + (share.num_tokens if share is not None else 0)
            num_new = min(seq.num_tokens - seq.num_computed_tokens - num_cached, budget)
            if not bm.allocate_slots(seq, num_new, computed, share):
                break
            if seq.num_output_tokens == 0 and seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached
            seq.num_computed_tokens += num_cached
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if lora_id:
                loras.add(lora_id)
            out.scheduled.append((seq, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(set_aside))
        # Copies leave the block manager with this step, and the scheduler keeps them until update(): a step that
        # raised before its forward pass (Ctrl-C) hands them to the next, or the shared rows would never be there.
        self._unapplied_copies += bm.pending_copies
        bm.pending_copies = []
        out.kv_block_copies = list(self._unapplied_copies)

        # Last, proposed tokens, from what the budget has left: speculation never delays an admission. Not
        # after a preemption: the cache is short.
        if self.proposer is not None:
            for j, (seq, num_new) in enumerate(out.scheduled):
                seq.spec_token_ids = []  # whatever an earlier step left (an update() that never came)
                if budget > 0 and num_new == 1 and not out.num_preempted and self._speculate(seq, budget):
                    out.scheduled[j] = (seq, 1 + len(seq.spec_token_ids))
                    budget -= len(seq.spec_token_ids)
        return out

    def _start_grammar(self, seq: Sequence, compiling: list[Sequence]) -> bool:
        """Give the queue's first sequence its grammar matcher; False when it has left the queue (set aside
        while its grammar compiles, or finished because the grammar cannot be used)."""
        structured = seq.request.structured_output
        if structured.is_pending:
            compiling.append(self.waiting.popleft())
            return False
        error = structured.error
        if error is None:
            seq.grammar = structured.new_matcher()
            return True
        self.waiting.popleft()
        self._finish(seq, "error", error=error)
        seq.error_code = "invalid_structured_outputs"
        if seq.request.is_finished:
            self._num_unfinished_requests -= 1
            self._finished_at_admission.append(seq.request)
        return False

    def pending_grammars(self) -> list:
        """The compile futures that queued sequences wait for (the engine waits on them when idle)."""
        return [s.request.structured_output.future for s in self.waiting
                if s.grammar is None and s.request.structured_output is not None
                and s.request.structured_output.is_pending]

    def _speculate(self, seq: Sequence, spare_budget: int) -> bool:
        """Propose tokens for `seq` (scheduled for its last token) and give them slots; False (nothing proposed)
        when it is not a greedy sequence about to sample, nothing matches, or the slots would take a block
        another sequence may need."""
        params = seq.params
        if seq.num_tokens - seq.num_computed_tokens != 1 or not params.is_plain_greedy:
            return False
        # Never past what the sequence may still generate: the model adds one token of its own after the
        # kept proposal, so a proposal of m tokens can end the sequence m + 1 tokens later.
        limit = min(spare_budget, self.max_model_len - seq.num_tokens - 1)
        if params.max_tokens is not None:
            limit = min(limit, params.max_tokens - seq.num_output_tokens - 1)
        draft = self.proposer.propose(seq, limit)
        if not draft:
            return False
        bm = self.block_manager
        # A proposal that needs a new block takes it only while every running sequence could still get one:
        # speculation must never be the reason a sequence is preempted.
        new_blocks = bm.num_blocks_for(seq.num_tokens + len(draft)) - len(seq.block_table)
        if new_blocks > 0 and bm.num_free_blocks - new_blocks < len(self.running):
            return False
        if not bm.allocate_slots(seq, 1 + len(draft)):
            return False
        seq.spec_token_ids = draft
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ---- after the forward pass ---------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[int, list[int]]) -> list[Request]:
        """Advance computed counts, append sampled tokens (seq_id -> the token ids sampled for it: one, or
        one per scheduled token of a speculated sequence), apply the stop rules on token ids (stop strings are
        finish_on_stop_string's). Returns the requests that finished (all their sequences done)."""
        finished: list[Request] = self._finished_at_admission
        self._finished_at_admission = []
        self._unapplied_copies = []  # the step's forward pass made them
        self._last_drafts = {}
        for seq, num_new in out.scheduled:
            token_ids = sampled.get(seq.seq_id)
            draft = seq.spec_token_ids
            if draft:
                seq.spec_token_ids = []
                # token_ids[i] is the model's greedy token after the last token and draft[:i]: the draft holds
                # while it agrees. The rejected tokens' keys and values stay in their slots past
                # num_computed_tokens, where the next step's tokens overwrite them.
                accepted = 0
                while accepted < len(draft) and token_ids[accepted] == draft[accepted]:
                    accepted += 1
                token_ids = token_ids[: accepted + 1]
                num_new = 1 + accepted
                self.num_draft_tokens += len(draft)
            seq.num_computed_tokens += num_new
            if token_ids is None:
                self.block_manager.cache_full_blocks(seq)
                if seq.is_prefill_only and seq.num_computed_tokens == seq.num_tokens:  # scored or embedded
                    self._finish(seq, "length")
                    self._retire(seq, finished)
                continue  # a prefill chunk that did not reach the end of the sequence
            reason = None
            num_appended = 0
            for token_id in token_ids:  # one at a time: the stop rules see each token as plain decoding would
                constrained = seq.grammar_takes(token_id)
                if seq.reasoning is not None:
                    seq.reasoning.advance(token_id, first=seq.num_output_tokens == 0)
                seq.token_ids.append(token_id)
                num_appended += 1
                reason = self._stop_reason(seq, token_id, constrained)
                if reason is not None:
                    break
            if draft:  # proposed tokens that made it into the output (a stop can cut a kept proposal short)
                self.num_accepted_tokens += min(num_new - 1, num_appended)
                self._last_drafts[seq.seq_id] = (num_new - 1, num_appended)
            # A stop inside a kept draft leaves tokens computed past the end: only the sequence's own count.
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
            self.block_manager.cache_full_blocks(seq)
            if reason is not None:
                self._finish(seq, *reason)
                self._retire(seq, finished)
        return finished

    def _retire(self, seq: Sequence, finished: list[Request]) -> None:
        """A finished running sequence gives its blocks back; its request is done when all its sequences are."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        if seq.request.is_finished:
            self._num_unfinished_requests -= 1
            finished.append(seq.request)

    def _stop_reason(self, seq: Sequence, token_id: int, constrained: bool) -> tuple | None:
        """Why `seq` ends at `token_id`, just appended, or None. constrained: its grammar held the token (the thinking,
        end-of-thinking token included, is not the grammar's)."""
        params = seq.params
        if constrained:  # the mask let only tokens the grammar accepts through
            if not seq.grammar.accept_token(token_id):
                return "error", None, f"the grammar rejected token {token_id} (a bug in nanoinfer; please report it)"
            if seq.grammar.is_terminated():  # the grammar's end (its EOS accepted): the output is complete
                return "stop", None
        if seq.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return "stop", None
            if token_id in params.stop_token_ids:
                return "stop", token_id
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return "length", None
        if seq.num_tokens >= self.max_model_len:
            return "length", None
        return None

    def finish_on_stop_string(self, seq: Sequence, num_output_tokens: int, stop: str) -> Request | None:
        """Finish `seq`, whose text hit stop string `stop` after the last update(): its output ends at its token
        `num_output_tokens`, the one that completed the string (a kept proposal may have appended more), and a running
        sequence gives its blocks back. Returns its request when that has now finished."""
        num_dropped = seq.num_output_tokens - num_output_tokens
        assert 0 <= num_dropped and num_output_tokens >= 1, (seq, num_output_tokens)
        if num_dropped and seq.seq_id in self._last_drafts:  # kept proposed tokens past the stop are not output
            num_kept, num_appended = self._last_drafts[seq.seq_id]
            self.num_accepted_tokens -= min(num_kept, num_appended) - min(num_kept, num_appended - num_dropped)
        del seq.token_ids[seq.num_prompt_tokens + num_output_tokens :]
        del seq.logprobs[num_output_tokens:]
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)  # the dropped tokens' rows are unused
        was_running = not seq.is_finished  # else update() finished it, at a later token or a length limit
        self._finish(seq, "stop", stop)
        if not was_running:
            return None
        finished: list[Request] = []
        self._retire(seq, finished)
        return finished[0] if finished else None

    def _finish(self, seq: Sequence, reason: str, stop_reason=None, error: str | None = None) -> None:
        seq.spec_token_ids = []
        seq.ngram_index = None  # the proposer's index is of no use once the sequence is done
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        seq.error = error

    def abort_all(self, error: str) -> list[Request]:
        """Finish everything still queued or running with an error (used on shutdown)."""
        requests: dict[str, Request] = {}
        self._unapplied_copies = []
        for seq in list(self.running) + list(self.waiting):
            self.block_manager.free(seq)
            self._finish(seq, "error", error=error)
            requests[seq.request.request_id] = seq.request
        self.running.clear()
        self.waiting.clear()
        self._num_unfinished_requests = 0
        return list(requests.values())
