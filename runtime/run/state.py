"""The run state folded from ledger events, with validated transitions.

``fold`` is the only way to know a run's state: ``resume``, ``show``, ``state.json``
and the reports all derive it from the ledger. A transition the runtime never makes
(an attempt after success, a success without a succeeded attempt, ...) is a forged or
corrupt ledger and a ``LedgerError``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from runtime.errors import LedgerError
from runtime.failures import FailureClass, NodeStatus, Outcome, RunStatus
from runtime.files import replace_atomically
from runtime.run.events import (
    AttemptFinished,
    AttemptStarted,
    Event,
    NodeFailed,
    NodeSkipped,
    NodeSucceeded,
    RunFinished,
    RunStarted,
)

STATE_SCHEMA_VERSION = 1


log = logging.getLogger(__name__)

class AttemptRecord(BaseModel):
    """One attempt of a node, as folded from its ``attempt.started`` and ``attempt.finished``.

    Attributes:
        attempt: the attempt's number.
        profile: the agent profile it ran on.
        trigger: ``initial`` or ``retry``.
        outcome: ``succeeded``, the failure class, or None while the attempt is unfinished
            (in the ledger: a crash or a running attempt).
        exit_code: the agent's exit status (None: stopped, not started, or unfinished).
        error: redacted, bounded error text.
        summary: one redacted line in the agent's own words, else the error's first line.
        fingerprint: the failure's identity across attempts (None on success).
        duration_s: wall-clock seconds (None while unfinished).
        unsatisfied: redacted unsatisfied artifact checks.
        retry_after_s: rate_limited only: the wait the provider asked for.
        waited_s: the rate-limit wait before the attempt started.
        artifacts: succeeded only: each accepted artifact's path -> blake3 digest.
    """
    model_config = ConfigDict(frozen=True, extra="forbid")

    attempt: int
    profile: str
    trigger: Literal["initial", "retry"]
    outcome: Outcome | None = None
    exit_code: int | None = None
    error: str = ""
    summary: str = ""
    fingerprint: str | None = None
    duration_s: float | None = None
    unsatisfied: list[str] = []
    retry_after_s: float | None = None
    waited_s: float = 0.0
    artifacts: dict[str, str] = {}


def charged_attempts(attempts: Iterable[AttemptRecord]) -> int:
    """Finished attempts that count against ``max_attempts``."""
    return sum(1 for a in attempts if a.outcome is not None and a.outcome.is_charged())


def consecutive_lost(attempts: Iterable[AttemptRecord]) -> int:
    """How many of the latest finished attempts were lost, in a row."""
    count = 0
    for a in reversed([a for a in attempts if a.outcome is not None]):
        if a.outcome is not Outcome.LOST:
            break
        count += 1
    return count


class NodeState(BaseModel):
    """A node's state in ``state.json``, folded from the ledger.

    Attributes:
        status: where the node is in the run.
        attempts: every attempt, in order (across ``runtime retry`` too).
        failure: the failure class that ended the node, when it failed.
        reason: why the node failed or was skipped, for a human.
        failed_ancestor: the failed (or skipped) upstream that made it skip.
        artifacts: succeeded: each accepted artifact's path -> blake3 (None otherwise, or
            when written by a runtime that did not record them).
        retry_from: the first attempt of the node's current try (``runtime retry`` starts a
            new one).
    """
    model_config = ConfigDict(frozen=True, extra="forbid")

    status: NodeStatus = NodeStatus.PENDING
    attempts: list[AttemptRecord] = []
    failure: FailureClass | None = None
    reason: str | None = None
    failed_ancestor: str | None = None
    artifacts: dict[str, str] | None = None
    retry_from: int = Field(default=1, description="The first attempt of the node's "
                            "current try (`runtime retry` starts a new one).")

    @property
    def charged(self) -> int:
        """Attempts that count against ``max_attempts`` (lost and cancelled do not)."""
        return charged_attempts(self.attempts)

    @property
    def consecutive_lost(self) -> int:
        """How many of the latest finished attempts were lost, in a row."""
        return consecutive_lost(self.attempts)

    @property
    def last_failure(self) -> AttemptRecord | None:
        """The latest finished attempt that did not succeed, or None."""
        failed = [a for a in self.attempts if a.outcome not in (None, Outcome.SUCCEEDED)]
        return failed[-1] if failed else None

    def unfinished(self) -> list[AttemptRecord]:
        """Attempts started but never finished (the process running them died)."""
        return [a for a in self.attempts if a.outcome is None]


class RunState(BaseModel):
    """``state.json``: the ledger folded. Derived; the ledger stays the source of truth."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1] = 1
    run_id: str
    topology: str
    plan_digest: str
    status: RunStatus
    last_seq: int
    attempts_used: int
    settings: dict[str, Any]
    nodes: dict[str, NodeState]


