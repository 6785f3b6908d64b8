"""The durable, append-only store of ``ledger.jsonl``.

The event schema lives in ``events.py`` and the fold in ``state.py``; this module only
writes. Each event gets the next ``seq`` and a time stamp, and is written with one
``write(2)`` on an O_APPEND descriptor and made durable before ``append`` returns, so
the runtime never acts on an event that a crash could lose; concurrent appenders share
one sync (group commit). Appends use ``fdatasync``: it flushes the data and the file
size, all a reader needs, and skips the timestamps (4x cheaper than ``fsync`` here).
A torn last line, as a crash leaves it, is cut when the ledger is next opened.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from runtime.errors import FatalRunError
from runtime.run.events import Event, _read, parse_events


class Ledger:
    """Appends events durably. Thread-safe; one instance per run directory."""

    def __init__(self, path: Path, *, after_append: Callable[[Event], None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = path
        raw = _read(path) if path.exists() else b""
        if raw and not raw.endswith(b"\n"):
            # A crash mid-write left an unterminated last line: it was never durable,
            # and appending after it would corrupt the next line, so it is cut first.
            raw = raw[: raw.rfind(b"\n") + 1]
            os.truncate(path, len(raw))
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.fsync(self._fd)  # the cut, or the new file, is durable before any append
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self._written = 0
        self._synced = 0
        self.events: list[Event] = parse_events(raw, path)
        self._next_seq = (self.events[-1].seq if self.events else 0) + 1
        self._after_append = after_append
        self._clock = clock

    def append(self, event: Event, *, sync: bool = True) -> Event:
        """Assign ``seq``, write the line, fsync it; return the event as written.

        ``sync=False`` leaves the fsync to the next synced append or ``sync``: the caller
        must not act on the event (start an agent, start a dependent) before then. If a
        crash loses an unsynced ``attempt.finished``, the attempt folds as ``lost``.
        """
        with self._lock:
            stamped = event.model_copy(update={"seq": self._next_seq, "ts": self._clock()})
            self._write_line(stamped.model_dump_json().encode() + b"\n")
            self._next_seq += 1
            self.events.append(stamped)
            self._written += 1
            mine = self._written
        if sync:
            self._sync(mine)
        return self._notify(stamped)

    def sync(self) -> None:
        """Make every append so far durable, with one ``fdatasync`` for all of them.

        A caller that appends several events before acting on any (the scheduler records a
        round of attempt.started and node.succeeded events, then starts agents) appends them
        with ``sync=False`` and calls this once before it acts.
        """
        with self._lock:
            mine = self._written
        self._sync(mine)

    def _sync(self, mine: int) -> None:
        """Sync unless another appender's sync already covered append number ``mine``."""
        with self._sync_lock:
            if self._synced < mine:
                target = self._written
                try:
                    os.fdatasync(self._fd)
                except OSError as exc:
                    raise FatalRunError(self.path, f"cannot make the ledger durable: "
                                        f"{exc.strerror or exc}") from None
                self._synced = target

    def _write_line(self, line: bytes) -> None:
        """Write one whole line or nothing.

        A short write (disk full mid-line) is completed or cut back, so the next append
        never lands after half a line.
        """
        start = os.lseek(self._fd, 0, os.SEEK_END)
        done = 0
        try:
            while done < len(line):
                done += os.write(self._fd, line[done:])
        except OSError as exc:
            with contextlib.suppress(OSError):  # else cut when the ledger is next opened
                os.truncate(self.path, start)
            raise FatalRunError(self.path, f"cannot append to the ledger: "
                                f"{exc.strerror or exc}") from None

    def _notify(self, stamped: Event) -> Event:
        if self._after_append is not None:
            self._after_append(stamped)
        return stamped

    def close(self) -> None:
        """Sync and close the ledger, so that every append is on disk before the run reports."""
        os.fsync(self._fd)  # whatever an unsynced append left, before the run reports
        os.close(self._fd)
