"""Where an attempt's agent runs: the seam between the driver and an execution engine.

The driver (``Attempt``) checks the plan prompt, resets the workspace, places the inputs
and assembles the prompt; then it hands an engine an ``AgentRequest`` and gets back an
``AgentOutcome``. The request is self-contained and picklable (prompt bytes, input
artifacts as bytes with their digests, the frozen profile, the names, never the values,
of the environment variables the agent may read), so an engine may run it on another
host with no shared file system. The outcome is picklable too: the agent's exit
evidence, its bounded stdout/stderr, its declared artifacts (size-capped), where and
when it ran.

The driver stays the only writer of the run directory and the ledger: an engine that
ran elsewhere hands back bytes, and ``deliver`` writes them into the driver's attempt
captures and workspace, where the driver verifies the artifact contract as for a local
attempt. ``LocalEngine`` runs the agent in the driver's process on the driver's own
workspace and captures (today's behaviour), so it has nothing to deliver.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from runtime.agents import AnyProfile, make_agent
from runtime.agents.base import AgentExit, Invocation
from runtime.agents.capture import BoundedCapture
from runtime.agents.command import CommandAgent, Started
from runtime.files import UnsafeFileError, open_no_follow
from runtime.plan.profiles import CommandProfile
from runtime.plan.topology import ArtifactSpec

LOCAL = "local"
_HOST = socket.gethostname()  # a syscall per attempt otherwise


@dataclass(frozen=True)
class InputFile:
    """One placed input: workspace-relative path, content, blake3 of the content."""

    path: str
    data: bytes
    digest: str


@dataclass(frozen=True)
class AgentRequest:
    """One attempt's agent run, as an engine receives it: nothing refers to the driver."""

    run_id: str
    node: str
    attempt: int
    max_attempts: int
    profile_name: str
    profile: AnyProfile
    prompt: bytes
    inputs: tuple[InputFile, ...]
    # Names only: a worker reads the values from its own environment (secrets are never
    # shipped from the driver).
    env_names: tuple[str, ...]
    timeout_s: float
    artifacts: tuple[ArtifactSpec, ...]
    # attempt.json as the driver wrote it at the start (RUNTIME_ATTEMPT_CONTEXT): a
    # remote worker lays it out beside the prompt; the local engine's is already there.
    context: bytes = b""


@dataclass(frozen=True)
class AgentOutcome:
    """What an engine observed of one attempt.

    ``lost``: the worker died under the attempt (the exit evidence is then empty, and the
    attempt is recorded ``lost``, uncharged).
    """

    exit: AgentExit
    engine: str
    host: str
    worker: str
    started_at: float
    finished_at: float
    stdout_total: int = 0
    stderr_total: int = 0
    # Filled only by engines that ran away from the driver's captures and workspace.
    stdout: bytes = b""
    stderr: bytes = b""
    artifacts: Mapping[str, bytes] = field(default_factory=dict)
    lost: str | None = None


@dataclass(frozen=True)
class LocalSite:
    """The driver's side of one attempt, never shipped to a remote worker.

    Its workspace, captures and cancel event, and the RUNTIME_* variables pointing at them.
    Never shipped to a remote worker.
    """

    workspace: Path
    attempt_dir: Path
    prompt_file: Path
    env: Mapping[str, str]
    stdout: BoundedCapture
    stderr: BoundedCapture
    cancel: threading.Event
    leader_log: Path | None = None  # the run's leaders.jsonl (procs.kill_leftovers)


class Engine(Protocol):
    """Runs one agent request to completion, timeout, cancellation or loss."""

    name: str

    def run(self, request: AgentRequest, site: LocalSite) -> AgentOutcome:
        """Run one attempt's agent and return what it observed."""


