"""SamplingParams: the per-request knobs (vLLM's names), checked when built."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields

from nanoinfer.errors import RequestError, StructuredOutputError
from nanoinfer.errors import short_repr as _show

# Bounds that keep one request from monopolizing a job (README "Limits"). MAX_N is OpenAI's bound on n.
MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
SEED_RANGE = (-(2**63), 2**63 - 1)  # int64, as OpenAI's seed
# Below this a temperature is greedy (vLLM's _SAMPLING_EPS): dividing logits by it would overflow them.
GREEDY_TEMPERATURE = 1e-5


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's names); exactly one kind per request.

    Args:
        json: a JSON schema (a dict, or its JSON text): the output is one JSON value it validates.
        json_object: True: the output is any JSON object.
        regex: the output matches this regular expression.
        choice: the output is exactly one of these strings.
        grammar: the output is a sentence of this EBNF grammar (GBNF style, `root ::= ...`).
        any_whitespace: JSON may hold free whitespace between its tokens. Off by default (the reverse of
            vLLM's disable_any_whitespace): JSON is written as json.dumps writes it, one space after `,` and
            `:`, since with free whitespace small models pad with spaces until max_tokens and never close.
    """

    json: dict | str | bool | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    any_whitespace: bool = False

    KINDS = ("json", "json_object", "regex", "choice", "grammar")

    @classmethod
    def from_dict(cls, value) -> StructuredOutputsParams:
        if isinstance(value, StructuredOutputsParams):
            params = value
        elif not isinstance(value, dict):
            raise StructuredOutputError(f"invalid structured_outputs: must be an object such as "
                                        f"{{\"json\": {{...}}}}, got {_show(value)}")
        else:
            unknown = [k for k in value if k not in (*cls.KINDS, "any_whitespace")]
            if unknown:
                raise StructuredOutputError(
                    f"invalid structured_outputs: unknown key(s) {', '.join(map(_show, unknown[:5]))}; it takes "
                    f"one of {', '.join(cls.KINDS)} (and any_whitespace)")
            params = cls(**value)
        problems = params.problems()
        if problems:
            raise StructuredOutputError("invalid structured_outputs: " + "; ".join(problems))
        return params

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    def problems(self) -> list[str]:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            return [f"give exactly one of {', '.join(self.KINDS)}, got {', '.join(given) or 'none'}"]
        kind, value = given[0], getattr(self, given[0])
        if not isinstance(self.any_whitespace, bool):
            return [f"any_whitespace must be true or false, got {_show(self.any_whitespace)}"]
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    return [f"json is a string that is not JSON text ({e})"]
            if not isinstance(value, (dict, bool)):
                return [f"json must be a JSON schema (an object), got {_show(value)}"]
        elif kind == "json_object" and value is not True:
            return [f"json_object must be true, got {_show(value)}"]
        elif kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            return [f"{kind} must be a non-empty string, got {_show(value)}"]
        elif kind == "choice" and (not isinstance(value, list) or not value
                                   or not all(isinstance(c, str) and c for c in value)):
            return [f"choice must be a non-empty list of non-empty strings, got {_show(value)}"]
        return []

    def cache_key(self) -> tuple[str, str, bool]:
        """(kind, canonical text, any_whitespace): equal keys compile to the same grammar."""
        kind, value = self.kind, getattr(self, self.kind)
        if kind == "json":
            value = json.dumps(json.loads(value) if isinstance(value, str) else value, sort_keys=True)
        elif kind == "choice":
            value = json.dumps(value)
        elif kind == "json_object":
            value = ""
        return kind, value, self.any_whitespace


