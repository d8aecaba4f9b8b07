"""Request (what the user submitted) and Sequence (one generation path the scheduler runs).

A request with n > 1 owns n sequences that share its prompt (and, through prefix caching, its KV blocks).
The engine knows nothing about text: token ids in, token ids out (stop strings are found in the decoded text after
each step, by the LLM: detokenizer.py).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from nanoinfer.engine.block_manager import root_hash
from nanoinfer.outputs import Logprob
from nanoinfer.pooling import PoolingParams
from nanoinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanoinfer.lora_request import LoRARequest


@dataclass(frozen=True)
class ReasoningTokens:
    """A request on a model that thinks between two tokens (`<think>` ... `</think>`): their ids, and whether the
    prompt opened the thinking (the output then starts inside it)."""

    start_id: int
    end_id: int
    opened_by_prompt: bool = False
    closed_by_prompt: bool = False  # the template switched thinking off: the answer is content from its first token


class ReasoningState:
    """Where a sequence's output is: at its first token (which may open the thinking), inside the thinking, or past
    it. Inside, a grammar waits (it holds the answer, not the thinking) and the thinking budget counts; at the first
    token the grammar's tokens and the opening one are allowed."""

    def __init__(self, tokens: ReasoningTokens, budget: int | None):
        self.tokens = tokens
        self.budget = budget
        self.open = tokens.opened_by_prompt
        self.done = tokens.closed_by_prompt  # past the end-of-thinking token (or the output did not start thinking)
        self.num_tokens = 0  # reasoning tokens so far

    @property
    def at_first_token(self) -> bool:
        """Not yet known whether the output thinks: its first token may be the opening one."""
        return not self.open and not self.done

    def holds_grammar(self, token_id: int) -> bool:
        """Is `token_id`, about to be taken, the answer's (a grammar's) rather than the thinking's?"""
        return self.done or (self.at_first_token and token_id != self.tokens.start_id)

    def forced_token(self) -> int | None:
        """The end-of-thinking token when the budget is spent and the reasoning still open, else None."""
        if self.open and self.budget is not None and self.num_tokens >= self.budget:
            return self.tokens.end_id
        return None

    def advance(self, token_id: int, first: bool) -> None:
        """Take the next output token (`first`: the output's first)."""
        if self.done:
            return
        if not self.open:
            if first and token_id == self.tokens.start_id:
                self.open = True
            else:
                self.done = True  # an answer that does not think
        elif token_id == self.tokens.end_id:
            self.open, self.done = False, True
        else:
            self.num_tokens += 1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    _ids = itertools.count()

    def __init__(self, request: Request, index: int):
        self.seq_id = next(Sequence._ids)
        self.request = request
        self.index = index
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.block_table: list[int] = []
        self.num_hashed_blocks = 0  # leading blocks of block_table already registered in the prefix cache
        self.state_slot = -1  # a hybrid model's state-cache slot while running (BlockManager), else -1
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None  # stop | length | error
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.error_code: str | None = None  # for an error the user can fix, a code for scripts (else None)
        self.logprobs: list[Logprob] = []
        self.output_text = ""  # the text up to a stop string, set when one ends the sequence (detokenizer.py)
        self.num_preemptions = 0
        # Speculation (engine/ngram_proposer.py): the tokens proposed for this step, scheduled after the last
        # token and not part of token_ids until the model confirms them; and the sequence's n-gram index.
        self.spec_token_ids: list[int] = []
        self.ngram_index = None
        seed = request.sampling_params.seed
        # modulo 2**64: torch's seed range; an int64 seed plus an index must not overflow it
        self.sampling_seed = None if seed is None else (seed + index) % 2**64
        # Made by the sampler on the logits' device at the first draw: a CPU generator cannot drive a CUDA
        # multinomial, and copying each seeded row to the CPU would sync once per sequence per step.
        self.generator: torch.Generator | None = None
        # Structured output: this sequence's xgrammar matcher, made when the request's grammar has compiled.
        # It advances with every output token and survives preemption (the output tokens are kept).
        self.grammar = None
        # Embeddings (a pooling request): what the pooler has gathered of the prompt's rows, then the vector.
        self.pooled = None
        self.embedding: list[float] | None = None
        # A model that reasons: where the output is (a grammar holds only the answer after the thinking).
        reasoning = request.reasoning
        self.reasoning = ReasoningState(reasoning, request.sampling_params.max_reasoning_tokens) if reasoning else None

    @property
    def is_constrained(self) -> bool:
        """Does the grammar mask the next token (it has one, and no thinking is open: at the first token of a model
        that may think, the opening token is allowed beside the grammar's)?"""
        return self.grammar is not None and (self.reasoning is None or not self.reasoning.open)

    def grammar_takes(self, token_id: int) -> bool:
        """Does the grammar take `token_id`, about to be appended (not a token of the thinking)?"""
        return self.grammar is not None and (self.reasoning is None or self.reasoning.holds_grammar(token_id))

    @property
    def params(self) -> SamplingParams:
        return self.request.sampling_params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def is_prefill_only(self) -> bool:
        """Scores or embeds its prompt and generates nothing (max_tokens 0): done once the prompt is computed."""
        return self.params.max_tokens == 0

    @property
    def wants_prompt_logprobs(self) -> bool:
        """This sequence computes its request's prompt logprobs (the first of n does) and some are missing."""
        logprobs = self.request.prompt_logprobs
        return self.index == 0 and logprobs is not None and len(logprobs) < self.num_prompt_tokens

    @property
    def max_cached_tokens(self) -> int:
        """The most leading tokens the prefix cache may serve: those whose hidden states nothing still needs. The
        last token is always computed (its logits are sampled)."""
        limit = self.num_tokens - 1
        if self.wants_prompt_logprobs:  # the logprob of token p is read from the row of token p - 1
            limit = min(limit, len(self.request.prompt_logprobs) - 1)
        if self.request.pooling is not None:
            limit = min(limit, self.request.first_pooled_position)
        return limit

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={self.block_table}, {self.status.value})")


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    sequences: list[Sequence] = field(default_factory=list)
    structured_output: object | None = None  # a StructuredOutputRequest when sampling_params ask for a grammar
    # With sampling_params.prompt_logprobs: the first prompt position whose logprob is wanted (earlier entries stay
    # None, and the prefix cache may serve those tokens: a scored continuation after a shared context).
    prompt_logprobs_start: int = 1
    pooling: PoolingParams | None = None  # an embedding request (sampling_params then has max_tokens 0)
    first_pooled_position: int = 0  # the first prompt position whose hidden state its vector needs
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    reasoning: ReasoningTokens | None = None  # a model that thinks first: its thinking tokens
    # One entry a prompt token, filled as the prompt is computed: None before prompt_logprobs_start, then Logprobs.
    prompt_logprobs: list[Logprob | None] | None = field(default=None, init=False)

    def __post_init__(self):
        if not self.sequences:
            self.sequences = [Sequence(self, i) for i in range(self.sampling_params.n)]
        if self.sampling_params.prompt_logprobs is not None:
            start = min(max(self.prompt_logprobs_start, 1), len(self.prompt_token_ids))
            self.prompt_logprobs = [None] * start

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.sequences)

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def cache_root(self) -> int | None:
        """The prefix cache's parent hash of the first block (block_manager.root_hash): the same prompt under two
        adapters has other keys and values, so their blocks never match."""
        return root_hash(self.lora_int_id)
