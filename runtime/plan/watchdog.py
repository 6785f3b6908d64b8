"""A watchdog that interrupts a thread's work past a deadline or a memory bound.

Planning renders untrusted templates in-process (a process per render would cost more
than the render on 100k-node plans), so a template loop that neither prints nor builds
anything large can only be stopped from outside: this thread raises an exception in the
rendering thread (CPython's ``PyThreadState_SetAsyncExc``).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
import time
from typing import Any


class Overtime(BaseException):
    """Raised in a watched thread past its deadline.

    A BaseException, so that no ``except Exception`` in jinja2 or a template's callee
    swallows it.
    """


class Overgrown(BaseException):
    """Raised in a watched thread while the process grew past the armed bound."""


class Watchdog:
    """One daemon thread that interrupts work past its time or memory bound.

    A render arms a token (its thread and deadline) and disarms it when done. Past the
    deadline the watchdog raises ``Overtime`` in that thread with
    ``PyThreadState_SetAsyncExc`` (CPython): it lands at the next bytecode, however
    the template loops, with no thread or process per render (100k-node plans arm
    100k times). Firing and disarming share one lock, and disarming clears an
    exception that fired but has not been raised yet, so none can land after the
    render is over. The thread polls every 50 ms while renders are armed and exits
    after two idle seconds.
    """

    POLL_S = 0.05

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: dict[int, list[Any]] = {}  # token -> [deadline, tid, rss0, growth]
        self._fired: set[int] = set()
        self._tokens = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float, max_growth: int) -> int:
        """Watch the calling thread for overtime and memory growth; return a token for ``disarm``.

        ``Overtime`` after ``seconds``, ``Overgrown`` once the process's resident memory
        grows by ``max_growth`` bytes. Returns a token for ``disarm``.
        """
        with self._lock:
            token = next(self._tokens)
            self._armed[token] = [time.monotonic() + seconds, threading.get_ident(), None,
                                  max_growth]
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="render-watchdog",
                                                daemon=True)
                self._thread.start()
            return token

    def disarm(self, token: int) -> None:
        """Stop watching for ``token``, withdrawing an exception that fired but has not landed."""
        with self._lock:
            entry = self._armed.pop(token, None)
            if token in self._fired:
                self._fired.discard(token)
                if entry is not None:
                    _async_raise(entry[1], None)

    def disarm_safely(self, token: int) -> None:
        """Disarm even if the exception fired for this token lands during the call."""
        while True:
            try:
                self.disarm(token)
                return
            except (Overtime, Overgrown):
                continue

    def _loop(self) -> None:
        idle_since = time.monotonic()
        while True:
            time.sleep(self.POLL_S)
            now = time.monotonic()
            rss = _rss_bytes()
            with self._lock:
                if not self._armed:
                    if now - idle_since > 2.0:
                        self._thread = None
                        return
                    continue
                idle_since = now
                for token, entry in self._armed.items():
                    if token in self._fired:
                        continue
                    if entry[2] is None:
                        entry[2] = rss
                    if now >= entry[0]:
                        exc: type[BaseException] | None = Overtime
                    elif rss is not None and rss - entry[2] > entry[3]:
                        exc = Overgrown
                    else:
                        continue
                    self._fired.add(token)
                    _async_raise(entry[1], exc)


def _async_raise(thread_id: int, exc: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None)


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None




WATCHDOG = Watchdog()
