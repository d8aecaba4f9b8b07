"""The incremental detokenizer (nanoinfer/detokenizer.py) against a full decode after every token, and the stop-string
search on its text against a search of the whole text after every token (how stop strings were found before).

Tokenizers: the tiny models' byte-level BPE, and SentencePiece-style ones built here (a "▁" for each space, <0xNN>
byte-fallback tokens for characters outside the vocabulary) with the decoders of Llama (which drops a decode's first
leading space), Gemma (which keeps it) and a Metaspace decoder.
"""

from __future__ import annotations

import json
import random

import pytest
from factories import make_request, stop_by_full_decode

from nanoinfer.detokenizer import IncrementalDetokenizer, StopStringChecker
from nanoinfer.engine.sequence import SequenceStatus
from nanoinfer.testing.tiny_models import CORPUS, build_tokenizer
from nanoinfer.tokenizer import FastTokenizer

TEXTS = [
    CORPUS[:300],
    "Grüße aus Köln — naïve café, 東京都 and 中文字符, emoji 😀👍🏽 and 🧑‍🚀, tabs\tand\nnewlines  double  spaces.",
    " leading space, then . , ; punctuation 'quoted' \"double\" (paren) [x] {y} 1.5e-3 ä",
]


def sentencepiece_tokenizer(decoder: str) -> FastTokenizer:
    """A BPE over "▁"-marked words with 256 byte-fallback tokens, trained on CORPUS, decoded as `decoder` decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trained.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                              show_progress=False))  # fmt: skip
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    spaces_and_bytes = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = {
        "llama": decoders.Sequence([*spaces_and_bytes, decoders.Strip(" ", 1, 0)]),
        "gemma": decoders.Sequence(spaces_and_bytes),
        "metaspace": decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace("▁", prepend_scheme="first")]),
    }[decoder]
    return FastTokenizer(tok, {"eos_token": "</s>"})


TOKENIZERS = ["byte-level BPE", "sentencepiece llama", "sentencepiece gemma", "sentencepiece metaspace"]


@pytest.fixture(scope="module", params=TOKENIZERS)
def tokenizer(request):
    if request.param == "byte-level BPE":
        return build_tokenizer(thinking=True)  # transformers' tokenizer; special tokens and added ones
    return sentencepiece_tokenizer(request.param.split()[1])


def test_sentencepiece_tokenizers_split_characters_into_bytes_and_drop_a_leading_space_as_their_models_do():
    # What makes them worth testing: characters across byte tokens, a word's space in its first token, and (for
    # Llama's and the Metaspace decoder) a decode that drops the first token's space but keeps the others'.
    llama, gemma = sentencepiece_tokenizer("llama"), sentencepiece_tokenizer("gemma")
    ids = llama.encode("the 東 fox")
    assert sum(llama.backend.id_to_token(i).startswith("<0x") for i in ids) == 3
    assert llama.decode(ids) == "the 東 fox" and gemma.decode(ids) == " the 東 fox"
    the = llama.encode("is the")[-1:]
    assert llama.backend.id_to_token(the[0]) == "▁the" and llama.decode(the) == "the" and gemma.decode(the) == " the"


def has_byte_fallback(tokenizer) -> bool:
    return "<0x41>" in tokenizer.get_vocab()


def check_each_step(tokenizer, token_ids: list[int], skip_special_tokens: bool) -> str:
    """Feed `token_ids` one at a time, checking the detokenizer against a full decode after each; returns its text.

    Its text is the full decode whenever that ends in a whole character. A decode that ends in U+FFFD (a character
    whose bytes have not all come) is the text and `pending`, except with byte-fallback tokens: tokenizers'
    ByteFallback decodes a run of byte tokens that is not UTF-8 (yet) as one U+FFFD a byte, the whole characters
    before the incomplete one included, while the detokenizer has read those already."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    text = ""
    for n, token_id in enumerate(token_ids, 1):
        new_text = detokenizer.add(token_id)
        full = tokenizer.decode(token_ids[:n], skip_special_tokens=skip_special_tokens)
        assert detokenizer.text == text + new_text  # text is only ever added to
        text = detokenizer.text
        assert detokenizer.num_chars == len(text)
        if not full.endswith("\ufffd"):
            assert (text, detokenizer.pending) == (full, ""), token_ids[:n]
        elif not has_byte_fallback(tokenizer):
            assert text + detokenizer.pending == full, token_ids[:n]
    return text


