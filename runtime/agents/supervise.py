"""One selector loop supervises every running agent process: pidfds and pipes, no thread each.

A ``Running`` is one launched process seen as a small state machine: its output pipes are
read into bounded captures, its prompt is fed to stdin, its exit is seen through a pidfd
the moment it happens, and a timeout or a cancellation terminates its process group
(SIGTERM, then SIGKILL after a grace period) without blocking. A ``Supervisor`` holds any
number of them in one ``selectors`` loop, so a run's scheduler waits on all its agents at
once instead of parking a thread in each (thread hand-offs and GIL contention were most of
the per-attempt cost of a short agent). ``supervise`` runs one to completion, for callers
that want a blocking agent.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)

KILL_GRACE_S = 2.0
POLL_S = 0.2  # how soon a cancellation set from another thread or a signal is noticed
NO_PIDFD_POLL_S = 0.005  # without pidfd_open (old kernels) the exit is polled
WAKE = "wake"


class Sink(Protocol):
    """Where a pipe's bytes go (a ``BoundedCapture``)."""

    def write(self, data: bytes) -> None:
        """Take the next bytes read from the pipe."""


class Running:
    """One launched agent process, from its start until it is reaped and its pipes drained.

    Args:
        proc: the process, started in its own session with piped stdout and stderr.
        timeout_s: the attempt's timeout, counted from now.
        cancel: set by the operator (Ctrl-C, SIGTERM): the process is terminated.
        stdout: sink of its standard output.
        stderr: sink of its standard error.
        stdin_data: fed to its stdin when ``proc`` has a stdin pipe.
        on_exit: called once, as soon as the leader is reaped (or given up on), before its
            pipes are drained: an orphan holding a pipe open must not hold up the cleanup.
    """

    # PLR0913: The process and the five things its supervision needs; keyword-only.
    def __init__(self, proc: subprocess.Popen[bytes], *, timeout_s: float,  # noqa: PLR0913
                 cancel: threading.Event, stdout: Sink, stderr: Sink,
                 stdin_data: bytes | None, on_exit: Callable[[], None]) -> None:
        self.proc, self.cancel, self._on_exit = proc, cancel, on_exit
        self.deadline = time.monotonic() + timeout_s
        self.code: int | None = None
        self.timed_out = self.cancelled = False
        self._exited = False  # the leader is reaped, or given up on
        self._kill_at: float | None = None  # SIGTERM sent: SIGKILL at this time
        self._give_up_at: float | None = None  # SIGKILL sent: stop waiting at this time
        self._drain_until: float | None = None
        self._streams: list[tuple[object, int, object]] = []
        for stream, sink in ((proc.stdout, stdout), (proc.stderr, stderr)):
            if stream is not None:
                os.set_blocking(stream.fileno(), False)
                self._streams.append((stream, selectors.EVENT_READ, sink))
        self.reading = len(self._streams)
        self._pending = memoryview(stdin_data or b"")
        if proc.stdin is not None:
            os.set_blocking(proc.stdin.fileno(), False)
            self._streams.append((proc.stdin, selectors.EVENT_WRITE, "stdin"))
        try:
            self.pidfd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            self.pidfd = -1

    @property
    def done(self) -> bool:
        """The leader is reaped (or given up on), its output read to the end (or abandoned)."""
        return self._exited and (self.reading == 0 or (self._drain_until is not None
                                 and time.monotonic() >= self._drain_until))

    def register(self, sel: selectors.BaseSelector) -> None:
        """Put this process's pipes and pidfd in ``sel``."""
        for stream, events, data in self._streams:
            sel.register(stream, events, (self, data))  # type: ignore[arg-type]
        if self.pidfd >= 0:
            sel.register(self.pidfd, selectors.EVENT_READ, (self, "exit"))

    def handle(self, sel: selectors.BaseSelector, key: selectors.SelectorKey) -> None:
        """React to one ready descriptor of this process."""
        what = key.data[1]
        if what == "exit":
            sel.unregister(key.fileobj)
            self._reap()
        elif what == "stdin":
            self._feed(sel, key)
        else:
            try:
                data = os.read(key.fd, 65536)
            except BlockingIOError:
                return
            if data:
                what.write(data)
            else:
                sel.unregister(key.fileobj)
                self.reading -= 1

    def _feed(self, sel: selectors.BaseSelector, key: selectors.SelectorKey) -> None:
        try:
            sent = os.write(key.fd, self._pending[:65536])
            self._pending = self._pending[sent:]
        except BlockingIOError:
            return
        except OSError:
            self._pending = memoryview(b"")  # the agent does not read stdin: its choice
        if not self._pending:
            sel.unregister(key.fileobj)
            with contextlib.suppress(OSError):
                key.fileobj.close()  # type: ignore[union-attr]

    def tick(self, now: float) -> float:
        """Act on the clock (timeout, cancellation, kill escalation); give the next time to act."""
        if not self._exited:
            if self.pidfd < 0 and _exited(self.proc.pid):
                self._reap()
                return now
            if self._kill_at is None and now >= self.deadline:
                self.timed_out = True
                self._terminate(now)
            elif self._kill_at is None and self.cancel.is_set():
                self.cancelled = True
                self._terminate(now)
            elif self._give_up_at is not None and now >= self._give_up_at:
                self._exited = True  # unkillable (a process in D state): stop waiting
                self._on_exit()
            elif self._kill_at is not None and self._give_up_at is None and now >= self._kill_at:
                _killpg(self.proc.pid, signal.SIGKILL)
                self._give_up_at = now + KILL_GRACE_S
        if self._exited:
            if self._drain_until is None:
                self._drain_until = now + KILL_GRACE_S
            return self._drain_until
        nxt = min(self.deadline, self._give_up_at or self._kill_at or self.deadline)
        return min(nxt, now + (POLL_S if self.pidfd >= 0 else NO_PIDFD_POLL_S))

    def _terminate(self, now: float) -> None:
        _killpg(self.proc.pid, signal.SIGTERM)
        self._kill_at = now + KILL_GRACE_S

    def _reap(self) -> None:
        """Kill what the exited leader left in its process group, then reap the leader.

        The leader has exited but is not reaped yet, so its PID (the group id) cannot have
        been reused: kill whatever it left in its group, then reap it.
        """
        _killpg(self.proc.pid, signal.SIGKILL)
        self.code = self.proc.wait()
        self._exited = True
        self._on_exit()

    def kill(self) -> None:
        """End the process now (its supervisor is going away): SIGKILL its group, reap it."""
        if self._exited:
            return
        _killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.code = self.proc.wait(timeout=KILL_GRACE_S)
        self._exited = True
        self._on_exit()

    def close(self, sel: selectors.BaseSelector | None = None) -> None:
        """Forget this process in ``sel`` and close its descriptors."""
        for fileobj in [s for s, _, _ in self._streams] + ([self.pidfd] if self.pidfd >= 0
                                                          else []):
            if sel is not None:
                with contextlib.suppress(KeyError, ValueError):
                    sel.unregister(fileobj)  # type: ignore[arg-type]
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


