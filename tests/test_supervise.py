"""One selector loop supervising several agent processes at once (issue 12, item 3)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from runtime.agents import supervise
from runtime.agents.capture import BoundedCapture
from runtime.agents.supervise import Running, Supervisor


class _Proc:
    """A process started the way the command agent starts one, with its captures."""

    def __init__(self, tmp: Path, name: str, script: str, *, stdin: bytes | None = None,
                 timeout_s: float = 60.0, cancel: threading.Event | None = None) -> None:
        self.out = BoundedCapture(tmp / f"{name}.out")
        self.err = BoundedCapture(tmp / f"{name}.err")
        self.exits = 0
        proc = subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True,
                                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL)
        self.running = Running(proc, timeout_s=timeout_s, cancel=cancel or threading.Event(),
                               stdout=self.out, stderr=self.err, stdin_data=stdin,
                               on_exit=self._on_exit)

    def _on_exit(self) -> None:
        self.exits += 1


def _supervise_all(procs: list[_Proc]) -> None:
    hang_guard = time.monotonic() + 60  # a broken loop fails the test instead of hanging it
    with Supervisor() as sup:
        for p in procs:
            sup.add(p.running)
        done: list[Running] = []
        while len(done) < len(procs):
            assert time.monotonic() < hang_guard, "the loop never ended every agent"
            done += sup.poll(0.5)
    for p in procs:
        p.out.close()
        p.err.close()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_one_loop_takes_several_agents_to_their_own_ends(tmp_path: Path) -> None:
    failing = _Proc(tmp_path, "failing", "echo out; echo err >&2; exit 3")
    echoing = _Proc(tmp_path, "echoing", "cat", stdin=b"the prompt\n" * 20000)
    hanging = _Proc(tmp_path, "hanging", "sleep 30", timeout_s=0.3)
    _supervise_all([failing, echoing, hanging])

    assert (failing.running.code, failing.out.head, failing.err.head) == (3, b"out\n", b"err\n")
    assert echoing.running.code == 0
    assert echoing.out.total == len(b"the prompt\n") * 20000  # all of stdin, fed unblocked
    assert hanging.running.timed_out
    assert hanging.running.code == -signal.SIGTERM
    assert not failing.running.timed_out
    assert [p.exits for p in (failing, echoing, hanging)] == [1, 1, 1]
    assert _gone(hanging.running.proc.pid)


def test_an_agent_ignoring_sigterm_is_killed_after_the_grace(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervise, "KILL_GRACE_S", 0.2)
    stubborn = _Proc(tmp_path, "stubborn", "trap '' TERM; sleep 30 & wait", timeout_s=0.1)
    _supervise_all([stubborn])
    assert stubborn.running.timed_out
    assert stubborn.running.code == -signal.SIGKILL


def test_a_cancel_from_another_thread_ends_every_agent(tmp_path: Path) -> None:
    cancel = threading.Event()
    procs = [_Proc(tmp_path, f"p{i}", "sleep 30", cancel=cancel) for i in range(3)]
    threading.Timer(0.2, cancel.set).start()
    _supervise_all(procs)
    assert all(p.running.cancelled for p in procs)
    assert all(_gone(p.running.proc.pid) for p in procs)


def test_an_orphan_holding_the_pipes_does_not_hold_the_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The leader exits; a process in another session keeps stdout open: drained, then let go."""
    monkeypatch.setattr(supervise, "KILL_GRACE_S", 0.3)
    leaving = _Proc(tmp_path, "leaving", "setsid sleep 30 & echo $!; exit 0")
    quick = _Proc(tmp_path, "quick", "exit 0")
    try:
        _supervise_all([leaving, quick])
        assert (leaving.running.code, leaving.exits, quick.running.code) == (0, 1, 0)
    finally:
        orphan = int(leaving.out.head.split()[0])
        os.kill(orphan, signal.SIGKILL)


def test_closing_the_supervisor_kills_what_still_runs(tmp_path: Path) -> None:
    """A loop that leaves early (an exception) leaves no agent behind."""
    procs = [_Proc(tmp_path, f"p{i}", "sleep 30") for i in range(2)]
    with Supervisor() as sup:
        for p in procs:
            sup.add(p.running)
        sup.poll(0.05)
    assert all(_gone(p.running.proc.pid) for p in procs)
    assert [p.exits for p in procs] == [1, 1]
