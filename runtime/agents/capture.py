"""Bounded capture of an agent's output: head and tail kept, everything else counted.

An agent that writes 1 GB must not grow the runtime's memory or the log file beyond
``head + tail`` bytes. The head goes to the file as it arrives; the tail is a bounded
buffer written at close, after a marker that says how many bytes were dropped. The file
is created at the first byte: an agent that prints nothing leaves no log (creating files
is a large share of a short attempt's cost).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)

DEFAULT_HEAD = 64 * 1024
DEFAULT_TAIL = 64 * 1024


class BoundedCapture:
    """A write-only sink keeping the first ``head`` and last ``tail`` bytes."""

    def __init__(self, path: Path, head: int = DEFAULT_HEAD, tail: int = DEFAULT_TAIL) -> None:
        self.path = path
        self._head_max, self._tail_max = head, tail
        self._file: IO[bytes] | None = None
        self._head = bytearray()
        self._tail = bytearray()
        self.total = 0
        self.dropped = 0
        self._lock = threading.Lock()
        self._closed = False
        self._failed = False

    def _open(self) -> IO[bytes] | None:
        """Create the log, never through a link; None if it cannot be (the capture goes on).

        An unsandboxed agent can plant a link, a directory or a FIFO at the log's path, and
        the runtime can run out of descriptors: neither may stop the agent's supervision.
        """
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                         | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            self._failed = True
            log.warning("%s: cannot be written (%s); the output is kept in memory only",
                        self.path, exc.strerror or exc)
            return None
        return os.fdopen(fd, "wb")

    def write(self, data: bytes | str) -> None:
        """Record ``data``: the head goes to the file at once, the rest to a rolling tail."""
        if isinstance(data, str):
            data = data.encode("utf-8", "replace")
        with self._lock:
            self.total += len(data)
            room = self._head_max - len(self._head)
            if room > 0 and data:
                part = data[:room]
                self._head += part
                if self._file is None and not self._failed:
                    self._file = self._open()
                if self._file is not None:
                    self._file.write(part)
                data = data[room:]
            if data:
                self._tail += data
                excess = len(self._tail) - self._tail_max
                if excess > 0:
                    del self._tail[:excess]
                    self.dropped += excess

    def close(self) -> None:
        """Write the kept tail (with a count of dropped bytes) after the head and close the file.

        No file is created when nothing was written.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._file is None and not self._tail:
                return  # nothing was written: no file
            if self._file is None and not self._failed:  # head 0: only a tail
                self._file = self._open()
            if self._file is None:
                return  # the log could not be opened: the captured bytes stay in memory
            if self.dropped:
                self._file.write(f"\n[... {self.dropped} bytes dropped ...]\n".encode())
            self._file.write(self._tail)
            self._file.close()

    def contents(self) -> bytes:
        """What the log file holds (after ``close``): empty when nothing was written."""
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            return b""

    @property
    def head(self) -> bytes:
        """The first bytes of output (claude's result JSON is read from here)."""
        return bytes(self._head)

    def tail_text(self, limit: int) -> str:
        """Give the last ``limit`` bytes of output as text, never starting inside a line.

        When the capture or this cut split a line, the text starts at the next line boundary:
        a secret straddling a cut is never shown in part (DESIGN section 6).
        """
        with self._lock:
            data = bytes(self._head) + bytes(self._tail) if not self.dropped else bytes(
                self._tail)
            cut = self.dropped > 0 or len(data) > limit
            data = data[-limit:]
        if cut:
            newline = data.find(b"\n")
            data = data[newline + 1:] if newline >= 0 else b""
        return data.decode("utf-8", "replace")