def random_character(rng) -> str:
    low, high = rng.choice([(0x20, 0x7E), (0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFD), (0x10000, 0x10FFFF)])
    return chr(rng.randint(low, high))


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_text_is_the_full_decode_at_every_step_on_random_tokens(tokenizer, skip_special_tokens):
    """Random ids, with runs of special tokens and of one token repeated. A SentencePiece tokenizer's byte tokens
    come as the bytes of whole characters: a run of byte tokens that is not UTF-8 decodes as one U+FFFD a byte
    (check_each_step), so a byte that made a character ("<0x32>": "2") would turn into U+FFFD in a full decode when
    a stray byte follows it, text no incremental decode can take back. Byte-level BPE decodes any ids as a stream."""
    rng = random.Random(0)
    vocab = tokenizer.get_vocab()
    byte_ids = {vocab[f"<0x{b:02X}>"] for b in range(256)} if has_byte_fallback(tokenizer) else set()
    ids = [i for i in range(len(tokenizer)) if i not in byte_ids]
    special = [vocab[t] for t in ("<|im_end|>", "</s>") if t in vocab]
    for _ in range(150):
        token_ids = []
        while len(token_ids) < rng.randint(1, 40):
            kind = rng.random()
            if kind < 0.1 and special:
                token_ids += [rng.choice(special)] * rng.randint(1, 3)
            elif kind < 0.2:
                token_ids += [rng.choice(ids)] * rng.randint(2, 4)
            elif kind < 0.4 and byte_ids:
                token_ids += [vocab[f"<0x{b:02X}>"] for b in random_character(rng).encode()]
            else:
                token_ids.append(rng.choice(ids))
        check_each_step(tokenizer, token_ids, skip_special_tokens)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_of_encoded_text_is_that_text(tokenizer, text):
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(token_ids, skip_special_tokens=True)
    assert full.strip() == text.strip()  # (SentencePiece decoders may drop or add the first space)
    assert check_each_step(tokenizer, token_ids, skip_special_tokens=True) == full


class CountingTokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.calls: list[int] = []  # the number of ids each decode was given

    def decode(self, token_ids, skip_special_tokens=False):
        self.calls.append(len(token_ids))
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("text", TEXTS)
def test_each_token_is_decoded_in_a_window_of_a_few_tokens(tokenizer, text):
    # A full decode after every token costs n^2 / 2 token decodes for n tokens; the window costs a few per token.
    token_ids = tokenizer.encode(text * 3, add_special_tokens=False)
    counting = CountingTokenizer(tokenizer)
    detokenizer = IncrementalDetokenizer(counting)
    for token_id in token_ids:
        detokenizer.add(token_id)
    # Two a token: the new window, and its context once it has moved on (and, once for a token that adds no text,
    # whether it is a special token to leave out)
    assert len(counting.calls) <= 2 * len(token_ids) + 2
    assert max(counting.calls) <= 8, max(counting.calls)  # 4 bytes of a character split into 4 tokens, and context
    assert sum(counting.calls) <= 5 * len(token_ids)  # about 3 for most text


def test_skipped_special_tokens_stay_out_of_the_window(tokenizer):
    # EOS after EOS (ignore_eos) adds no text: decoded once, then never again, and the window does not grow.
    eos = tokenizer.get_vocab()[tokenizer.eos_token]
    token_ids = tokenizer.encode("The quick", add_special_tokens=False) + [eos] * 50
    token_ids += tokenizer.encode("The fox", add_special_tokens=False)
    counting = CountingTokenizer(tokenizer)
    detokenizer = IncrementalDetokenizer(counting, skip_special_tokens=True)
    for token_id in token_ids:
        detokenizer.add(token_id)
    assert detokenizer.text == tokenizer.decode(token_ids, skip_special_tokens=True)
    assert len(counting.calls) <= 2 * (len(token_ids) - 50) + 4 and max(counting.calls) <= 4
    assert check_each_step(tokenizer, token_ids, skip_special_tokens=False) == tokenizer.decode(token_ids)


# ---- stop strings on the detokenized text ------------------------------------------------------------------------


