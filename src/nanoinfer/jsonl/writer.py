"""The crash-safe writer: each record one ASCII line, appended whole, fsynced on a timer, and the output cut back
to its last whole record when a write fails. What a record holds is records.py's; resume is manifest.py's.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
from pathlib import Path
from typing import BinaryIO

from nanoinfer.errors import OutputWriteError


def encode_record(record: dict) -> bytes:
    # ensure_ascii keeps every record one physical line whatever the text holds (U+2028 included).
    return (json.dumps(record, ensure_ascii=True, separators=(",", ":")) + "\n").encode("ascii")


class RecordWriter:
    """Appends records, each as one write() of a whole line, and fsyncs at least every `sync_seconds`.

    A record is in the kernel as soon as write() returns (no user-space buffer), so kill -9 loses nothing
    written; fsync covers power loss. On stdout there is nothing to fsync: each record is flushed.

    A failed write or fsync (disk full, I/O error, closed stdout) raises OutputWriteError once the file is
    cut back to its last whole record, so the output holds nothing torn; every later call is refused.
    """

    def __init__(self, path: Path | None, sync_seconds: float = 1.0, stdout: BinaryIO | None = None):
        self.path = path
        self.stdout = stdout
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path is not None else None
        self.sync_seconds = sync_seconds
        self.num_written = 0
        self.failure: OutputWriteError | None = None
        self._size = os.fstat(self.fd).st_size if self.fd is not None else 0  # bytes of whole records
        self._dirty = False
        self._last_sync = time.monotonic()

    def write(self, record: dict) -> None:
        if self.failure is not None:
            raise self.failure
        data = encode_record(record)
        try:
            if self.fd is None:
                self.stdout.write(data)
                self.stdout.flush()
            else:
                view = memoryview(data)
                while view:  # a regular file takes it in one go; loop only if the disk is short of space
                    view = view[os.write(self.fd, view) :]
                self._size += len(data)
                self._dirty = True
        except OSError as e:
            raise self._fail(e, "writing a record to") from None
        self.num_written += 1
        self.sync_if_due()

    def sync_if_due(self) -> None:
        if self._dirty and time.monotonic() - self._last_sync >= self.sync_seconds:
            self.sync()

    def sync(self) -> None:
        if self.failure is not None:
            raise self.failure
        if self.fd is not None and self._dirty:
            try:
                os.fsync(self.fd)
            except OSError as e:
                raise self._fail(e, "flushing records to") from None
        self._dirty = False
        self._last_sync = time.monotonic()

    def close(self) -> None:
        try:
            if self.failure is None:
                self.sync()
        finally:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None

    def _fail(self, e: OSError, doing: str) -> OutputWriteError:
        where = "stdout" if self.path is None else str(self.path)
        if self.fd is not None:
            with contextlib.suppress(OSError):  # cutting a file needs no free space
                os.ftruncate(self.fd, self._size)
                os.fsync(self.fd)
        closed = isinstance(e, BrokenPipeError) or e.errno == errno.EPIPE
        self.failure = OutputWriteError(
            f"{doing} {where} failed: {e.strerror or e} (errno {e.errno}).",
            errno=e.errno,
            closed_pipe=closed and self.path is None,
        )
        return self.failure
