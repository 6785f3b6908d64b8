"""No agent process outlives its attempt (issue 8, item 2).

The runtime process becomes a child subreaper (``PR_SET_CHILD_SUBREAPER``): whatever an
agent detaches (a double fork, ``setsid``, a daemon) is re-parented to the runtime
instead of init, so it stays findable. When an attempt's leader has exited,
``kill_descendants`` kills everything the runtime adopted from it, whatever its
session or process group, and reaps it.

Which adopted processes belong to which attempt: every agent starts in a new session,
and no process can join a session other than the one it was born in or a new one, so
nothing an agent starts is ever in the runtime's own session; the runtime's other
children (if any) are. An adopted process in the session of another live attempt's
leader belongs to that attempt. One that left every session (``setsid``) cannot be
attributed: it is killed when any attempt that started before it ends. With the
sandbox, the agent's PID namespace holds all of that, and its death kills them.

After a crash (``kill -9`` of the runtime) the run's ``leaders.jsonl`` (one line per
started agent, appended to one file rather than a file per attempt, since creating files
is most of a short attempt's cost; outside every workspace, so a sandboxed agent cannot
see it) names each leader's pid, start time and the boot it ran in; ``kill_leftovers``
kills those leaders, everything in their sessions, and every process still carrying the
run's key (``RUNTIME_RUN_KEY``) in its environment, before ``resume`` starts anything.
(Runs from before kept one ``agent.json`` per attempt, in the same one-line format;
resume reads those too.)
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PR_SET_CHILD_SUBREAPER = 36
SMALL_RANGE = 32  # up to this many pids since the leader: probe each, no /proc listing
AGENT_RECORD = "agent.json"  # one per attempt, written by runtimes before leaders.jsonl
_lock = threading.Lock()
# Held while launching an agent until its leader is registered, and while a cleanup
# scans and kills: a leader forked but not yet registered would look like an orphan.
launch_lock = threading.RLock()
_subreaper = False
_leaders: set[int] = set()  # live agent leaders launched by this process


@dataclass(frozen=True)
class Proc:
    """One line of ``/proc/<pid>/stat``: enough to tell a process, its parent and its session.

    ``start`` (the start time in clock ticks) tells a process from a later one that reused
    its pid.
    """
    pid: int
    ppid: int
    sid: int
    start: int  # clock ticks since boot: with the pid, identifies the process
    state: str
    pgid: int = 0  # its process group (0: unknown)


def become_subreaper() -> bool:
    """Make this process adopt orphaned descendants (once; idempotent)."""
    global _subreaper
    with _lock:
        if not _subreaper:
            libc = ctypes.CDLL(None, use_errno=True)
            _subreaper = libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
            if not _subreaper:
                log.warning("prctl(PR_SET_CHILD_SUBREAPER) failed: errno %d",
                            ctypes.get_errno())
        return _subreaper


def stat(pid: int) -> Proc | None:
    """Read ``/proc/<pid>/stat``; None when the process is gone or the line cannot be parsed."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: fields start after the last ')'.
    fields = raw[raw.rfind(b")") + 2:].split()
    try:
        return Proc(pid=pid, state=fields[0].decode(), ppid=int(fields[1]),
                    pgid=int(fields[2]), sid=int(fields[3]), start=int(fields[19]))
    except (IndexError, ValueError):
        return None


def table(after: int | None = None) -> list[Proc]:
    """Every process, or (``after`` given) only those whose pid was allocated after ``after``.

    Reading /proc/<pid>/stat costs ~50 us a process here, so a cleanup after each attempt
    reads only the processes started since its leader. Pids are handed out in increasing
    order, wrapping at pid_max; that holds unless the counter went all the way round, which
    is why long attempts scan everything.
    """
    last = _last_pid() if after is not None else None
    if after is not None and last is not None and 0 <= last - after <= SMALL_RANGE:
        pids: Iterable[int] = range(after + 1, last + 1)  # probing beats listing /proc
    else:
        pids = [int(n) for n in os.listdir("/proc") if n.isdigit()]
        if after is not None and last is not None:
            pids = [p for p in pids if (after < p <= last if last >= after
                                        else p > after or p <= last)]
    out = []
    for pid in pids:
        proc = stat(pid)
        if proc is not None:
            out.append(proc)
    return out


def _last_pid() -> int | None:
    try:
        with open("/proc/sys/kernel/ns_last_pid", "rb") as fh:
            return int(fh.read())
    except (OSError, ValueError):
        return None


