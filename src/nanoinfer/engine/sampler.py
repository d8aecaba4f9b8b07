"""logits + per-sequence sampling parameters -> next token ids (and logprobs when asked).

Greedy rows take an argmax; the rest are penalised, tempered, filtered (top-k, top-p, min-p) and
sampled in one batch. A seeded sequence draws from its own torch.Generator, so its output does not
depend on what else is in the batch. A sequence with a grammar (structured output) has the tokens its
grammar forbids masked out first, greedy or not; its logprobs are those of the masked distribution.
"""

from __future__ import annotations

import torch

from nanoinfer.engine.sequence import Sequence
from nanoinfer.outputs import Logprob
from nanoinfer.platforms import current_platform
from nanoinfer.structured_output import apply_grammar_bitmask, fill_grammar_bitmask

# Prompt rows whose float32 logits exist at once: a prompt's logprobs cost a vocabulary row each, and a chunk of
# 16k prompt tokens would otherwise hold gigabytes of them.
PROMPT_LOGPROBS_CHUNK = 256


class Sampler:
    def __init__(self, seed: int = 0):
        self.seed = seed
        self.argmax = current_platform().argmax  # torch.argmax(logits, dim=-1), through a kernel where one runs
        self._generators: dict[torch.device, torch.Generator] = {}  # unseeded draws, one per device
        self._bitmask = None  # the grammar bitmask prepare() started for the coming call

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def prepare(self, seqs: list[Sequence], vocab_size: int) -> None:
        """Before the forward pass: start filling the grammar bitmask of `seqs`' constrained rows."""
        self._bitmask = fill_grammar_bitmask(seqs, vocab_size)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits [num_seqs, vocab] (the model's dtype) -> one token id per sequence."""
        params = [s.params for s in seqs]  # read once: this runs for every row of every step
        if all(p.is_plain_greedy for p in params):
            return self.argmax(logits).tolist()  # the logits as they are: widening them would not change the argmax
        bitmask, self._bitmask = self._bitmask, None
        logits = apply_grammar_bitmask(logits.float(), seqs, bitmask)
        logits = _force_reasoning_end(logits, seqs)
        raw_logits = logits
        penalised = [i for i, p in enumerate(params) if p.has_penalties]
        if penalised:
            logits = logits.clone()
            for i in penalised:
                logits[i] = _apply_penalties(logits[i], seqs[i])
        token_ids = self.argmax(logits)
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if random_rows:
            token_ids[random_rows] = self._sample(logits[random_rows], [seqs[i] for i in random_rows])
        result = token_ids.tolist()
        for i, p in enumerate(params):
            if p.logprobs is not None:
                seqs[i].logprobs.append(_logprob(raw_logits[i], result[i], p.logprobs))
        return result

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        device = logits.device
        temperatures = torch.tensor([s.params.temperature for s in seqs], dtype=logits.dtype, device=device)
        logits = logits / temperatures.unsqueeze(1)
        top_ks = [s.params.top_k for s in seqs]
        if any(k > 0 for k in top_ks):
            vocab = logits.shape[-1]
            k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_ks], device=device)
            kth = torch.sort(logits, dim=-1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        top_ps = [s.params.top_p for s in seqs]
        if any(p < 1.0 for p in top_ps):
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
            cumulative = sorted_probs.cumsum(dim=-1)
            # Drop a token when the tokens before it already reach top_p (the top token always stays).
            drop = (cumulative - sorted_probs) >= torch.tensor(top_ps, device=device).unsqueeze(1)
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
        min_ps = [s.params.min_p for s in seqs]
        if any(p > 0 for p in min_ps):
            threshold = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_ps, device=device).unsqueeze(1)
            probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        out = torch.empty(len(seqs), dtype=torch.long, device=device)
        unseeded = [i for i, s in enumerate(seqs) if s.sampling_seed is None]
        if unseeded:
            out[unseeded] = torch.multinomial(probs[unseeded], 1, generator=self._generator(device)).squeeze(1)
        for i, seq in enumerate(seqs):
            if seq.sampling_seed is not None:
                if seq.generator is None:
                    seq.generator = torch.Generator(device=device).manual_seed(seq.sampling_seed)
                out[i] = torch.multinomial(probs[i], 1, generator=seq.generator)[0]
        return out


def _apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    if p.repetition_penalty != 1.0:
        # HF semantics: over prompt and output tokens; divide positive logits, multiply negative ones.
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=logits.device)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and seq.num_output_tokens:
        # OpenAI semantics: over generated tokens only.
        output_ids = torch.tensor(seq.output_token_ids, device=logits.device)
        counts = torch.bincount(output_ids, minlength=logits.shape[-1]).to(logits.dtype)
        logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _logprob(logits: torch.Tensor, token_id: int, num_top: int) -> Logprob:
    logprobs = torch.log_softmax(logits, dim=-1)
    top: list[tuple[int, float]] = []
    if num_top > 0:
        values, ids = torch.topk(logprobs, num_top)
        # tokens a grammar forbids have logprob -inf: no alternative at all (and JSON has no -Infinity)
        top = [(t, v) for t, v in zip(ids.tolist(), values.tolist()) if v != float("-inf")]
    return Logprob(token_id, float(logprobs[token_id]), top)


def prompt_logprobs(logits: torch.Tensor, targets: list[int], num_top: int) -> list[Logprob]:
    """One Logprob a row of `logits` (a chunk of at most PROMPT_LOGPROBS_CHUNK rows): its log-softmax at the target
    token (the next prompt token), with the num_top best alternatives. Raw logits, as vLLM's prompt logprobs: no
    penalty or temperature applies to a prompt."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(targets, dtype=torch.long, device=logprobs.device).unsqueeze(1)
    own = logprobs.gather(1, ids).squeeze(1).tolist()
    if num_top > 0:
        values, top_ids = torch.topk(logprobs, num_top, dim=-1)
        tops = [list(zip(t, v)) for t, v in zip(top_ids.tolist(), values.tolist())]
    else:
        tops = [[] for _ in targets]
    return [Logprob(t, v, top) for t, v, top in zip(targets, own, tops)]


def _force_reasoning_end(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Rows whose thinking budget is spent can only take the end-of-thinking token (vLLM's thinking-budget logits
    processor): it is sampled, and its logprob is that of the distribution it was drawn from."""
    forced = [(i, seq.reasoning.forced_token()) for i, seq in enumerate(seqs) if seq.reasoning is not None]
    forced = [(i, token_id) for i, token_id in forced if token_id is not None]
    if not forced:
        return logits
    logits = logits.clone()
    for i, token_id in forced:
        kept = logits[i, token_id].clone()
        logits[i] = float("-inf")
        logits[i, token_id] = kept if torch.isfinite(kept) else 0.0
    return logits
