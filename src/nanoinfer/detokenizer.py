"""Stop strings on incrementally detokenized text (vLLM v1's output processor): after each engine step, the new tokens
of every sequence with stop strings go through its own detokenizer, each token once (in a window of a few), and only
the new text, with the few characters before it that a stop string could start in, is searched. LLM.step() runs this
and finishes the sequences that hit one; the engine itself deals in token ids only.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoinfer.engine.sequence import Request, Sequence

REPLACEMENT_CHAR = "\ufffd"  # what a decode gives for a character whose bytes have not all come yet


class IncrementalDetokenizer:
    """The text of a growing list of token ids, one token at a time, as `tokenizer.decode` gives it for the whole list.

    A new token is decoded in a window that starts at the tokens which last added text (vLLM's prefix and read
    offsets): its text is what the window decodes to beyond those tokens' own. The context is what makes a token's
    text the one a full decode has: a decode drops the leading space of its first SentencePiece word, and the bytes of
    a character split across tokens decode only together. Text that ends in U+FFFD waits in `pending` until the
    character's last byte comes (or more text follows it). A special token that skip_special_tokens leaves out never
    enters the window: a run of them (EOS after EOS under ignore_eos) would otherwise grow it.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.pending = ""  # text of the tokens read but not yet added to `text` (it ends in U+FFFD), else ""
        self.num_chars = 0  # len(text)
        self._pieces: list[str] = []
        # tokens[prefix_offset:]: the tokens that last added text (decoded as context), then those read since
        self._window: list[int] = []
        self._num_context_tokens = 0
        self._context_text: str | None = ""  # their decode (None: not yet decoded)
        self._is_skipped: dict[int, bool] = {}  # token id -> a special token the decode leaves out, for ids asked

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    def add(self, token_id: int) -> str:
        """Read the next token; returns the text it adds ("" while a character is incomplete or it decodes to
        nothing, as a skipped special token does)."""
        if self._is_skipped.get(token_id):
            return ""
        window = self._window
        window.append(token_id)
        if self._context_text is None:
            self._context_text = self._decode(window[: self._num_context_tokens])
        context_text = self._context_text
        window_text = self._decode(window)
        if len(window_text) <= len(context_text) or window_text.endswith(REPLACEMENT_CHAR):
            if window_text == context_text and self._skips(token_id):
                window.pop()  # as if it never came, as in a decode of all the tokens
            else:
                self.pending = window_text[len(context_text) :]
            return ""
        new_text = window_text[len(context_text) :]
        del window[: self._num_context_tokens]  # the tokens read become the next token's context
        self._num_context_tokens = len(window)
        self._context_text = None
        self.pending = ""
        self._pieces.append(new_text)
        self.num_chars += len(new_text)
        return new_text

    def _skips(self, token_id: int) -> bool:
        """Is `token_id` a special token that this detokenizer's decode leaves out (it has text when not skipped)?"""
        if token_id not in self._is_skipped:
            decode = self.tokenizer.decode
            skipped = self.skip_special_tokens and decode([token_id], skip_special_tokens=True) == ""
            self._is_skipped[token_id] = skipped and decode([token_id], skip_special_tokens=False) != ""
        return self._is_skipped[token_id]

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens) if token_ids else ""


@dataclass
class StopHit:
    """A sequence whose text holds one of its stop strings."""

    seq: Sequence
    num_output_tokens: int  # its output ends at this token: the one that completed the stop string
    stop: str
    text: str  # the output text before the stop string


class StopStringChecker:
    """The sequences with stop strings, each with its detokenizer, from their request's admission to their end."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._sequences: dict[int, _SequenceStops] = {}

    def add(self, request: Request) -> None:
        """Watch the request's sequences, if it has stop strings."""
        if request.sampling_params.stop:
            for seq in request.sequences:
                self._sequences[seq.seq_id] = _SequenceStops(seq, self.tokenizer)

    def check(self) -> list[StopHit]:
        """After an engine step: every watched sequence's new tokens decoded and its new text searched. Returns those
        that hit a stop string; a sequence that hit one or has finished is no longer watched."""
        hits = []
        for seq_id, state in list(self._sequences.items()):
            hit = state.read_new_tokens()
            if hit is not None:
                hits.append(hit)
            if hit is not None or state.seq.is_finished:
                del self._sequences[seq_id]
        return hits


class _SequenceStops:
    """One sequence's detokenizer and the text still to be searched for its stop strings."""

    def __init__(self, seq: Sequence, tokenizer):
        self.seq = seq
        self.detokenizer = IncrementalDetokenizer(tokenizer, seq.params.skip_special_tokens)
        self.num_read = 0  # output tokens decoded
        # A stop string that ends in new text starts at most this many characters before it.
        self.num_tail_chars = max(map(len, seq.params.stop)) - 1
        self.unsearched = ""  # text not yet searched (all of it before min_tokens), after that many searched characters

    def read_new_tokens(self) -> StopHit | None:
        """Decode the output tokens added since the last call, one at a time: a stop string counts from the token that
        completes it (and from min_tokens), as when the text was searched after every token."""
        seq = self.seq
        params = seq.params
        num_output_tokens = seq.num_output_tokens
        # The scheduler's own stop at the last token (EOS, a stop token id, the grammar's end, an error) comes before a
        # stop string there; a length limit comes after one.
        last_is_taken = seq.is_finished and seq.finish_reason != "length"
        detokenizer = self.detokenizer
        while self.num_read < num_output_tokens:
            token_id = seq.token_ids[seq.num_prompt_tokens + self.num_read]
            self.num_read += 1
            self.unsearched += detokenizer.add(token_id)
            if self.num_read < params.min_tokens or (last_is_taken and self.num_read == num_output_tokens):
                continue
            found = _first_stop(self.unsearched + detokenizer.pending, params.stop)
            if found is not None:
                index, stop = found
                start = detokenizer.num_chars - len(self.unsearched)  # where self.unsearched begins in the text
                text = (detokenizer.text + detokenizer.pending)[: start + index]
                return StopHit(seq, self.num_read, stop, text)
            self.unsearched = self.unsearched[-self.num_tail_chars :] if self.num_tail_chars else ""
        return None


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """(index, stop string) of the stop string that starts first in `text` (the first listed of those that start
    there), or None."""
    best = None
    for stop in stops:
        index = text.find(stop)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best