def run_checker(tokenizer, output_token_ids: list[int], tokens_per_step: list[int], finish=None, **sampling):
    """A sequence that gets `output_token_ids` in steps of `tokens_per_step` (as speculation appends them), checked
    after each step; `finish`: the finish_reason the scheduler gave it at its last token. Returns the hit or None."""
    request = make_request(num_prompt_tokens=4, **sampling)
    seq = request.sequences[0]
    checker = StopStringChecker(tokenizer)
    checker.add(request)
    done = 0
    for num_new in tokens_per_step:
        seq.token_ids += output_token_ids[done : done + num_new]
        done += num_new
        if done == len(output_token_ids) and finish is not None:
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, finish
        hits = checker.check()
        if hits:
            assert hits[0].seq is seq and not checker._sequences  # no longer watched
            return hits[0]
    assert not checker._sequences or not seq.is_finished
    return None


def random_steps(rng, n: int) -> list[int]:
    steps = []
    while sum(steps) < n:
        steps.append(min(rng.choice([1, 1, 1, 2, 3, 5]), n - sum(steps)))
    return steps


def test_stop_strings_end_where_a_full_search_after_every_token_ends_them(tokenizer):
    """Strings across token boundaries, several stops (the one that starts first wins, then the first listed),
    min_tokens (a stop string in the text before it counts from it on), steps of several tokens (a kept proposal)."""
    rng = random.Random(1)
    num_hits = 0
    for _ in range(300):
        text = rng.choice(TEXTS)
        output_token_ids = tokenizer.encode(text, add_special_tokens=False)[: rng.randint(1, 40)]
        full = tokenizer.decode(output_token_ids, skip_special_tokens=True)
        stops = []
        for _ in range(rng.randint(1, 4)):
            start = rng.randrange(max(1, len(full)))
            stops.append(full[start : start + rng.randint(1, 6)].replace("\ufffd", "") or "x")
        if rng.random() < 0.2:
            stops.append("zzz-not-there")
        params = dict(stop=stops, min_tokens=rng.choice([0, 0, 1, 3, 8]), max_tokens=100)
        expected = stop_by_full_decode(tokenizer, output_token_ids, make_request(**params).sampling_params)
        hit = run_checker(tokenizer, output_token_ids, random_steps(rng, len(output_token_ids)), **params)
        assert (None if hit is None else (hit.num_output_tokens, hit.stop, hit.text)) == expected, (stops, params)
        num_hits += hit is not None
    assert num_hits > 200


def test_the_schedulers_own_stop_at_the_same_token_comes_first_and_a_length_limit_after():
    tokenizer = build_tokenizer()
    output_token_ids = tokenizer.encode("The quick brown fox", add_special_tokens=False)
    last = tokenizer.decode(output_token_ids[-1:])
    # The stop string completes at the last token: the scheduler's EOS (or stop token id) there is the reason.
    assert run_checker(tokenizer, output_token_ids, [len(output_token_ids)], finish="stop", stop=[last]) is None
    hit = run_checker(tokenizer, output_token_ids, [len(output_token_ids)], finish="length", stop=[last])
    assert (hit.num_output_tokens, hit.stop) == (len(output_token_ids), last)
    # Completed a token earlier, it comes first whatever the scheduler ended the sequence with.
    before_last = tokenizer.decode(output_token_ids[-2:-1])
    hit = run_checker(tokenizer, output_token_ids, [len(output_token_ids)], finish="stop", stop=[before_last])
    assert (hit.num_output_tokens, hit.stop) == (len(output_token_ids) - 1, before_last)


def test_a_stop_string_before_an_incomplete_character_is_found_at_the_token_that_completes_it():
    # A byte-level token can hold a space and the first byte of the next character ("Ġæ" of " 東"). The text it adds
    # waits for the character's other bytes, but the stop string "x " is searched in it already, as a full decode
    # (with U+FFFD for the byte) after that token would find it.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)} | {"Ġæ": len(alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "æ")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = FastTokenizer(backend, {})
    output_token_ids = tokenizer.encode("fox 東", add_special_tokens=False)
    assert [backend.id_to_token(i) for i in output_token_ids] == ["f", "o", "x", "Ġæ", "Ŀ", "±"]
    assert tokenizer.decode(output_token_ids[:4]) == "fox \ufffd"
    expected = stop_by_full_decode(tokenizer, output_token_ids, make_request(stop=["x "]).sampling_params)
    assert expected == (4, "x ", "fo")
    hit = run_checker(tokenizer, output_token_ids, [1] * len(output_token_ids), stop=["x "])
    assert (hit.num_output_tokens, hit.stop, hit.text) == expected
