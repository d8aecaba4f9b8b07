"""Reasoning parsers: a chat answer's text split into `reasoning_content` (the thinking) and `content` (the answer),
vLLM's names, for the templates that think first.

- "think": `<think>...</think>` (Qwen3, SmolLM3, QwQ, DeepSeek-R1 and its distills). A generation prompt may open the
  thinking itself (DeepSeek-R1's template, Qwen3's thinking models end it with `<think>`): the output then starts
  inside the reasoning, without the start tag. A template that switched thinking off (Qwen3's enable_thinking=False)
  closes an empty one in the prompt: the output is content.
- "harmony": gpt-oss's channels: `<|channel|>analysis<|message|>...<|end|>` is reasoning, `<|channel|>final<|message|>`
  the answer (the text decoded with its special tokens).

Reasoning cut off before its end (max_tokens, or a budget) is reported as unfinished, never merged into the content.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"
HARMONY_CHANNEL, HARMONY_MESSAGE = "<|channel|>", "<|message|>"
REASONING_PARSERS = ("think", "harmony")


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning_content: str | None  # None: the answer did not think
    content: str | None  # None: nothing after the reasoning (unfinished, or only thinking)
    finished: bool = True  # False: the reasoning was cut off before its end


def select_reasoning_parser(vocab: dict[str, int], chat_template: str | None) -> str | None:
    """The parser for a tokenizer's vocabulary and chat template: "harmony" where gpt-oss's channel tokens are, "think"
    where `<think>` and `</think>` are tokens or the template writes them; None for a model that does not reason."""
    if HARMONY_CHANNEL in vocab and HARMONY_MESSAGE in vocab:
        return "harmony"
    template = chat_template or ""
    if (THINK_START in vocab and THINK_END in vocab) or (THINK_START in template and THINK_END in template):
        return "think"
    return None


def prompt_opens_thinking(prompt: str) -> bool:
    """Does the rendered prompt end inside an open `<think>` (the generation prompt started the reasoning)?"""
    start = prompt.rfind(THINK_START)
    return start >= 0 and THINK_END not in prompt[start:] and not prompt[start + len(THINK_START):].strip()


def prompt_closes_thinking(prompt: str) -> bool:
    """Does the rendered prompt end with a closed thought (`<think>...</think>` then only whitespace): a template that
    switched thinking off (Qwen3's enable_thinking false), whose answer is content from its first token?"""
    end = prompt.rfind(THINK_END)
    return end >= 0 and THINK_START in prompt[:end] and not prompt[end + len(THINK_END):].strip()


def split_reasoning(parser: str, text: str, prompt_opened: bool = False) -> ReasoningSplit:
    """`text` (the output, special tokens kept for harmony) into reasoning and content."""
    if parser == "think":
        return _split_think(text, prompt_opened)
    if parser == "harmony":
        return _split_harmony(text)
    raise ValueError(f"unknown reasoning parser {parser!r}")


def _split_think(text: str, prompt_opened: bool) -> ReasoningSplit:
    body = text.lstrip()
    opened = body.startswith(THINK_START)
    if opened:
        body = body[len(THINK_START) :]
    elif not prompt_opened:
        if THINK_END not in text:
            return ReasoningSplit(None, text)
        body = text  # a closing tag without an opening one: the template opened it (DeepSeek-R1's)
    end = body.find(THINK_END)
    if end < 0:
        return ReasoningSplit(body.strip() or None, None, finished=False)
    content = body[end + len(THINK_END) :].lstrip()
    return ReasoningSplit(body[:end].strip(), content or None)


_HARMONY_MESSAGE = re.compile(r"<\|channel\|>(?P<channel>\w+)[^<]*(?:<\|constrain\|>\w*)?<\|message\|>(?P<body>.*?)"
                              r"(?P<end><\|end\|>|<\|call\|>|<\|return\|>|$)", re.DOTALL)  # fmt: skip


def _split_harmony(text: str) -> ReasoningSplit:
    reasoning, content, finished = [], [], True
    for match in _HARMONY_MESSAGE.finditer(text):
        channel, body = match["channel"], match["body"]
        if channel == "analysis":
            reasoning.append(body.strip())
            finished = bool(match["end"])
        elif channel == "final":
            content.append(body.strip())
    if not reasoning and not content:
        return ReasoningSplit(None, text.strip() or None)
    return ReasoningSplit("\n".join(reasoning) if reasoning else None, "\n".join(content) if content else None,
                          finished=finished)  # fmt: skip
