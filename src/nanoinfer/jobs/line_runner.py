"""LineRunner: one LLM serving parsed JSONL lines, from BatchRequest to finished record.

Admits a line through LLM.add_request (which tokenizes and checks it) with the LoRA adapter it names, steps the
engine and builds each finished line's record; every failure of one line becomes that line's error record. Reading
lines and writing records is the caller's: `nanoinfer generate` on one engine, each Ray replica, and the Ray Data
predictor all run it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nanoinfer.chat.answer import ChatAnswer, ChatParsers, chat_answer
from nanoinfer.chat.reasoning import prompt_closes_thinking, prompt_opens_thinking
from nanoinfer.errors import RequestError, short_repr
from nanoinfer.jsonl.lines import LineError, internal_error_message
from nanoinfer.jsonl.records import error_record, result_record
from nanoinfer.jsonl.requests import BatchRequest
from nanoinfer.lora_request import LoRARequest, lora_requests

if TYPE_CHECKING:
    from nanoinfer.engine.engine import StepStats

logger = logging.getLogger("nanoinfer")


@dataclass
class FinishedLine:
    """One line's record, with what progress counts: its usage (None for an error record) and whether it failed."""

    line: int
    record: dict
    usage: dict | None
    is_error: bool


def error_line(error: LineError) -> FinishedLine:
    return FinishedLine(error.line, error_record(error), None, True)


class LineRunner:
    """Feeds BatchRequests to `llm` and hands back FinishedLines; `pending` holds the lines in the engine."""

    def __init__(self, llm):
        self.llm = llm
        self.pending: dict[str, BatchRequest] = {}
        self.loras = lora_requests(llm.config.loras)
        self._decode = lambda token_id: llm.tokenizer.decode([token_id])
        thinking = llm.thinking_token_ids
        special = thinking is not None and llm.tokenizer.decode(thinking[:1], skip_special_tokens=True) == ""
        self.parsers = ChatParsers(llm.reasoning_parser, llm.tool_call_parser, special_think_tokens=special)

    def add(self, item: BatchRequest | LineError) -> FinishedLine | None:
        """Queue a line in the engine (None), or return its error record at once."""
        if isinstance(item, LineError):
            return error_line(item)
        error = admit(self.llm, item, self.loras)
        if error is not None:
            return error_line(error)
        self.pending[str(item.line)] = item
        return None

    def run(self, items: Iterable[BatchRequest | LineError], max_in_flight: int,
            stopping: Callable[[], bool] = lambda: False) -> Iterator[FinishedLine | StepStats]:
        """Admit lines while fewer than max_in_flight are in the engine and step it, yielding each finished line
        and each step's StepStats, until every line is done (or `stopping()`: lines in the engine are left)."""
        items = iter(items)
        exhausted = False
        while not stopping():
            while not exhausted and len(self.pending) < max_in_flight and not stopping():
                item = next(items, None)
                if item is None:
                    exhausted = True
                elif (finished := self.add(item)) is not None:
                    yield finished
            if not self.pending:
                return
            finished_lines, stats = self.step()
            yield from finished_lines
            yield stats

    def step(self) -> tuple[list[FinishedLine], StepStats]:
        """One engine step: (the lines it finished, its StepStats)."""
        outputs, stats = self.llm.step()
        finished = []
        for output in outputs:
            request = self.pending.pop(output.request_id)
            if output.finish_reason == "error":
                code = getattr(output, "error_code", None) or "request_failed"  # e.g. a grammar that cannot compile
                finished.append(error_line(LineError(
                    request.line, request.id, request.kind, code, f"line {request.line}: {output.error}"
                )))
            else:
                finished.append(self._result(request, output))
        return finished, stats

    def _result(self, request: BatchRequest, output) -> FinishedLine:
        try:
            answers = [self._answer(request, c) for c in output.outputs] if request.messages is not None else None
            record = result_record(request, output, self._decode, answers)
        except Exception as e:  # a record that cannot be built is that line's error, not the job's
            logger.debug("line %d: unexpected error while building its record", request.line, exc_info=True)
            return error_line(LineError(request.line, request.id, request.kind, "internal_error",
                                              f"line {request.line}: {internal_error_message(e)}"))
        return FinishedLine(request.line, record, output.usage, False)

    def _answer(self, request: BatchRequest, completion) -> ChatAnswer:
        """A chat line's completion split into reasoning, content and tool calls (chat/answer.py)."""
        text = completion.text
        parses_tools = bool(request.tools) and request.tool_choice != "none"
        if self.parsers.needs_special_tokens(parses_tools):
            text = _text_with_special_tokens(self.llm, completion)
        return chat_answer(text, completion.finish_reason, self.parsers, prompt_opened=request.prompt_opens_thinking,
                           prompt_closed=request.prompt_closes_thinking, tools=request.tools,
                           tool_choice=request.tool_choice,
                           seed=f"{request.id}:{completion.index}")  # fmt: skip


