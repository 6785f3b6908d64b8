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
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from typing import IO

from ..capture import pump
from ..profiles import CommandProfile
from . import AgentExit, Invocation

ENV_ALLOW = ("PATH", "HOME", "LANG", "TMPDIR", "TERM")
KILL_GRACE_S = 2.0
POLL_S = 0.2


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
        threads = [threading.Thread(target=pump, args=(proc.stdout, inv.stdout), daemon=True),
                   threading.Thread(target=pump, args=(proc.stderr, inv.stderr), daemon=True)]
        if proc.stdin is not None:
            threads.append(threading.Thread(target=_feed, args=(proc.stdin, inv.prompt),
                                            daemon=True))
        for t in threads:
            t.start()
        code, timed_out, cancelled = _wait(proc, inv)
        for t in threads:
            t.join(timeout=KILL_GRACE_S)
        if timed_out or cancelled:
            return AgentExit(exit_code=code, timed_out=timed_out, cancelled=cancelled)
        return AgentExit(exit_code=code, reported_error=self._reported(inv) if code == 0
                         else None)

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


def _feed(stdin: IO[bytes], prompt: str) -> None:
    try:
        stdin.write(prompt.encode())
    except (BrokenPipeError, OSError):
        pass  # the agent does not read its prompt from stdin; that is its choice
    finally:
        with contextlib.suppress(OSError):
            stdin.close()


def _wait(proc: subprocess.Popen[bytes], inv: Invocation) -> tuple[int | None, bool, bool]:
    deadline = time.monotonic() + inv.timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return _kill_group(proc), True, False
        if inv.cancel.is_set():
            return _kill_group(proc), False, True
        try:
            return proc.wait(timeout=min(POLL_S, remaining)), False, False
        except subprocess.TimeoutExpired:
            continue


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