@dataclass
class SamplingParams:
    """How to sample one request.

    Args:
        n: sequences generated for the prompt (they share its cached KV blocks), 1 to MAX_N.
        temperature: 0 (or below GREEDY_TEMPERATURE) means greedy; otherwise logits are divided by it.
        top_p, top_k, min_p: nucleus / top-k (-1 or 0 = off) / min-probability filtering.
        repetition_penalty: HF-style (>1 discourages tokens already in prompt or output).
        presence_penalty, frequency_penalty: OpenAI-style, over generated tokens.
        seed: per-request int64 seed; the same seed and prompt give the same output whatever else is batched.
        max_tokens: most tokens to generate (None: up to max_model_len). 0 generates nothing: with
            prompt_logprobs, the request only scores its prompt (finish_reason "length").
        min_tokens: stop conditions are ignored until this many tokens exist.
        stop: up to MAX_STOP_STRINGS strings that end generation (not included in the text).
        stop_token_ids: up to MAX_STOP_TOKEN_IDS token ids that end generation (besides EOS).
        ignore_eos: keep generating past EOS.
        logprobs: None, or how many top alternatives (0 to MAX_LOGPROBS) to return with each token's logprob.
        prompt_logprobs: None, or how many top alternatives (0 to MAX_LOGPROBS) to return with each prompt
            token's logprob (vLLM's): RequestOutput.prompt_logprobs has one entry a prompt token, None for the first.
        skip_special_tokens: drop special tokens from the returned text.
        structured_outputs: constrain the output to a JSON schema, regex, choice or grammar (or None); a
            dict is read as StructuredOutputsParams' fields. On a model that reasons (`<think>`), it applies to the
            answer after the reasoning.
        max_reasoning_tokens: a thinking budget: on a model that reasons (`<think>`), the end-of-thinking token is
            put in once the reasoning has this many tokens (None: no budget).
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
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    max_reasoning_tokens: int | None = None

    def __post_init__(self):
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
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

        def is_num(x):  # NaN and infinities are no setting: every comparison with NaN is False
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            p.append(f"n must be an integer in [1, {MAX_N}], got {_show(self.n)}")
        if not is_num(self.temperature) or self.temperature < 0:
            p.append(f"temperature must be a finite number >= 0 (0 = greedy), got {_show(self.temperature)}")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            p.append(f"top_p must be in (0, 1], got {_show(self.top_p)}")
        if not is_int(self.top_k) or (self.top_k < 0 and self.top_k != -1):
            p.append(f"top_k must be -1 (off), 0 (off) or a positive integer, got {_show(self.top_k)}")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            p.append(f"min_p must be in [0, 1], got {_show(self.min_p)}")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            p.append(f"repetition_penalty must be a finite number > 0, got {_show(self.repetition_penalty)}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not -2 <= v <= 2:
                p.append(f"{name} must be in [-2, 2], got {_show(v)}")
        if self.seed is not None and (not is_int(self.seed) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            p.append(f"seed must be a 64-bit signed integer, got {_show(self.seed)}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 0):
            p.append(f"max_tokens must be an integer >= 0 (0: score the prompt only), got {_show(self.max_tokens)}")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            p.append(f"min_tokens must be an integer >= 0, got {_show(self.min_tokens)}")
        elif self.max_tokens is not None and is_int(self.max_tokens) and self.min_tokens > self.max_tokens:
            p.append(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not all(isinstance(s, str) and s for s in self.stop):
            p.append(f"stop must be a non-empty string or a list of them, got {_show(self.stop)}")
        elif len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            p.append(f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} "
                     f"characters each, got {len(self.stop)} (longest {max(map(len, self.stop))})")
        if not all(is_int(t) and 0 <= t < 2**31 for t in self.stop_token_ids):
            p.append(f"stop_token_ids must be non-negative token ids, got {_show(self.stop_token_ids)}")
        elif len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            p.append(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        if not isinstance(self.ignore_eos, bool):
            p.append(f"ignore_eos must be true or false, got {_show(self.ignore_eos)}")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            p.append(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {_show(self.logprobs)}")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            p.append(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {_show(self.prompt_logprobs)}")
        if self.max_reasoning_tokens is not None and (not is_int(self.max_reasoning_tokens)
                                                      or self.max_reasoning_tokens < 0):  # fmt: skip
            p.append(f"max_reasoning_tokens must be an integer >= 0, got {_show(self.max_reasoning_tokens)}")
        if not isinstance(self.skip_special_tokens, bool):
            p.append(f"skip_special_tokens must be true or false, got {_show(self.skip_special_tokens)}")
        return p

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with nothing else to do: no penalties, no logprobs, no grammar (the argmax of the raw logits is
        the token)."""
        return (self.is_greedy and self.logprobs is None and not self.has_penalties and self.structured_outputs is None
                and self.max_reasoning_tokens is None)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

