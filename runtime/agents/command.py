"""``command`` agent: a subprocess in its own process group, with an env allow-list.

argv placeholders: ``{prompt_file}``, ``{workspace}``, ``{node}``. The prompt goes on
stdin (``prompt_via: stdin``) or only as the file. The child gets PATH, HOME, LANG,
LC_*, TMPDIR, TERM, the names its profile lists under ``env:``, and RUNTIME_*; nothing
else. A timeout or cancellation terminates the whole process group (SIGTERM, then
SIGKILL after a grace period), so grandchildren cannot outlive the attempt.

Contradictory completion (exit 0 with a terminal error): with ``result_json: true``
stdout is parsed as a JSON result and ``is_error: true`` or an ``error`` field is a
reported error (the shape ``claude -p --output-format json`` prints); with
``error_file`` the file's presence in the workspace after exit 0 is one.

Whatever the exit status, the program's kind (claude, codex, other) reads what it left
(``recognise.py``): the class its own words name (``agent_auth`` for "Not logged in")
and a one-line summary, both carried on ``AgentExit``.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Mapping

from ..capture import DEFAULT_HEAD, DEFAULT_TAIL
from ..profiles import CommandProfile
from . import AgentExit, Invocation
from .recognise import kind_of, read_command

ENV_ALLOW = ("PATH", "HOME", "LANG", "TMPDIR", "TERM")
KILL_GRACE_S = 2.0
POLL_S = 0.2
READ_LIMIT = DEFAULT_HEAD + DEFAULT_TAIL  # all of stderr the capture kept


def agent_environment(profile_env: list[str], runtime_env: Mapping[str, str],
                      source: Mapping[str, str]) -> dict[str, str]:
    """The child's whole environment: allow-list, profile names, RUNTIME_*."""
    env = {k: v for k, v in source.items() if k in ENV_ALLOW or k.startswith("LC_")}
    env.update({k: source[k] for k in profile_env if k in source})
    env.update(runtime_env)
    return env