def register(pid: int) -> None:
    """Mark ``pid`` as a live attempt leader: another attempt's cleanup must not kill its tree."""
    with _lock:
        _leaders.add(pid)


def unregister(pid: int) -> None:
    """Forget ``pid`` as a leader once its attempt has ended."""
    with _lock:
        _leaders.discard(pid)


KILL_ROUNDS_S = 1.0  # how long an attempt's cleanup keeps killing what keeps appearing


def kill_descendants(leader: int, leader_start: int, *, scan_all: bool = False) -> int:
    """Kill and reap what this process adopted from the attempt led by ``leader``.

    ``leader`` has exited and been reaped. ``scan_all``: read every process, not only those
    with pids allocated after the leader's (for long attempts, where the pid counter may
    have wrapped). Returns how many processes were killed.
    """
    me, my_sid, my_pgid = os.getpid(), os.getsid(0), os.getpgid(0)
    killed = 0
    give_up = time.monotonic() + KILL_ROUNDS_S
    while time.monotonic() < give_up:  # each round re-parents the killed ones' children
        if not _has_children():
            return killed  # nothing adopted (and no other agent running): no scan
        with launch_lock:
            with _lock:
                others = _leaders - {leader}
            children: dict[int, list[Proc]] = {}
            scanned = table(None if scan_all else leader)
            for p in scanned:
                children.setdefault(p.ppid, []).append(p)
            roots = [p for p in children.get(me, [])
                     if p.sid != my_sid and p.pid not in others and p.sid not in others
                     and p.start >= leader_start]
            if not roots:
                return killed
            doomed = _subtrees(roots, children)
            for p in doomed:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(p.pid, signal.SIGKILL)
            # A process that forks and exits in a loop keeps one step ahead of a scan;
            # its whole group dies at once (the kernel makes a fork either see the group's
            # kill or be killed with it).
            for pgid in _doomed_groups(doomed, {0, my_pgid, *others},
                                       scanned if scan_all else None):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, signal.SIGKILL)
        killed += sum(1 for p in doomed if p.state != "Z")
        for p in roots:
            _reap(p.pid)
    log.warning("descendants of agent %d kept appearing for %g s of killing (a process "
                "that leaves its session at every fork); the rest is left running",
                leader, KILL_ROUNDS_S)
    return killed


def _doomed_groups(doomed: list[Proc], spared: set[int],
                   everything: list[Proc] | None) -> list[int]:
    """The process groups of ``doomed`` that hold nothing but the attempt's leftovers.

    A member is a leftover when it is doomed, or its parent is (it was forked since the
    scan: a fork chain's newest link), or the runtime adopted it. A group may also hold a
    process that is someone else's child (another attempt's worker that called
    ``setsid``, whose orphaned grandchild this attempt adopted): such a group is left to
    the kills by pid. ``everything``: the whole process table when the caller has it;
    otherwise it is read here (only when there is a group to decide on, which takes an
    agent that detaches).
    """
    groups = {p.pgid for p in doomed} - spared
    if not groups:
        return []
    ours = {p.pid for p in doomed} | {os.getpid()}
    foreign = {p.pgid for p in (everything if everything is not None else table(None))
               if p.pgid in groups and p.state != "Z" and p.pid not in ours
               and p.ppid not in ours}
    return sorted(groups - foreign)


def _has_children() -> bool:
    """Tell whether this process has any child, live or zombie, without reaping one.

    ECHILD means none; WNOWAIT leaves every status for its own waiter.
    """
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def _subtrees(roots: list[Proc], children: dict[int, list[Proc]]) -> list[Proc]:
    out, stack = [], list(roots)
    while stack:
        p = stack.pop()
        out.append(p)
        stack.extend(children.get(p.pid, []))
    return out


def _reap(pid: int, timeout: float = 5.0) -> None:
    """Reap a child we killed, waiting at most ``timeout``.

    A process stuck in the kernel may take a while to die; it is not worth hanging the
    attempt for.
    """
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        fd = -1
    try:
        if fd >= 0 and timeout > 0:
            select.select([fd], [], [], timeout)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    finally:
        if fd >= 0:
            os.close(fd)


# --- after a crash -----------------------------------------------------------------


@functools.cache
def boot_id() -> str:
    """This boot's id, so that a leaders log from before a reboot names no live process.

    Read once: no process outlives a reboot, and every attempt's leader record needs it.
    """
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