class Supervisor:
    """Every running agent process of one caller, in one selector loop.

    ``poll`` waits until something happens (an exit, output, a clock event, a ``wake``)
    and returns the processes that are done; the caller may ``add`` more at any time
    between polls. ``wake`` may be called from any thread.
    """

    def __init__(self) -> None:
        self._sel = selectors.DefaultSelector()
        self._running: list[Running] = []
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._sel.register(self._wake_r, selectors.EVENT_READ, (None, WAKE))

    def __enter__(self) -> Supervisor:
        """Use as a context manager: ``close`` on exit."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close every descriptor."""
        self.close()

    def __len__(self) -> int:
        """How many processes are supervised."""
        return len(self._running)

    def add(self, running: Running) -> None:
        """Supervise ``running`` from the next ``poll`` on."""
        running.register(self._sel)
        self._running.append(running)

    def wake(self) -> None:
        """End the current (or next) ``poll`` early; safe from any thread."""
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    def poll(self, timeout: float) -> list[Running]:
        """Wait at most ``timeout`` seconds for events; return the processes now done."""
        now = time.monotonic()
        until = now + timeout
        for r in self._running:
            until = min(until, r.tick(now))
        if not self._done():
            for key, _ in self._sel.select(max(0.0, until - time.monotonic())):
                running, what = key.data
                if what == WAKE:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self._wake_r, 4096):
                            pass
                else:
                    running.handle(self._sel, key)
            now = time.monotonic()
            for r in self._running:
                r.tick(now)
        finished = self._done()
        for r in finished:
            r.close(self._sel)
            self._running.remove(r)
        return finished

    def _done(self) -> list[Running]:
        return [r for r in self._running if r.done]

    def close(self) -> None:
        """Kill what is still running and close every descriptor.

        A caller leaves with processes running only when something went wrong (an
        exception out of its loop): no agent outlives its supervisor.
        """
        for r in self._running:
            try:
                r.kill()
            except OSError as exc:  # (out of descriptors): its group has had SIGKILL
                log.warning("cleaning up agent %d: %s", r.proc.pid, exc)
            r.close(self._sel)
        self._running.clear()
        self._sel.close()
        os.close(self._wake_r)
        os.close(self._wake_w)


def supervise(running: Running) -> None:
    """Supervise one process until it is done (the blocking form of ``Supervisor``)."""
    with Supervisor() as sup:
        sup.add(running)
        while not sup.poll(POLL_S):
            pass


def _killpg(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _exited(pid: int) -> bool:
    """Has ``pid`` exited? Checked without reaping it (WNOWAIT)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True
