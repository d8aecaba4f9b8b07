"""Input lines -> BatchRequest | LineError, lazily: bounded line reading (a line over the limit is skipped, never
held), BatchReader (the per-line boundary of a job) and generate's parse_request, which hands each line to its
format's parser. scan_input counts lines as the reader does, for the resume manifest and the progress total.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from nanoinfer.jsonl.lines import (
    _SURROGATE_ESCAPE,
    CHAT,
    EMBEDDINGS,
    NATIVE,
    BadLine,
    LineError,
    check_unicode,
    decode_line,
    internal_error_message,
    request_id_of,
)
from nanoinfer.jsonl.openai import _parse_openai, is_openai_line, line_kind
from nanoinfer.jsonl.requests import BatchRequest, _parse_native

logger = logging.getLogger(__name__)

# A line over MAX_LINE_BYTES is skipped unread with an error record (README "Limits"; the default fits any
# prompt a 1M-token context holds).
MAX_LINE_BYTES = 64 << 20
_READ_CHUNK = 1 << 20


class LineTooLong:
    """Stands in for the bytes of a line longer than the limit, which are skipped, never held in memory."""

    def __init__(self, num_bytes: int):
        self.num_bytes = num_bytes


def iter_lines(stream: Iterable[bytes], max_line_bytes: int = MAX_LINE_BYTES,
               first_line: int = 1) -> Iterator[tuple[int, bytes]]:
    """Lazily yield (line number from first_line, raw bytes or LineTooLong) for each non-blank line.

    A file object is read with a bounded readline, so one huge line costs at most max_line_bytes of memory.
    """
    for number, raw in enumerate(_bounded_lines(stream, max_line_bytes), start=first_line):
        if isinstance(raw, LineTooLong):
            yield number, raw
            continue
        if number == first_line and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]  # a UTF-8 byte order mark, as some editors write
        if raw.strip():
            yield number, raw


def _bounded_lines(stream, max_line_bytes: int) -> Iterator[bytes | LineTooLong]:
    readline = getattr(stream, "readline", None)
    if readline is None:  # a list or generator of lines (tests, the Python API)
        for raw in stream:
            yield LineTooLong(len(raw)) if len(raw.rstrip(b"\r\n")) > max_line_bytes else raw
        return
    while True:
        raw = readline(max_line_bytes + 2)  # room for the line's own \r\n
        if not raw:
            return
        if len(raw.rstrip(b"\r\n")) <= max_line_bytes:
            yield raw
            continue
        num_bytes = len(raw)
        while not raw.endswith(b"\n"):  # skip the rest of the line a chunk at a time
            raw = readline(_READ_CHUNK)
            if not raw:
                break
            num_bytes += len(raw)
        yield LineTooLong(num_bytes)


class BatchReader:
    """Input lines -> BatchRequest | LineError, in line order, lazily.

    Ids are claimed in line order for every line, also for those skipped because a previous run already
    answered them, so a resumed job makes the same duplicate-id decisions as an uninterrupted one. The set
    of claimed ids is the only state that grows with the input (about 100 bytes per line).

    This is the per-line boundary of a job: nothing a line holds raises out of it. A problem nanoinfer
    knows gets its own code; anything else becomes `internal_error`, logged with its traceback at debug.
    """

    def __init__(self, stream: Iterable[bytes], defaults: dict, done_lines: set[int] = frozenset(),
                 max_line_bytes: int = MAX_LINE_BYTES, first_line: int = 1, parse: Callable | None = None):
        self.stream = stream
        self.defaults = defaults
        # (line number, object, kind, defaults) -> request, raising BadLine: generate's parse_request by default
        self.parse = parse or parse_request
        self.done_lines = done_lines
        self.max_line_bytes = max_line_bytes
        self.first_line = first_line  # the number of the stream's first line (Ray Data numbers rows across batches)
        self.num_skipped = 0
        self._ids: set[str] = set()
        self._last_kind = NATIVE  # an unreadable line is answered in the format of the lines before it

    def __iter__(self) -> Iterator[BatchRequest | LineError]:
        for number, raw in iter_lines(self.stream, self.max_line_bytes, self.first_line):
            item = self._parse(number, raw)
            if number in self.done_lines:
                self.num_skipped += 1
                continue
            yield item

    def _parse(self, number: int, raw: bytes | LineTooLong) -> BatchRequest | LineError:
        requested_id, kind = None, self._last_kind
        try:
            if isinstance(raw, LineTooLong):
                raise BadLine(
                    "line_too_long",
                    f"is {raw.num_bytes:,} bytes long, over the limit of {self.max_line_bytes:,}; it was "
                    "skipped unread. Shorten it, or raise --max-line-bytes.",
                )
            obj = decode_line(raw)
            kind = self._last_kind = CHAT if is_openai_line(obj) else NATIVE  # refined below
            requested_id = request_id_of(obj, kind)
            if _SURROGATE_ESCAPE.search(raw):  # only an escape makes a lone surrogate: strict UTF-8 refuses them
                check_unicode(obj)
            kind = self._last_kind = line_kind(obj)
            request = self.parse(number, obj, kind, self.defaults)
        except BadLine as e:
            return self._error(number, requested_id, kind, e.code, e.message)
        except Exception as e:  # the per-line boundary: a bug here must not end the job
            logger.debug("line %d: unexpected error while parsing", number, exc_info=True)
            return self._error(number, requested_id, kind, "internal_error", internal_error_message(e))
        if request.id in self._ids:
            what = "custom_id" if request.is_openai else "id"
            return LineError(
                number,
                None,
                kind,
                "duplicate_id",
                f"line {number}: {what} {request.id!r} was already used by an earlier line; "
                "ids join output records to input lines, so each must be unique.",
            )
        self._ids.add(request.id)
        return request

    def _error(self, number: int, requested_id: str | None, kind: str, code: str, message: str) -> LineError:
        return LineError(number, self._claim_or_none(number, requested_id, kind), kind, code,
                         f"line {number}: {message}")

    def _claim_or_none(self, number: int, requested_id: str | None, kind: str) -> str | None:
        # The error record carries the line's id when it is readable and still free; an OpenAI line without
        # a custom_id has none, a native one gets the id derived from its line number.
        candidate = (
            requested_id if requested_id is not None else (None if kind != NATIVE else f"line-{number}")
        )
        if candidate is None or candidate in self._ids:
            return None
        self._ids.add(candidate)
        return candidate


def parse_request(number: int, obj: dict, kind: str, defaults: dict) -> BatchRequest:
    if kind == EMBEDDINGS:
        raise BadLine("unsupported_url", "url /v1/embeddings asks for embeddings, which `nanoinfer embed` makes; "
                      "`nanoinfer generate` answers /v1/chat/completions and /v1/completions.")
    if kind == NATIVE:
        return _parse_native(number, obj, defaults)
    return _parse_openai(number, obj, kind, defaults)


def scan_input(path: Path) -> tuple[str, int]:
    """(sha256 of the file, number of non-blank lines), reading it once in fixed-size chunks (a line of any
    length costs no more memory than a chunk)."""
    digest = hashlib.sha256()
    num_lines, open_line_has_text, first = 0, False, True
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            digest.update(chunk)
            text = chunk[3:] if first and chunk.startswith(b"\xef\xbb\xbf") else chunk  # as iter_lines
            first = False
            *whole, rest = text.split(b"\n")
            for part in whole:
                num_lines += open_line_has_text or bool(part.strip())
                open_line_has_text = False
            open_line_has_text = open_line_has_text or bool(rest.strip())
    return digest.hexdigest(), num_lines + open_line_has_text
