"""Reasoning parsers: a chat answer's text split into `reasoning_content` (the thinking) and `content` (the answer),
vLLM's names, for the templates that think first.

- "think": `<think>...</think>` (Qwen3, SmolLM3, QwQ, DeepSeek-R1 and its distills). A generation prompt may open the
  thinking itself (DeepSeek-R1's template, Qwen3's thinking models end it with `<think>`): the output then starts
  inside the reasoning, without the start tag. A template that switched thinking off (Qwen3's enable_thinking=False)
  closes an empty one in the prompt: the output is content, a `</think>` in it included (prompt_closed).
- "harmony": gpt-oss's messages (the text decoded with its special tokens): the analysis channel is reasoning; the
  final channel and commentary without a recipient (preambles) are content, in the order written, one a line. A
  message with a recipient (`to=functions.NAME`) is a tool call: it stays in content as written, and the "harmony"
  tool-call parser (tool_calls.py, which reads the raw text with harmony_messages) takes it out when it is a valid call.

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


def split_reasoning(parser: str, text: str, prompt_opened: bool = False, prompt_closed: bool = False) -> ReasoningSplit:
    """`text` (the output, special tokens kept for harmony) into reasoning and content. prompt_opened / prompt_closed:
    the rendered prompt ended inside a thought / after a closed one (prompt_opens_thinking, prompt_closes_thinking);
    "think" reads them, "harmony" has no such prompts."""
    if parser == "think":
        return _split_think(text, prompt_opened, prompt_closed)
    if parser == "harmony":
        return _split_harmony(text)
    raise ValueError(f"unknown reasoning parser {parser!r}")


def _split_think(text: str, prompt_opened: bool, prompt_closed: bool) -> ReasoningSplit:
    if prompt_closed:  # thinking was switched off: a `</think>` the answer writes is its text, not an end of thought
        return ReasoningSplit(None, text)
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


@dataclass(frozen=True)
class HarmonyMessage:
    channel: str | None  # analysis, commentary, final (None: the header named none)
    recipient: str | None  # `to=...` in the header (functions.NAME for a tool call), None for a message to the user
    body: str
    ended: bool  # its <|end|>, <|call|> or <|return|> was written
    text: str  # the message as written, header and end token included


_HARMONY_START, _HARMONY_ENDS = "<|start|>", re.compile(r"<\|end\|>|<\|call\|>|<\|return\|>")
_HARMONY_CHANNEL_NAME, _HARMONY_RECIPIENT = re.compile(r"<\|channel\|>\s*(\w+)"), re.compile(r"\bto=([^\s<]+)")


def harmony_messages(text: str) -> list[HarmonyMessage]:
    """gpt-oss's output as its messages: `[<|start|>role][ to=R]<|channel|>C[ to=R][ type][<|constrain|>type]<|message|>
    body<|end|>` (or <|call|>, <|return|>). The first message's `<|start|>assistant` is the prompt's; the recipient
    may come before the channel or after it. Text outside any `<|message|>` (a header cut off) is left out."""
    messages = []
    for i, piece in enumerate(text.split(_HARMONY_START)):
        written = piece if i == 0 else _HARMONY_START + piece
        header, sep, rest = piece.partition(HARMONY_MESSAGE)
        if sep:
            end = _HARMONY_ENDS.search(rest)
            body = rest[: end.start()] if end else rest
            channel, recipient = _HARMONY_CHANNEL_NAME.search(header), _HARMONY_RECIPIENT.search(header)
            text_end = len(written) - len(rest) + (end.end() if end else len(rest))
            messages.append(HarmonyMessage(channel[1] if channel else None, recipient[1] if recipient else None, body,
                                           end is not None, written[:text_end]))  # fmt: skip
    return messages


def harmony_content(messages: list[HarmonyMessage], text: str, keep_calls: bool = True) -> str | None:
    """The content of gpt-oss's output (`text`, split into `messages`): final and recipient-less commentary bodies in
    the order written, one a line, and the messages with a recipient as written (keep_calls) or left out; the whole
    text when it has no messages (a model that did not write the format)."""
    if not messages:
        return text.strip() or None
    parts = []
    for message in messages:
        if message.recipient is None and message.channel != "analysis":
            parts.append(message.body.strip())
        elif message.recipient is not None and keep_calls:
            parts.append(message.text.strip())
    return "\n".join(part for part in parts if part) or None


def _split_harmony(text: str) -> ReasoningSplit:
    messages = harmony_messages(text)
    analysis = [message for message in messages if message.channel == "analysis" and message.recipient is None]
    reasoning = "\n".join(message.body.strip() for message in analysis) if analysis else None
    # Only the last thought can be cut off: a message after it means it ended.
    finished = not analysis or analysis[-1].ended or analysis[-1] is not messages[-1]
    return ReasoningSplit(reasoning, harmony_content(messages, text), finished=finished)