def _text_with_special_tokens(llm, completion) -> str:
    """The completion decoded with its special tokens (where a format lives in them), less the token that ended it
    (EOS, a stop token id) and cut at its stop string, as its text is."""
    ids = completion.token_ids
    if ids and (ids[-1] in llm.eos_token_ids or ids[-1] == completion.stop_reason):
        ids = ids[:-1]
    text = llm.tokenizer.decode(ids, skip_special_tokens=False)
    if completion.finish_reason == "stop" and isinstance(completion.stop_reason, str):
        cut = text.find(completion.stop_reason)
        text = text[:cut] if cut >= 0 else text
    return text


def select_lora(request: BatchRequest, loras: dict[str, LoRARequest]) -> LoRARequest | None:
    """The adapter a line runs with (None: the base model): a native line's "lora", or an OpenAI line's body.model
    when it names one (any other model name is the base model, as in vLLM). A name the job lacks is a RequestError."""
    if request.is_openai:
        return loras.get(request.model) if request.model is not None else None
    if request.lora is None or request.lora in loras:
        return loras.get(request.lora)
    name = short_repr(request.lora, 80)
    add = f"Add it with --lora {request.lora[:80]}=PATH (or under `loras:` in the config file)"
    if not loras:
        raise RequestError(f"lora {name} names a LoRA adapter, but this job has none. {add}, or leave \"lora\" out "
                           "to use the base model.", code="unknown_lora")  # fmt: skip
    names = list(loras)
    known = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
    raise RequestError(f"lora {name} is not one of this job's LoRA adapters ({known}). {add}.", code="unknown_lora")


def admit(llm, request: BatchRequest, loras: dict[str, LoRARequest]) -> LineError | None:
    """Queue one line's request through LLM.add_request (the admission check) with its adapter, or say why it cannot
    be served (never raises: a line's boundary). The error's code is the RequestError's."""
    try:
        lora = select_lora(request, loras)
        if request.prompt_token_ids is not None:
            prompt = request.prompt_token_ids
        elif request.messages is not None:
            prompt = llm.apply_chat_template(request.messages, tools=request.tools,
                                             chat_template_kwargs=request.chat_template_kwargs)  # fmt: skip
            request.prompt_opens_thinking = prompt_opens_thinking(prompt)
            request.prompt_closes_thinking = prompt_closes_thinking(prompt)
        else:
            prompt = request.prompt
        llm.add_request(prompt, request.params, request_id=str(request.line), lora_request=lora,
                        chat=request.messages is not None)  # fmt: skip
    except RequestError as e:
        return LineError(request.line, request.id, request.kind, e.code, f"line {request.line}: {e}")
    except Exception as e:  # the per-line boundary: a bug here must not end the job
        logger.debug("line %d: unexpected error while admitting", request.line, exc_info=True)
        return LineError(request.line, request.id, request.kind, "internal_error",
                               f"line {request.line}: {internal_error_message(e)}")
    return None
