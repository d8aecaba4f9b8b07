"""One chat completion as OpenAI's chat API answers it: the reasoning split off (reasoning.py), then the tool calls
parsed, or read from the JSON decoding was held to for tool_choice "required" / a named function (tool_calls.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoinfer.chat.reasoning import split_reasoning
from nanoinfer.chat.tool_calls import call_id, parse_constrained_calls, parse_tool_calls


@dataclass(frozen=True)
class ChatAnswer:
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI's shape: id, type, function {name, arguments}
    finish_reason: str | None = None  # "tool_calls" when it chose to call tools, else the completion's


@dataclass(frozen=True)
class ChatParsers:
    """What a job splits and parses chat answers with (None: not at all). special_think_tokens: the model's <think>
    tokens are special ones (decoded text leaves them out)."""

    reasoning: str | None = None
    tool_calls: str | None = None
    special_think_tokens: bool = False

    def needs_special_tokens(self, parses_tools: bool) -> bool:
        """Do the formats live in special tokens (gpt-oss's channels, Mistral's [TOOL_CALLS], <think> where it is
        special)? Then the parsers read the output decoded with them. parses_tools: the line's calls are parsed."""
        return (self.reasoning == "harmony" or (self.reasoning == "think" and self.special_think_tokens)
                or (parses_tools and self.tool_calls in ("mistral", "harmony")))


def chat_answer(text: str, finish_reason: str | None, parsers: ChatParsers, *, prompt_opened: bool = False,
                prompt_closed: bool = False, tools: list | None = None, tool_choice=None,
                seed: str = "") -> ChatAnswer:  # fmt: skip
    """`text`, a chat completion's output, as content, reasoning_content and tool_calls. prompt_opened / closed: the
    prompt ended inside a thought / after a closed one; tools / tool_choice: the line's; seed: what makes the call
    ids (the line and choice). Only calls to the line's tools count: any other text stays content."""
    reasoning, content = None, text
    if parsers.reasoning is not None:
        split = split_reasoning(parsers.reasoning, text, prompt_opened, prompt_closed)
        reasoning, content = split.reasoning_content, split.content
        if not split.finished:  # cut off while thinking: no answer, and no call, was given
            return ChatAnswer(None, reasoning, [], finish_reason)
    calls = []
    if tools and tool_choice != "none" and content is not None:
        names = [tool["function"]["name"] for tool in tools]
        if tool_choice == "required" or isinstance(tool_choice, dict):
            calls = parse_constrained_calls(content, tool_choice)
            content = None if calls else content  # cut off before the JSON closed: the text as it came
        elif parsers.tool_calls == "harmony":  # calls are messages of their own, beside the final channel's
            calls, rest = parse_tool_calls("harmony", text, names)
            content = rest if calls else content
        elif parsers.tool_calls is not None:
            calls, content = parse_tool_calls(parsers.tool_calls, content, names)
    tool_calls = [call.to_openai(call_id(seed, i)) for i, call in enumerate(calls)]
    # The model chose to call ("auto"): finish_reason tool_calls. A call tool_choice forced keeps the completion's
    # own reason ("stop"), as OpenAI's API and vLLM answer forced calls.
    chose = tool_calls and not (tool_choice == "required" or isinstance(tool_choice, dict))
    return ChatAnswer(content, reasoning, tool_calls, "tool_calls" if chose else finish_reason)