# PLR0913: One leaders-log record's fields, passed as they are written; node and attempt by keyword.
def record_leader(log_path: Path, pid: int, start: int, sandboxed: bool, *,  # noqa: PLR0913
                  node: str = "", attempt: int = 0) -> None:
    """Append this leader to the run's leaders log.

    Enough for a later ``resume`` to find it. One ``write`` on an O_APPEND descriptor:
    concurrent attempts never interleave. An ``OSError`` (a full disk, a directory in its
    place) reaches the caller, which kills the agent rather than let it run unrecorded.
    """
    line = json.dumps({"schema_version": 1, "node": node, "attempt": attempt, "pid": pid,
                       "start": start, "boot_id": boot_id(), "sandboxed": sandboxed})
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def run_key(run_dir: Path) -> str:
    """What marks a run's agents in their environment (``RUNTIME_RUN_KEY``).

    Derived from the run directory's real path, so two runs with the same id under
    different artifact roots (two checkouts, two CI jobs on one host) never kill each
    other's agents on resume, while one run reached through a symlink or another working
    directory keeps its key.
    """
    return hashlib.blake2b(os.fsencode(os.path.realpath(run_dir)), digest_size=12).hexdigest()


def kill_leftovers(records: Iterable[Path], key: str) -> int:
    """Kill what a crashed runtime left running.

    Each leader named in ``records`` (files of one JSON object per line) still alive (same
    pid, start time and boot), its session, and any process whose environment carries
    ``RUNTIME_RUN_KEY=<key>``. Returns how many were killed.
    """
    boot = boot_id()
    sessions: dict[int, int] = {}  # leader pid -> its start time
    for path in records:
        try:
            lines = path.read_bytes().splitlines()
        except OSError:
            continue
        for raw in lines:
            try:
                rec = json.loads(raw)
                if rec.get("boot_id") == boot:
                    sessions[int(rec["pid"])] = int(rec["start"])
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
    marker = f"RUNTIME_RUN_KEY={key}".encode()
    me = os.getpid()
    doomed = leftovers(table(), sessions, me=me, my_sid=os.getsid(0),
                       carries=lambda pid: _carries(pid, marker))
    for p in doomed:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p.pid, signal.SIGKILL)
    for p in doomed:
        _wait_gone(p)
        if p.ppid == me:  # re-parented to us (we are a subreaper): reap it
            _reap(p.pid, timeout=0)
    return len(doomed)


def leftovers(procs: list[Proc], sessions: dict[int, int], *, me: int, my_sid: int,
              carries: Callable[[int], bool]) -> list[Proc]:
    """Decide which of ``procs`` a crashed run left behind, refusing anything untrustworthy.

    Pure, so it is tested on made-up process tables: a wrong answer here kills the host's
    processes.

    ``sessions`` maps recorded leader pids to their start times. The leaders log is
    agent-reachable when the agent runs unsandboxed, so a record is never trusted to
    name this process, its ancestors, its own session, pid 0 or 1, or session 0 (which
    is how /proc shows a session whose leader lives outside this PID namespace: every
    process of a container can carry it).
    """
    alive = {p.pid: p for p in procs}
    spared = {me}
    pid = alive[me].ppid if me in alive else 0
    while pid > 1 and pid not in spared:  # ancestors: the shell, CI, the terminal
        spared.add(pid)
        pid = alive[pid].ppid if pid in alive else 0
    # A pid is not handed out again while a process still has it as its session id:
    # so members of session L are the leader's, unless a process L now exists with
    # another start time (the whole session died and the number was reused).
    sessions = {pid: start for pid, start in sessions.items()
                if pid > 1 and pid != my_sid and pid not in spared
                and (pid not in alive or alive[pid].start == start)}
    return [p for p in procs if p.pid > 1 and p.pid not in spared and p.sid != my_sid and (
        (p.sid in sessions and p.start >= sessions[p.sid])
        or sessions.get(p.pid) == p.start or carries(p.pid))]


def _carries(pid: int, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return marker in fh.read().split(b"\0")
    except OSError:
        return False


def _wait_gone(p: Proc, timeout: float = 5.0) -> None:
    """Wait until ``p`` is gone (or a zombie): it is not our child, so poll /proc."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = stat(p.pid)
        if now is None or now.start != p.start or now.state in ("Z", "X"):
            return
        time.sleep(0.005)
