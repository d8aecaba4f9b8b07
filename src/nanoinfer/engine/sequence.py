"""Request (what the user submitted) and Sequence (one generation path the scheduler runs).

A request with n > 1 owns n sequences that share its prompt (and, through prefix caching, its KV blocks).
The engine knows nothing about text except stop strings; token ids in, token ids out.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from nanoinfer.outputs import Logprob
from nanoinfer.sampling_params import SamplingParams


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
        self.output_text = ""  # filled by the stop-string checker when stop strings are set
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

    def __post_init__(self):
        if not self.sequences:
            self.sequences = [Sequence(self, i) for i in range(self.sampling_params.n)]

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.sequences)
