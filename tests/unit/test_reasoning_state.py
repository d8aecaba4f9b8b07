"""The engine's view of a thinking model's output (engine/sequence.ReasoningState): where the output is, when a
grammar holds a token, when the thinking budget forces the end-of-thinking token."""

from __future__ import annotations

import pytest

from nanoinfer.engine.sequence import ReasoningState, ReasoningTokens

START, END = 7, 8


def state(opened=False, closed=False, budget=None) -> ReasoningState:
    return ReasoningState(ReasoningTokens(START, END, opened_by_prompt=opened, closed_by_prompt=closed), budget)


def test_a_first_token_may_open_the_thinking_which_the_end_token_closes():
    s = state()
    assert s.at_first_token and s.holds_grammar(5) and not s.holds_grammar(START)
    s.advance(START, first=True)
    assert s.open and not s.holds_grammar(5)
    for token in (1, 2, 3):
        s.advance(token, first=False)
    assert s.num_tokens == 3 and not s.holds_grammar(END)  # the end token is the thinking's, not the grammar's
    s.advance(END, first=False)
    assert s.done and not s.open and s.holds_grammar(5)


def test_an_answer_that_does_not_start_thinking_is_content_from_its_first_token():
    s = state()
    s.advance(5, first=True)
    assert s.done and s.holds_grammar(START)  # a later <think> is text of the answer
    s.advance(START, first=False)
    assert s.done and not s.open


@pytest.mark.parametrize("opened, closed, open_, done", [(True, False, True, False), (False, True, False, True)])
def test_the_prompt_may_open_or_close_the_thinking(opened, closed, open_, done):
    s = state(opened=opened, closed=closed)
    assert (s.open, s.done, s.at_first_token) == (open_, done, False)


@pytest.mark.parametrize("budget", [0, 1, 4])
def test_the_budget_forces_the_end_token_once_spent(budget):
    s = state(opened=True, budget=budget)
    for _ in range(budget):
        assert s.forced_token() is None
        s.advance(1, first=False)
    assert s.forced_token() == END
    s.advance(END, first=False)
    assert s.forced_token() is None and s.done


def test_no_budget_never_forces():
    s = state(opened=True)
    for _ in range(100):
        s.advance(1, first=False)
    assert s.forced_token() is None and s.open
