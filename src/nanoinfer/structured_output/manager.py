"""Compiling requests' grammars: one xgrammar compiler per engine, each distinct grammar compiled once.

Compiles run on background threads, so a request whose grammar is still compiling waits in the queue while
the rest of the batch runs (vLLM's WAITING_FOR_FSM). A grammar that fails to compile, or takes longer than
COMPILE_TIMEOUT_S, finishes its request with an error naming the problem; nothing else is affected.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from nanoinfer.sampling_params import StructuredOutputsParams

COMPILE_TIMEOUT_S = 30.0  # README "Structured output"; xgrammar compiles ordinary schemas in milliseconds
MAX_CACHED_GRAMMARS = 1024  # compiled grammars kept for reuse (a job usually has a handful of schemas)
_COMPILE_THREADS = 2
_XGRAMMAR_PREFIX = re.compile(r"^(\[[^\]]*\]\s*)?(\S+\.(cc|h|cpp):\d+:\s*)?")


class StructuredOutputRequest:
    """A request's grammar: pending while it compiles, then ready (new_matcher) or failed (error)."""

    def __init__(self, params: StructuredOutputsParams, future: Future, timeout_s: float):
        self.params = params
        self.future = future
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s

    @property
    def is_pending(self) -> bool:
        return not self.future.done() and time.monotonic() < self.deadline

    @property
    def error(self) -> str | None:
        """Why the grammar cannot be used (None while pending or once compiled)."""
        if not self.future.done():
            if time.monotonic() < self.deadline:
                return None
            return (f"the {self.params.kind} grammar did not compile within {self.timeout_s:g} s; simplify it "
                    "(e.g. smaller repetition bounds or maxLength).")
        e = self.future.exception()
        if e is None:
            return None
        text = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        text = _XGRAMMAR_PREFIX.sub("", text)  # xgrammar's "[time] /project/cpp/file.cc:123: "
        return f"the {self.params.kind} given in structured_outputs cannot be used: {text[:500]}"

    def new_matcher(self):
        """A fresh matcher for one sequence (each of n sequences walks the grammar on its own)."""
        import xgrammar

        return xgrammar.GrammarMatcher(self.future.result())


class StructuredOutputManager:
    """Compiles grammars for one tokenizer and vocabulary, caching them by their canonical text.

    Args:
        tokenizer: the LLM's tokenizer (nanoinfer's FastTokenizer or a transformers tokenizer).
        vocab_size: the model's logits width (may exceed the tokenizer's vocabulary: padding).
        eos_token_ids: the tokens that end a sequence; a grammar allows them where it may end.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, compile_timeout_s: float = COMPILE_TIMEOUT_S):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.compile_timeout_s = compile_timeout_s
        self._executor: ThreadPoolExecutor | None = None
        self._compiler = None
        self._compiler_lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()

    def request_for(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """Start compiling `params`' grammar (or reuse it) and return the request's handle at once."""
        key = params.cache_key()
        future = self._cache.get(key)
        if future is None:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(_COMPILE_THREADS, thread_name_prefix="nanoinfer-grammar")
            future = self._executor.submit(self._compile, params)
            self._cache[key] = future
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)  # requests hold their own future: eviction only stops reuse
        else:
            self._cache.move_to_end(key)
        return StructuredOutputRequest(params, future, self.compile_timeout_s)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    # ---- on a compile thread --------------------------------------------------------------------------
    def _compile(self, params: StructuredOutputsParams):
        compiler = self._get_compiler()
        kind, value = params.kind, getattr(params, params.kind)
        if kind in ("json", "json_object"):
            schema = value if isinstance(value, str) else json.dumps(value)
            schema = '{"type": "object"}' if kind == "json_object" else schema
            return compiler.compile_grammar(_json_schema_ebnf(schema, params.any_whitespace))
        if kind == "regex":
            return compiler.compile_regex(value)
        if kind == "choice":  # EBNF string literals take JSON's escapes
            return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value))
        return compiler.compile_grammar(value)

    def _get_compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(
                    _hf_tokenizer(self.tokenizer), vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
                )
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=_COMPILE_THREADS)
            return self._compiler


# Two leniencies of xgrammar 0.2.9's JSON strings, closed here on the grammar's text: a string with a length
# bound (minLength / maxLength) takes [^"\\\r\n], raw control characters included (a tab, U+001F), which
# RFC 8259 refuses and json.loads rejects; and every string takes UTF-8-encoded surrogates (ED A0 80), which
# are no characters: they decode to U+FFFD, and a maxLength counted them as one. Both classes become one that
# excludes U+0000-U+001F and U+D800-U+DFFF.
_STRING_CHARACTERS = ('[^\\"\\\\\\r\\n]', '[^\\0-\\x1f\\"\\\\\\r\\n]')
_JSON_STRING_CHARACTER = '[^\\0-\\x1f\\"\\\\\\r\\n\\uD800-\\uDFFF]'


def _json_schema_ebnf(schema: str, any_whitespace: bool) -> str:
    import xgrammar

    ebnf = str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=any_whitespace))
    for loose in _STRING_CHARACTERS:
        ebnf = ebnf.replace(loose, _JSON_STRING_CHARACTER)
    return ebnf


def _hf_tokenizer(tokenizer):
    """xgrammar reads vocabularies from transformers tokenizers; wrap nanoinfer's own (a tokenizers.Tokenizer)."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        return tokenizer  # already a transformers tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=backend)
