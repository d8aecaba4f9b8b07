"""Structured output through xgrammar: grammars compiled off the critical path, a matcher per sequence, and
the token bitmask that every sampled token of a constrained sequence goes through."""

from nanoinfer.structured_output.bitmask import apply_grammar_bitmask, fill_grammar_bitmask
from nanoinfer.structured_output.manager import (
    COMPILE_TIMEOUT_S,
    StructuredOutputManager,
    StructuredOutputRequest,
)

__all__ = [
    "COMPILE_TIMEOUT_S",
    "StructuredOutputManager",
    "StructuredOutputRequest",
    "apply_grammar_bitmask",
    "fill_grammar_bitmask",
]
