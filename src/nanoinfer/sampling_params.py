"""SamplingParams: the per-request knobs (vLLM's names), checked when built."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from nanoinfer.errors import RequestError


@dataclass
class SamplingParams:
    """How to sample one request.

    Args:
        n: sequences generated for the prompt (they share its cached KV blocks).
        temperature: 0 means greedy; otherwise logits are divided by it.
        top_p, top_k, min_p: nucleus / top-k (-1 or 0 = off) / min-probability filtering.
        repetition_penalty: HF-style (>1 discourages tokens already in prompt or output).
        presence_penalty, frequency_penalty: OpenAI-style, over generated tokens.
        seed: per-request seed; the same seed and prompt give the same output whatever else is batched.
        max_tokens: most tokens to generate (None: up to max_model_len).
        min_tokens: stop conditions are ignored until this many tokens exist.
        stop: strings that end generation (not included in the text).
        stop_token_ids: token ids that end generation (besides EOS).
        ignore_eos: keep generating past EOS.
        logprobs: None, or how many top alternatives to return with each sampled token's logprob.
        skip_special_tokens: drop special tokens from the returned text.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = field(default=None)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        problems = self._problems()
        if problems:
            raise RequestError("invalid sampling parameters: " + "; ".join(problems))

    def _problems(self) -> list[str]:
        p = []

        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x):
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        if not is_int(self.n) or self.n < 1:
            p.append(f"n must be an integer >= 1, got {self.n!r}")
        if not is_num(self.temperature) or self.temperature < 0:
            p.append(f"temperature must be a number >= 0 (0 = greedy), got {self.temperature!r}")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            p.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or (self.top_k < 0 and self.top_k != -1):
            p.append(f"top_k must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            p.append(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            p.append(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not -2 <= v <= 2:
                p.append(f"{name} must be in [-2, 2], got {v!r}")
        if self.seed is not None and not is_int(self.seed):
            p.append(f"seed must be an integer, got {self.seed!r}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            p.append(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            p.append(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        elif self.max_tokens is not None and is_int(self.max_tokens) and self.min_tokens > self.max_tokens:
            p.append(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not all(isinstance(s, str) and s for s in self.stop):
            p.append(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            p.append(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            p.append(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            p.append(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        return p

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with nothing else to do: no penalties, no logprobs (the argmax of the raw logits is the token)."""
        return self.is_greedy and self.logprobs is None and not self.has_penalties

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
