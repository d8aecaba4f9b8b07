"""What generate() returns: one RequestOutput per request, one CompletionOutput per sequence (n of them);
what embed() returns: one EmbeddingRequestOutput per request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanoinfer.lora_request import LoRARequest


@dataclass
class Logprob:
    """One sampled token's log-probability, with the top alternatives when asked for."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-k alternatives (token_id, logprob), best first


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it (None for EOS)
    logprobs: list[Logprob] | None = None
    error: str | None = None
    error_code: str | None = None  # e.g. invalid_structured_outputs; None for other errors


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: dict = field(default_factory=dict)
    # with SamplingParams.prompt_logprobs: one entry a prompt token, None for the first (nothing precedes it)
    prompt_logprobs: list[Logprob | None] | None = None
    lora_request: LoRARequest | None = None  # the adapter it ran with (None: the base model)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def error(self) -> str | None:
        return self.outputs[0].error

    @property
    def error_code(self) -> str | None:
        return self.outputs[0].error_code

    @property
    def usage(self) -> dict:
        completion = sum(len(o.token_ids) for o in self.outputs)
        prompt = len(self.prompt_token_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "cached_prompt_tokens": self.num_cached_tokens,
        }


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """One embedded prompt (vLLM's names): `outputs.embedding` is the vector; on an error it is empty and
    `error` / `error_code` say why."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    num_cached_tokens: int = 0
    error: str | None = None
    error_code: str | None = None
    metrics: dict = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return True

    @property
    def finish_reason(self) -> str:
        return "error" if self.error is not None else "stop"

    @property
    def usage(self) -> dict:
        prompt = len(self.prompt_token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt,
                "cached_prompt_tokens": self.num_cached_tokens}
