"""``command`` agent: a subprocess, sandboxed by default, with an env allow-list.

argv placeholders: ``{prompt_file}``, ``{workspace}``, ``{node}``; they and the
``RUNTIME_*`` paths are absolute: the fixed paths inside the sandbox (``/mnt/workspace``,
``/mnt/attempt/prompt.md``, ``/mnt/attempt/attempt.json``, see ``sandbox.py``), or the host's
with ``sandbox: false``. The prompt goes on stdin (``prompt_via: stdin``) or only as the
file. The child gets PATH, HOME, LANG, LC_*, TMPDIR, TERM, the names its profile lists
under ``env:``, and RUNTIME_*; nothing else.

No process outlives the attempt (``procs.py``): the agent starts in its own session;
a timeout or cancellation terminates its process group (SIGTERM, then SIGKILL after a
grace period); when the leader is gone, everything the runtime adopted from it (the
runtime is a child subreaper) is killed and reaped before ``run`` returns. Sandboxed,
the leader is bubblewrap and the agent's PID namespace dies with it.

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
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from runtime.agents import procs, sandbox
from runtime.agents.base import AgentExit, Invocation
from runtime.agents.capture import DEFAULT_HEAD, DEFAULT_TAIL
from runtime.agents.recognise import kind_of, read_command
from runtime.plan.profiles import CommandProfile, SandboxSettings

ENV_ALLOW = ("PATH", "HOME", "LANG", "TMPDIR", "TERM")
KILL_GRACE_S = 2.0
POLL_S = 0.2
READ_LIMIT = DEFAULT_HEAD + DEFAULT_TAIL  # all of stderr the capture kept
# Past this, a cleanup reads every process rather than those with later pids (the pid
# counter could have wrapped; pid_max can be as low as 32768).
SHORT_ATTEMPT_S = 1.0


def agent_environment(profile_env: list[str], runtime_env: Mapping[str, str],
                      source: Mapping[str, str]) -> dict[str, str]:
    """The child's whole environment: allow-list, profile names, RUNTIME_*."""
    env = {k: v for k, v in source.items() if k in ENV_ALLOW or k.startswith("LC_")}
    env.update({k: source[k] for k in profile_env if k in source})
    env.update(runtime_env)
    return env


class CommandAgent:
    """The ``command`` agent: runs a CLI (claude, codex or any program) as a supervised process.

    Args:
        profile: the profile naming the program, its argv template, environment allow-list
            and sandbox settings.
    """
    def __init__(self, profile: CommandProfile) -> None:
        self.profile = profile

    def argv(self, inv: Invocation, *, inside: bool = False) -> list[str]:
        """The agent's argv with placeholders filled.

        With the sandbox's fixed paths when ``inside``, else the host's (absolute either
        way).
        """
        prompt_file = str(sandbox.PROMPT_FILE) if inside else os.path.abspath(inv.prompt_file)
        workspace = str(sandbox.WORKSPACE) if inside else os.path.abspath(inv.workspace)
        subs = {"{prompt_file}": prompt_file, "{workspace}": workspace, "{node}": inv.node}
        out = []
        for arg in self.profile.argv:
            for key, value in subs.items():
                arg = arg.replace(key, value)
            out.append(arg)
        return out

    def launch_argv(self, inv: Invocation, env: dict[str, str],
                    ) -> tuple[list[str], dict[str, str]] | str:
        """The argv and environment to start, or why they cannot be started."""
        settings = self.profile.sandbox
        if settings is False:
            return self.argv(inv), env
        bwrap = sandbox.find_bubblewrap()
        if bwrap is None:
            return f"bubblewrap (bwrap) is not installed: {sandbox.FIX}"
        # Inside, a missing program is bwrap's exit 1, not an OSError: look it up here
        # (the host is visible at the same paths) to report it as a launch error.
        program = self.profile.argv[0]
        found = (os.access(os.path.join(inv.workspace, program), os.X_OK) if "/" in program
                 else shutil.which(program, path=env.get("PATH", os.defpath)) is not None)
        if not found:
            return f"{program}: No such file or directory"
        resolved = (os.path.join(inv.workspace, program) if "/" in program
                    else shutil.which(program, path=env.get("PATH", os.defpath)))
        spec = sandbox_spec(inv, settings, resolved,
                            tuple(env.get("PATH", "").split(os.pathsep)))
        problem = sandbox.create_writable_dirs(spec)
        if problem is not None:
            return problem
        return (sandbox.bwrap_argv(bwrap.path, spec, self.argv(inv, inside=True)),
                sandbox.sandbox_environment(env))

    def run(self, inv: Invocation) -> AgentExit:
        """Launch the agent (sandboxed unless the profile opts out), supervise it, read its result.

        A launch that cannot happen (a missing program, a sandbox that cannot be set up) is an
        ``AgentExit`` with ``launch_error`` set, not an exception: the attempt records it.
        """
        launch = self.launch_argv(inv, agent_environment(self.profile.env, inv.env,
                                                         os.environ))
        if isinstance(launch, str):
            return AgentExit(launch_error=launch)
        argv, env = launch
        stdin = subprocess.PIPE if self.profile.prompt_via == "stdin" else subprocess.DEVNULL
        procs.become_subreaper()
        started = time.monotonic()
        try:
            with procs.launch_lock:
                proc = subprocess.Popen(
                    argv, cwd=inv.workspace, env=env, stdin=stdin, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, start_new_session=True)
                procs.register(proc.pid)
        except OSError as exc:
            return AgentExit(launch_error=f"{self.profile.argv[0]}: {exc.strerror or exc}")
        leader = procs.stat(proc.pid)
        if inv.leader_log is not None and leader is not None:
            procs.record_leader(inv.leader_log, proc.pid, leader.start,
                                sandboxed=self.profile.sandbox is not False, node=inv.node,
                                attempt=inv.attempt)
        stdin_data = inv.prompt.encode() if proc.stdin is not None else None
        ended = False

        def end() -> None:  # at the leader's exit, and again (a no-op then) at the end
            nonlocal ended
            if not ended:
                ended = True
                _end_attempt(proc, leader, time.monotonic() - started)

        try:
            code, timed_out, cancelled = _Supervisor(proc, inv, stdin_data, end).run()
        finally:
            end()
        if not (timed_out or cancelled) and code == 1 and self.profile.sandbox is not False \
                and (refused := _bwrap_refused(inv.stderr.head)) is not None:
            return AgentExit(exit_code=code, launch_error=refused)
        return self._result(inv, code, timed_out, cancelled)

    def _result(self, inv: Invocation, code: int | None, timed_out: bool,
                cancelled: bool) -> AgentExit:
        """Evidence, plus the kind's reading of the agent's own reason.

        For claude, its result JSON whatever the exit code; for codex, its own error lines
        (recognise.py).
        """
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


