"""EmbedLineRunner: LineRunner for `nanoinfer embed`, one engine request per input of a line, one record per line.

An OpenAI /v1/embeddings line may hold several inputs: each becomes a request "<line>.<index>", and the line's
record is written once all of them are back. One input that fails makes the whole line an error record (after
its other inputs finish: the engine has no way to cancel them), as one request with a bad input fails at OpenAI.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from nanoinfer.errors import RequestError
from nanoinfer.jobs.line_runner import FinishedLine, LineRunner
from nanoinfer.jsonl.embed import EmbedRequest, embedding_error_record, embedding_record, sum_usage
from nanoinfer.jsonl.lines import LineError, internal_error_message

logger = logging.getLogger("nanoinfer")


@dataclass
class _Line:
    request: EmbedRequest
    outputs: list = field(default_factory=list)  # one slot per input, filled as its request finishes
    num_waiting: int = 0  # its requests still in the engine
    error: LineError | None = None  # the first failure of one of its inputs


class EmbedLineRunner(LineRunner):
    """`pending` maps each engine request to its line, so LineRunner.run's max_in_flight counts requests."""

    def __init__(self, llm):
        super().__init__(llm)
        self.pending: dict[str, tuple[_Line, int]] = {}  # request id -> (its line, the input's index)

    def add(self, item: EmbedRequest | LineError) -> FinishedLine | None:
        if isinstance(item, LineError):
            return _error_line(item)
        line = _Line(item, [None] * len(item.inputs))
        for index, prompt in enumerate(item.inputs):
            request_id = f"{item.line}.{index}"
            try:
                self.llm.add_request(prompt, item.params, request_id=request_id)
            except RequestError as e:
                line.error = self._line_error(line, index, e.code, str(e))
                break
            except Exception as e:  # the per-line boundary: a bug here must not end the job
                logger.debug("line %d: unexpected error while admitting", item.line, exc_info=True)
                line.error = self._line_error(line, index, "internal_error", internal_error_message(e))
                break
            self.pending[request_id] = (line, index)
            line.num_waiting += 1
        return self._finish(line) if line.num_waiting == 0 else None

    def step(self):
        outputs, stats = self.llm.step()
        finished = []
        for output in outputs:
            line, index = self.pending.pop(output.request_id)
            line.num_waiting -= 1
            line.outputs[index] = output
            if output.finish_reason == "error" and line.error is None:
                code = getattr(output, "error_code", None) or "request_failed"
                line.error = self._line_error(line, index, code, output.error)
            if line.num_waiting == 0:
                finished.append(self._finish(line))
        return finished, stats

    def _finish(self, line: _Line) -> FinishedLine:
        if line.error is not None:
            return _error_line(line.error)
        request = line.request
        try:
            record = embedding_record(request, line.outputs)
        except Exception as e:  # a record that cannot be built is that line's error, not the job's
            logger.debug("line %d: unexpected error while building its record", request.line, exc_info=True)
            return _error_line(self._line_error(line, None, "internal_error", internal_error_message(e)))
        return FinishedLine(request.line, record, sum_usage(line.outputs), False)

    @staticmethod
    def _line_error(line: _Line, index: int | None, code: str, message: str) -> LineError:
        request = line.request
        where = f"input {index}: " if index is not None and len(request.inputs) > 1 else ""
        return LineError(request.line, request.id, request.kind, code, f"line {request.line}: {where}{message}")


def _error_line(error: LineError) -> FinishedLine:
    return FinishedLine(error.line, embedding_error_record(error), None, True)
