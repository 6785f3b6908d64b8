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
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from runtime.agents import procs, sandbox
from runtime.agents.base import AgentExit, Invocation
from runtime.agents.capture import DEFAULT_HEAD, DEFAULT_TAIL
from runtime.agents.recognise import kind_of, read_command
from runtime.agents.supervise import KILL_GRACE_S, Running, supervise
from runtime.files import UnsafeFileError, open_no_follow, within
from runtime.plan.profiles import CommandProfile, SandboxSettings

log = logging.getLogger(__name__)

ENV_ALLOW = ("PATH", "HOME", "LANG", "TMPDIR", "TERM")
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
        environ: the environment the agent's is drawn from (default: this process's).
    """
    def __init__(self, profile: CommandProfile, environ: Mapping[str, str] | None = None,
                 ) -> None:
        self.profile = profile
        self.environ = os.environ if environ is None else environ

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
                    ) -> tuple[list[str], dict[str, str], dict[str, int]] | str:
        """The argv, environment and descriptors to pass to start, or why it cannot start.

        The descriptors (host path -> fd: the private files' copies) are the caller's to
        close once the process has started.
        """
        settings = self.profile.sandbox
        if settings is False:
            return self.argv(inv), env, {}
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
        fds = sandbox.open_private_files(spec)
        if isinstance(fds, str):
            return fds
        try:
            argv = sandbox.bwrap_argv(bwrap.path, spec, self.argv(inv, inside=True), fds)
        except BaseException:  # the descriptors are the caller's only once returned
            for fd in fds.values():
                os.close(fd)
            raise
        return argv, sandbox.sandbox_environment(env), fds

    def run(self, inv: Invocation) -> AgentExit:
        """Launch the agent (sandboxed unless the profile opts out), supervise it, read its result.

        A launch that cannot happen (a missing program, a sandbox that cannot be set up) is an
        ``AgentExit`` with ``launch_error`` set, not an exception: the attempt records it.
        """
        started = self.start(inv)
        if isinstance(started, AgentExit):
            return started
        try:
            supervise(started.process)
        finally:
            started.end()  # a no-op unless supervision itself failed (Ctrl-C)
            started.process.close()
        return started.result()

    def start(self, inv: Invocation) -> Started | AgentExit:
        """Launch the agent and hand back its supervision; an ``AgentExit`` if it cannot start.

        The caller supervises ``Started.process`` (alone with ``supervise``, or with others
        in a ``Supervisor``) and then reads ``Started.result()``.
        """
        launch = self.launch_argv(inv, agent_environment(self.profile.env, inv.env,
                                                         self.environ))
        if isinstance(launch, str):
            return AgentExit(launch_error=launch)
        argv, env, fds = launch
        stdin = subprocess.PIPE if self.profile.prompt_via == "stdin" else subprocess.DEVNULL
        procs.become_subreaper()
        started_at, started = time.time(), time.monotonic()
        try:
            with procs.launch_lock:
                proc = subprocess.Popen(
                    argv, cwd=inv.workspace, env=env, stdin=stdin, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, start_new_session=True,
                    pass_fds=tuple(fds.values()))
                procs.register(proc.pid)
        except OSError as exc:
            return AgentExit(launch_error=f"{self.profile.argv[0]}: {exc.strerror or exc}")
        finally:
            for fd in fds.values():  # bubblewrap has its own copies
                os.close(fd)
        leader = procs.stat(proc.pid)
        try:
            if inv.leader_log is not None and leader is not None:
                procs.record_leader(inv.leader_log, proc.pid, leader.start,
                                    sandboxed=self.profile.sandbox is not False,
                                    node=inv.node, attempt=inv.attempt)
        except BaseException:  # (a full disk): the agent must not run on unsupervised
            _end_attempt(proc, leader, time.monotonic() - started)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
            raise
        ended = False

        def end() -> None:  # at the leader's exit, and again (a no-op then) at the end
            nonlocal ended
            if not ended:
                ended = True
                _end_attempt(proc, leader, time.monotonic() - started)

        process = Running(proc, timeout_s=inv.timeout_s, cancel=inv.cancel, stdout=inv.stdout,
                          stderr=inv.stderr, on_exit=end,
                          stdin_data=inv.prompt.encode() if proc.stdin is not None else None)
        return Started(self, inv, process, end, started_at)

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
            name = self.profile.error_file
            path = inv.workspace / name
            if os.path.lexists(path):
                # Read from outside the sandbox: never through a link (it could point at
                # the hidden artifacts root), never a FIFO, only inside the workspace.
                if within(inv.workspace, name) != os.path.join(
                        os.path.realpath(inv.workspace), os.path.normpath(name)):
                    return f"{name} present (a link or outside the workspace: not read)"
                try:
                    fd = open_no_follow(path)
                except (OSError, UnsafeFileError):
                    return f"{name} present (not a regular file: not read)"
                with os.fdopen(fd, "rb") as fh:
                    text = fh.read(4096).decode("utf-8", "replace").strip()
                return f"{name}: {text}" if text else f"{name} present"
        if self.profile.result_json:
            return _json_result_error(inv.stdout.head)
        return None


@dataclass(frozen=True)
class Started:
    """A launched command agent: its ``Running`` process, then the reading of its result."""

    agent: CommandAgent
    inv: Invocation
    process: Running
    end: Callable[[], None]
    started_at: float  # wall clock, just before the launch

    def result(self) -> AgentExit:
        """The evidence, once ``process`` is done: nothing the agent started is left running."""
        self.end()
        p = self.process
        if not (p.timed_out or p.cancelled) and p.code == 1 \
                and self.agent.profile.sandbox is not False \
                and (refused := _bwrap_refused(self.inv.stderr.head)) is not None:
            return AgentExit(exit_code=p.code, launch_error=refused)
        return self.agent._result(self.inv, p.code, p.timed_out, p.cancelled)


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
        private=tuple(settings.private),
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
        try:
            procs.kill_descendants(proc.pid, leader.start, scan_all=elapsed > SHORT_ATTEMPT_S)
        except OSError as exc:  # out of descriptors: /proc cannot be listed right now
            log.warning("agent %d: its descendants could not be looked for (%s); its "
                        "process group was killed", proc.pid, exc.strerror or exc)


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