def sandbox_spec(inv: Invocation, settings: SandboxSettings, program: str | None = None,
                 path_dirs: tuple[str, ...] = ()) -> sandbox.SandboxSpec:
    """What the attempt's sandbox binds, and what it hides.

    The run directory's artifacts root (``<root>/runs/<run-id>/nodes/<node>/attempts/<n>``),
    or the run directory itself when it does not live under a ``runs/`` directory.
    """
    hide: tuple[Path, ...] = ()
    context = None
    if inv.attempt_dir is not None:
        attempt_dir = Path(os.path.abspath(inv.attempt_dir))
        context = attempt_dir / "attempt.json"
        ups = attempt_dir.parents
        if attempt_dir.parent.name == "attempts" and len(ups) > 4:
            run_dir = ups[3]
            root = run_dir.parents[1] if run_dir.parent.name == "runs" else run_dir
            hide = (root if root != Path("/") else run_dir,)  # never a tmpfs over /
        else:  # not a run's layout (a caller of the adapter): hide the attempt's parent
            hide = (attempt_dir.parent,)
    return sandbox.SandboxSpec(
        workspace=Path(os.path.abspath(inv.workspace)),
        prompt_file=Path(os.path.abspath(inv.prompt_file)), attempt_context=context,
        hide=hide, network=settings.network, writable=tuple(settings.writable),
        expose=sandbox.tmp_roots([program or "", *path_dirs]))


def _bwrap_refused(stderr: bytes) -> str | None:
    """Bubblewrap's own failure (a mount it could not make, a program it could not exec).

    Exit 1 with a single ``bwrap: `` line as the only output, since the agent never ran to
    write anything.
    """
    text = stderr.decode("utf-8", "replace")
    if text.startswith("bwrap: ") and text.count("\n") <= 1:
        return f"sandbox: {text.strip()}"
    return None


def _end_attempt(proc: subprocess.Popen[bytes], leader: procs.Proc | None,
                 elapsed: float) -> None:
    """Nothing the agent started survives.

    The leader (if the supervisor gave up on it), then everything the runtime adopted from
    it.
    """
    procs.unregister(proc.pid)
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=KILL_GRACE_S)
    if leader is not None:
        procs.kill_descendants(proc.pid, leader.start, scan_all=elapsed > SHORT_ATTEMPT_S)


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
    """One thread per attempt does all of the child's I/O.

    A selector over stdout, stderr, stdin and a pidfd. No pump threads, so no GIL hand-offs
    between them, and the exit is seen the moment it happens (``Popen.wait(timeout)`` polls
    with sleeps that grow to 50 ms, more than a short agent's whole run).
    """

    def __init__(self, proc: subprocess.Popen[bytes], inv: Invocation,
                 stdin_data: bytes | None, on_exit: Callable[[], None]) -> None:
        self.proc, self.inv, self.on_exit = proc, inv, on_exit
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
                    self.on_exit()
                elif self.code is None and self.inv.cancel.is_set():
                    cancelled, self.code = True, _kill_group(self.proc)
                    self.on_exit()
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
        """Kill what the exited leader left in its process group, then reap the leader.

        The leader has exited but is not reaped yet, so its PID (the group id) cannot have
        been reused: kill whatever it left in its group, then reap it.
        """
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.code = self.proc.wait()
        # Now, not after the drain: an orphan holding stdout open would hold the drain.
        self.on_exit()

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
