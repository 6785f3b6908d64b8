"""What every agent adapter receives (``Invocation``) and returns (``AgentExit``).

Evidence only: the executor turns it into a failure class, and nothing an agent
returns can change how many attempts it gets.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from runtime.agents.capture import BoundedCapture
from runtime.failures import FailureClass
from runtime.plan.topology import ArtifactSpec


@dataclass(frozen=True)
class Invocation:
    """One attempt of one node, as an agent sees it."""

    run_id: str
    node: str
    attempt: int
    max_attempts: int
    prompt: str
    prompt_file: Path
    workspace: Path
    timeout_s: float
    env: Mapping[str, str]
    artifacts: tuple[ArtifactSpec, ...]
    stdout: BoundedCapture
    stderr: BoundedCapture
    cancel: threading.Event = field(default_factory=threading.Event)
    # The attempt's directory in the run (``attempt.json`` lives there): adapters that
    # start processes record them there for a resume after a crash. None outside a run.
    attempt_dir: Path | None = None
    # The run's leaders log: adapters that start processes append each leader to it, so a
    # resume after a crash can kill what is left. None outside a run (or on a worker).
    leader_log: Path | None = None


@dataclass(frozen=True)
class AgentExit:
    """What happened, as observed. At most one of the flags explains a failure."""

    exit_code: int | None = None
    timed_out: bool = False
    cancelled: bool = False
    launch_error: str | None = None
    reported_error: str | None = None  # a terminal error signalled with exit status 0
    # What the adapter recognised in the agent's own output (claude's result JSON, an
    # HTTP status, codex's stderr): a failure class that overrides the generic one
    # (agent_exit, contradictory_completion), and a one-line summary of the agent's
    # own reason. Both are evidence the adapter observed; neither can raise a ceiling.
    failure: FailureClass | None = None
    summary: str | None = None
    # rate_limited only: the wait the provider asked for (Retry-After), in seconds.
    retry_after_s: float | None = None


class Agent(Protocol):
    """Runs one invocation to completion (or timeout, or cancellation)."""

    def run(self, inv: Invocation) -> AgentExit:
        """Run ``inv``'s agent and return the evidence it left; never raises for agent failures."""