# PLR0913: Maps one-to-one onto Invocation's fields; all but the request keyword-only.
def invocation(request: AgentRequest, *, prompt_file: Path, workspace: Path,  # noqa: PLR0913
               attempt_dir: Path, env: Mapping[str, str], stdout: BoundedCapture,
               stderr: BoundedCapture, cancel: threading.Event,
               leader_log: Path | None = None) -> Invocation:
    """Build the adapter's ``Invocation`` for ``request``, at the given local paths."""
    return Invocation(
        run_id=request.run_id, node=request.node, attempt=request.attempt,
        max_attempts=request.max_attempts, prompt=request.prompt.decode("utf-8"),
        prompt_file=prompt_file, workspace=workspace, timeout_s=request.timeout_s, env=env,
        artifacts=request.artifacts, stdout=stdout, stderr=stderr, cancel=cancel,
        attempt_dir=attempt_dir, leader_log=leader_log)


class LocalEngine:
    """The agent runs in this process, on the driver's workspace and captures.

    A command agent can also be started without blocking (``start``), for a caller that
    supervises all its agents' processes in one ``Supervisor`` loop; ``outcome`` then reads
    it once its process is done.
    """

    name = LOCAL

    def __init__(self) -> None:
        # The run's environment, read once: os.environ decodes every entry on each pass,
        # which was a tenth of the cost of starting a short agent.
        self._environ = dict(os.environ)

    def run(self, request: AgentRequest, site: LocalSite) -> AgentOutcome:
        """Run the agent in this process, in place in the attempt's workspace."""
        started = time.time()
        exit_ = make_agent(request.profile).run(_local_invocation(request, site))
        return self._outcome(exit_, site, started)

    def start(self, request: AgentRequest, site: LocalSite) -> Started | AgentOutcome | None:
        """Launch a command agent and hand back its supervision (``Started.process``).

        An ``AgentOutcome`` when it could not be launched; None for an agent kind that
        only runs blocking (http, python, simulated): ``run`` it on a thread instead.
        """
        if not isinstance(request.profile, CommandProfile):
            return None
        started = time.time()
        launched = CommandAgent(request.profile, self._environ).start(
            _local_invocation(request, site))
        if isinstance(launched, AgentExit):
            return self._outcome(launched, site, started)
        return launched

    @classmethod
    def outcome(cls, launched: Started, site: LocalSite) -> AgentOutcome:
        """What ``start``'s agent did, once its process is done."""
        return cls._outcome(launched.result(), site, launched.started_at)

    @classmethod
    def _outcome(cls, exit_: AgentExit, site: LocalSite, started: float) -> AgentOutcome:
        return AgentOutcome(exit=exit_, engine=cls.name, host=_HOST, worker=f"pid {os.getpid()}",
                            started_at=started, finished_at=time.time(),
                            stdout_total=site.stdout.total, stderr_total=site.stderr.total)


def _local_invocation(request: AgentRequest, site: LocalSite) -> Invocation:
    return invocation(request, prompt_file=site.prompt_file, workspace=site.workspace,
                      attempt_dir=site.attempt_dir, env=site.env, stdout=site.stdout,
                      stderr=site.stderr, cancel=site.cancel, leader_log=site.leader_log)


def deliver(outcome: AgentOutcome, site: LocalSite) -> None:
    """Write what a remote engine brought back into the driver's captures and workspace.

    Artifact paths are the node's declared ones (validated relative paths); a file the
    workspace already has there (an input) is not overwritten, and links are never followed.
    """
    if outcome.stdout:
        site.stdout.write(outcome.stdout)
    if outcome.stderr:
        site.stderr.write(outcome.stderr)
    for rel, data in outcome.artifacts.items():
        dst = site.workspace / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)


def collect_artifacts(workspace: Path, specs: tuple[ArtifactSpec, ...],
                      ) -> tuple[dict[str, bytes], list[str]]:
    """Collect the declared artifacts present in a worker's workspace, bounded and link-free.

    The declared artifacts present in a worker's workspace, each read without following
    links and at most its ``max_bytes`` + 1 (so the driver's contract check still sees an
    oversize file as oversize); problems name the path.
    """
    out: dict[str, bytes] = {}
    problems: list[str] = []
    for spec in specs:
        path = workspace / spec.path
        if not os.path.lexists(path):
            continue
        try:
            fd = open_no_follow(path)
        except (OSError, UnsafeFileError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            problems.append(f"{spec.path}: cannot be read on the worker ({reason})")
            continue
        with os.fdopen(fd, "rb") as fh:
            out[spec.path] = fh.read(spec.max_bytes + 1)
    return out, problems