class CommandAgent:
    def __init__(self, profile: CommandProfile) -> None:
        self.profile = profile

    def argv(self, inv: Invocation) -> list[str]:
        subs = {"{prompt_file}": str(inv.prompt_file), "{workspace}": str(inv.workspace),
                "{node}": inv.node}
        out = []
        for arg in self.profile.argv:
            for key, value in subs.items():
                arg = arg.replace(key, value)
            out.append(arg)
        return out

    def run(self, inv: Invocation) -> AgentExit:
        env = agent_environment(self.profile.env, inv.env, os.environ)
        stdin = subprocess.PIPE if self.profile.prompt_via == "stdin" else subprocess.DEVNULL
        try:
            proc = subprocess.Popen(
                self.argv(inv), cwd=inv.workspace, env=env, stdin=stdin,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        except OSError as exc:
            return AgentExit(launch_error=f"{self.profile.argv[0]}: {exc.strerror or exc}")
        stdin_data = inv.prompt.encode() if proc.stdin is not None else None
        code, timed_out, cancelled = _Supervisor(proc, inv, stdin_data).run()
        return self._result(inv, code, timed_out, cancelled)

    def _result(self, inv: Invocation, code: int | None, timed_out: bool,
                cancelled: bool) -> AgentExit:
        """Evidence, plus the kind's reading of the agent's own reason: claude's result
        JSON whatever the exit code, codex's own error lines (recognise.py)."""
        if cancelled:
            return AgentExit(exit_code=code, cancelled=True)
        reading = read_command(kind_of(self.profile.argv[0]), None if timed_out else code,
                               inv.stdout.head, inv.stderr.tail_text(READ_LIMIT),
                               prompt=inv.prompt)
        if timed_out:  # agent_timeout whatever was read; the reading says why it hung
            return AgentExit(exit_code=code, timed_out=True, summary=reading.summary)
        return AgentExit(exit_code=code, reported_error=self._reported(inv) if code == 0
                         else None, failure=reading.failure, summary=reading.summary)

    def _reported(self, inv: Invocation) -> str | None:
        if self.profile.error_file:
            path = inv.workspace / self.profile.error_file
            if path.is_file():
                with path.open("rb") as fh:
                    text = fh.read(4096).decode("utf-8", "replace").strip()
                return f"{self.profile.error_file}: {text}" if text else \
                    f"{self.profile.error_file} present"
        if self.profile.result_json:
            return _json_result_error(inv.stdout.head)
        return None


def _json_result_error(stdout: bytes) -> str | None:
    try:
        result = json.loads(stdout)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None  # not a JSON result (or truncated): no claim either way
    if not isinstance(result, dict):
        return None
    if result.get("is_error") is True or str(result.get("subtype", "")).startswith("error"):
        detail = result.get("result") or result.get("subtype") or "is_error"
        return f"agent result reports an error: {str(detail)[:2000]}"
    if result.get("error"):
        return f"agent result reports an error: {str(result['error'])[:2000]}"
    return None


class _Supervisor:
    """One thread per attempt does all of the child's I/O: a selector over stdout,
    stderr, stdin and a pidfd. No pump threads, so no GIL hand-offs between them, and
    the exit is seen the moment it happens (``Popen.wait(timeout)`` polls with sleeps
    that grow to 50 ms, more than a short agent's whole run)."""

    def __init__(self, proc: subprocess.Popen[bytes], inv: Invocation,
                 stdin_data: bytes | None) -> None:
        self.proc, self.inv = proc, inv
        self.sel = selectors.DefaultSelector()
        self.reading = 0
        for stream, sink in ((proc.stdout, inv.stdout), (proc.stderr, inv.stderr)):
            if stream is not None:
                os.set_blocking(stream.fileno(), False)
                self.sel.register(stream, selectors.EVENT_READ, sink)
                self.reading += 1
        self.pending = memoryview(stdin_data or b"")
        if proc.stdin is not None:
            os.set_blocking(proc.stdin.fileno(), False)
            self.sel.register(proc.stdin, selectors.EVENT_WRITE, "stdin")
        try:
            self.pidfd = os.pidfd_open(proc.pid)
            self.sel.register(self.pidfd, selectors.EVENT_READ, "exit")
        except (AttributeError, OSError):
            self.pidfd = -1
        self.code: int | None = None

    def run(self) -> tuple[int | None, bool, bool]:
        deadline = time.monotonic() + self.inv.timeout_s
        timed_out = cancelled = False
        drain_until: float | None = None
        try:
            while self.reading or self.code is None:
                now = time.monotonic()
                if self.code is None and now >= deadline:
                    timed_out, self.code = True, _kill_group(self.proc)
                elif self.code is None and self.inv.cancel.is_set():
                    cancelled, self.code = True, _kill_group(self.proc)
                if self.code is not None:
                    drain_until = drain_until or now + KILL_GRACE_S
                    if now >= drain_until:
                        break  # something outside the group holds the pipes open
                wait = POLL_S if self.pidfd >= 0 or self.code is not None else 0.005
                for key, _ in self.sel.select(timeout=min(wait, max(deadline - now, 0.001))):
                    self._handle(key)
                if self.pidfd < 0 and self.code is None and _exited(self.proc.pid):
                    self._reap()
        finally:
            self._close()
        return self.code, timed_out, cancelled

    def _handle(self, key: selectors.SelectorKey) -> None:
        if key.data == "exit":
            self.sel.unregister(key.fileobj)
            self._reap()
        elif key.data == "stdin":
            try:
                sent = os.write(key.fd, self.pending[:65536])
                self.pending = self.pending[sent:]
            except BlockingIOError:
                return
            except OSError:
                self.pending = memoryview(b"")  # the agent does not read stdin: its choice
            if not self.pending:
                self.sel.unregister(key.fileobj)
                with contextlib.suppress(OSError):
                    key.fileobj.close()  # type: ignore[union-attr]
        else:
            try:
                data = os.read(key.fd, 65536)
            except BlockingIOError:
                return
            if data:
                key.data.write(data)
            else:
                self.sel.unregister(key.fileobj)
                self.reading -= 1

    def _reap(self) -> None:
        """The leader has exited but is not reaped yet, so its PID (the group id) cannot
        have been reused: kill whatever it left in its group, then reap it."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.code = self.proc.wait()

    def _close(self) -> None:
        self.sel.close()
        if self.pidfd >= 0:
            os.close(self.pidfd)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


def _exited(pid: int) -> bool:
    """Has ``pid`` exited? Checked without reaping it (WNOWAIT)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(proc: subprocess.Popen[bytes]) -> int | None:
    for sig, grace in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=grace)
            if sig is signal.SIGTERM:
                # The leader exited; make sure nothing else in its group survives.
                os.killpg(proc.pid, signal.SIGKILL)
            break
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            break
    try:
        return proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        return None