class Folder:
    """Folds events one at a time, so a long run's snapshot costs O(new events)."""

    def __init__(self, node_ids: Iterable[str]) -> None:
        self.nodes: dict[str, dict[str, Any]] = {
            n: {"status": NodeStatus.PENDING, "attempts": []} for n in node_ids}
        self.head: RunStarted | None = None
        self.status, self.last_seq, self.used = RunStatus.RUNNING, 0, 0
        self.settings: dict[str, Any] = {}
        self.finished = False
        # Each node's NodeState, built again only after an event touched the node: a
        # periodic state.json of a large run would otherwise rebuild every node each time.
        self._built: dict[str, NodeState] = {}

    # C901: One branch per event type: the fold reads best as one dispatch in event order.
    def apply(self, ev: Event) -> None:  # noqa: C901
        """Fold one event, refusing one that no runtime could have written in this order.

        An agent that can write the ledger must not be able to forge an outcome (a
        ``node.succeeded`` with no succeeded attempt, an attempt after success).
        """
        problem = self._invalid(ev)
        if problem:
            raise LedgerError("ledger.jsonl", f"seq {ev.seq} ({ev.event}): {problem}; the "
                              "ledger was edited or forged and cannot be trusted")
        self.last_seq = ev.seq
        nodes = self.nodes
        node = getattr(ev, "node", None)
        if node is not None:
            self._built.pop(node, None)
        match ev:
            case RunStarted():
                self.head = self.head or ev
                self.settings = ev.settings
                self.status = RunStatus.RUNNING
                self.finished = False
                if ev.retried:
                    self.used = 0  # the run budget applies to each try
                for nid in ev.retried:
                    self._built.pop(nid, None)
                    d = nodes[nid]
                    d.update(status=NodeStatus.PENDING, failure=None, reason=None,
                             failed_ancestor=None,
                             retry_from=max((r["attempt"] for r in d["attempts"]),
                                            default=0) + 1)
            case AttemptStarted():
                self.used += 1
                nodes[ev.node]["status"] = NodeStatus.RUNNING
                nodes[ev.node]["attempts"].append(
                    {"attempt": ev.attempt, "profile": ev.profile, "trigger": ev.trigger,
                     "waited_s": ev.waited_s})
            case AttemptFinished():
                for rec in nodes[ev.node]["attempts"]:
                    if rec["attempt"] == ev.attempt:
                        rec.update(outcome=ev.outcome, exit_code=ev.exit_code, error=ev.error,
                                   summary=ev.summary, unsatisfied=ev.unsatisfied,
                                   retry_after_s=ev.retry_after_s, artifacts=ev.artifacts,
                                   fingerprint=ev.fingerprint, duration_s=ev.duration_s)
                if nodes[ev.node]["status"] is NodeStatus.RUNNING:
                    nodes[ev.node]["status"] = NodeStatus.PENDING
            case NodeSucceeded():
                nodes[ev.node].update(status=NodeStatus.SUCCEEDED, artifacts=ev.artifacts)
            case NodeFailed():
                nodes[ev.node].update(status=NodeStatus.FAILED, failure=ev.failure,
                                      reason=ev.reason)
            case NodeSkipped():
                nodes[ev.node].update(status=NodeStatus.SKIPPED,
                                      failed_ancestor=ev.failed_ancestor,
                                      reason=ev.reason or None)
            case RunFinished():
                self.status = ev.status
                self.finished = True

    # C901: One check per forbidden transition, listed together so the rules can be audited.
    def _invalid(self, ev: Event) -> str:  # noqa: C901
        """Why ``ev`` cannot follow the events folded so far, or ""."""
        if self.head is None and not isinstance(ev, RunStarted):
            return "before run.started"
        if self.finished and not isinstance(ev, RunStarted):
            return "after run.finished (only a resumed run.started may follow)"
        for nid in ev.retried if isinstance(ev, RunStarted) else ():
            if nid not in self.nodes:
                return f"retried node {nid!r} is not in the plan"
            if self.nodes[nid]["status"] is NodeStatus.SUCCEEDED:
                return f"retried node {nid} already succeeded"
        node = getattr(ev, "node", None)
        if node is None:
            if isinstance(ev, RunFinished) and ev.status is RunStatus.SUCCEEDED and any(
                    d["status"] is not NodeStatus.SUCCEEDED for d in self.nodes.values()):
                return "run succeeded while some nodes did not"
            return ""
        if node not in self.nodes:
            return f"node {node!r} is not in the plan"
        status = self.nodes[node]["status"]
        attempts = {r["attempt"]: r for r in self.nodes[node]["attempts"]}
        terminal = status in (NodeStatus.SUCCEEDED, NodeStatus.FAILED, NodeStatus.SKIPPED)
        if terminal and not isinstance(ev, AttemptFinished):
            return f"node {node} is already {status.value}"
        match ev:
            case AttemptStarted() if ev.attempt in attempts:
                return f"attempt {ev.attempt} of {node} was already started"
            case AttemptFinished() if ev.attempt not in attempts:
                return f"attempt {ev.attempt} of {node} was never started"
            case AttemptFinished() if attempts[ev.attempt].get("outcome") is not None:
                return f"attempt {ev.attempt} of {node} already finished"
            case NodeSucceeded() if not any(r.get("outcome") == "succeeded"
                                            for r in attempts.values()):
                return f"node {node} has no succeeded attempt"
        return ""

    def state(self) -> RunState:
        """The run's state as folded so far; a ledger without ``run.started`` is an error."""
        if self.head is None:
            raise LedgerError("ledger.jsonl", "no run.started event; not a run ledger")
        h = self.head
        return RunState(
            run_id=h.run_id, topology=h.topology, plan_digest=h.plan_digest,
            status=self.status, last_seq=self.last_seq, attempts_used=self.used,
            settings=self.settings,
            nodes={n: self._node_state(n, d) for n, d in self.nodes.items()},
        )

    def _node_state(self, nid: str, folded: dict[str, Any]) -> NodeState:
        built = self._built.get(nid)
        if built is None:
            built = self._built[nid] = NodeState.model_validate(folded)
        return built


def fold(events: Iterable[Event], node_ids: Iterable[str]) -> RunState:
    """Replay events into a run state. Pure."""
    folder = Folder(node_ids)
    for ev in events:
        folder.apply(ev)
    return folder.state()


def write_state(path: Path, state: RunState) -> None:
    """Replace ``state.json`` atomically (write a sibling, then rename over)."""
    replace_atomically(path, (state.model_dump_json(indent=2) + "\n").encode())


def write_final_state(path: Path, state: RunState) -> None:
    """Write ``state.json`` once ``run.finished`` is in the ledger; a failure only warns.

    A full disk, or a path an unsandboxed agent turned into a directory: the run is whole
    in its ledger all the same, so its outcome and exit code stand.
    """
    try:
        write_state(path, state)
    except OSError as exc:
        log.warning("%s not written (%s); the ledger records the run, and `runtime resume` "
                    "writes it again", path, exc.strerror or exc)
