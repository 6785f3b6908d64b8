"""The ledger's event schema: the on-disk contract of ``ledger.jsonl`` (DESIGN section 7).

One JSON object per line, each with ``schema_version``, a ``seq`` that increases by
exactly one, a time stamp and an ``event`` tag. Parsing is strict: a torn last line
(as a crash leaves it) is dropped; anything else malformed is a ``LedgerError``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from runtime.errors import LedgerError
from runtime.failures import FailureClass, Outcome, RunStatus

LEDGER_SCHEMA_VERSION = 1


class _Event(BaseModel):
    """The fields every ledger event carries (documented in each event's Attributes)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1] = 1
    seq: int = 0
    ts: float = Field(default=0.0, description="Unix time the event was appended.")


class RunStarted(_Event):
    """A run began, or was resumed or retried: the first event of each process that runs it.

    Attributes:
        event: the discriminator, ``run.started``.
        run_id: the run's id (its directory name under ``runs/``).
        plan_digest: the digest of the plan the run executes; a resume refuses another plan.
        topology: the topology's name.
        resumed: this process continues an interrupted run (``runtime resume``).
        retried: ``runtime retry``: the failed and skipped nodes set back to pending, each
            with a fresh ``max_attempts``; attempt numbers continue.
        settings: run-level overrides (agent, jobs, budget, deadline, no_fallback) and
            per-node retry settings from ``--set``, as ``RunSettings`` dumps them.
        schema_version: the ledger format version (every event carries it).
        seq: the event's position in the ledger, from 1 (every event carries it).
        ts: Unix time the event was appended (every event carries it).
    """
    event: Literal["run.started"] = "run.started"
    run_id: str
    plan_digest: str
    topology: str
    resumed: bool = False
    retried: list[str] = Field(
        default_factory=list, description="`runtime retry`: the failed and skipped nodes "
        "set back to pending, each with a fresh max_attempts; attempt numbers continue.")
    settings: dict[str, Any] = Field(
        default_factory=dict, description="Run-level overrides: agent, jobs, budget, "
        "deadline, no_fallback, and per-node retry settings from --set.")


class AttemptStarted(_Event):
    """An attempt of a node began; its number is unique within the node.

    Attributes:
        event: the discriminator, ``attempt.started``.
        node: the node's id.
        attempt: the attempt's number (its directory under ``attempts/``).
        profile: the agent profile the attempt runs on (a fallback when the node moved).
        trigger: ``initial`` for a node's first attempt, ``retry`` for any later one.
        prior_attempt: the attempt this one retries (None for an initial attempt).
        prompt_digest: blake3 of the exact prompt the agent was given.
        preamble_digest: blake3 of the retry preamble inserted (None: none was).
        waited_s: the rate-limit wait before this attempt, in seconds.
    """
    event: Literal["attempt.started"] = "attempt.started"
    node: str
    attempt: int
    profile: str
    trigger: Literal["initial", "retry"]
    prior_attempt: int | None = None
    prompt_digest: str
    preamble_digest: str | None = None
    waited_s: float = Field(default=0.0, description="Rate-limit wait before this attempt.")


class AttemptFinished(_Event):
    """An attempt ended, with the evidence its outcome was decided on (redacted, bounded).

    Attributes:
        event: the discriminator, ``attempt.finished``.
        node: the node's id.
        attempt: the attempt's number.
        outcome: ``succeeded`` or the failure class that decided the attempt.
        exit_code: the agent's exit status (None: it was stopped or never started).
        error: redacted, bounded error text.
        summary: one redacted line: the agent's own reason as its adapter recognised it,
            else the error's first line.
        fingerprint: the failure's identity across attempts (None on success).
        duration_s: wall-clock seconds from start to finish.
        unsatisfied: redacted unsatisfied artifact checks (the retry preamble names them).
        retry_after_s: rate_limited only: the wait the provider asked for.
        artifacts: succeeded only: each accepted artifact's workspace path -> blake3 digest.
    """
    event: Literal["attempt.finished"] = "attempt.finished"
    node: str
    attempt: int
    outcome: Outcome
    exit_code: int | None = None
    error: str = Field(default="", description="Redacted, bounded error text.")
    summary: str = Field(default="", description="One redacted line: the agent's own "
                         "reason as its adapter recognised it, else the error's first line.")
    fingerprint: str | None = None
    duration_s: float = 0.0
    unsatisfied: list[str] = Field(default_factory=list, description="Redacted unsatisfied "
                                   "artifact checks (the retry preamble names them).")
    retry_after_s: float | None = Field(default=None, description="rate_limited: the wait "
                                        "the provider asked for.")
    artifacts: dict[str, str] = Field(default_factory=dict, description="succeeded: each "
                                      "accepted artifact's workspace path -> blake3 digest.")


class NodeSucceeded(_Event):
    """A node reached success; its accepted artifacts are what downstream nodes receive.

    Attributes:
        event: the discriminator, ``node.succeeded``.
        node: the node's id.
        attempts: how many attempts the node made, the succeeding one included.
        artifacts: each accepted artifact's path -> blake3; downstream inputs are checked
            against it (None: written by a runtime that did not record them).
    """
    event: Literal["node.succeeded"] = "node.succeeded"
    node: str
    attempts: int
    artifacts: dict[str, str] | None = Field(
        default=None, description="Each accepted artifact's path -> blake3; downstream inputs "
        "are checked against it (None: written by a runtime that did not record them).")


class NodeFailed(_Event):
    """A node failed for good: no attempt or fallback profile is left.

    Attributes:
        event: the discriminator, ``node.failed``.
        node: the node's id.
        failure: the failure class of the attempt that decided it (None when no
            attempt's class did).
        reason: why the node stopped, for a human (a ceiling reached, a budget spent).
    """
    event: Literal["node.failed"] = "node.failed"
    node: str
    failure: FailureClass | None
    reason: str


class NodeSkipped(_Event):
    """A node will not run in this run: an upstream failed, or the run stopped first.

    Attributes:
        event: the discriminator, ``node.skipped``.
        node: the node's id.
        failed_ancestor: the failed (or skipped) upstream node that blocks this one.
        reason: why, when no ancestor failed (e.g. the run deadline passed before the node
            started).
    """
    event: Literal["node.skipped"] = "node.skipped"
    node: str
    failed_ancestor: str | None = Field(default=None, description="The failed (or skipped) "
                                        "upstream node that blocks this one.")
    reason: str = Field(default="", description="Why, when no ancestor failed (e.g. the run "
                        "deadline passed before the node started).")


class RunFinished(_Event):
    """The run ended (or stopped, resumable) with this status.

    Attributes:
        event: the discriminator, ``run.finished``.
        status: how the run ended.
        counts: how many nodes ended in each status.
    """
    event: Literal["run.finished"] = "run.finished"
    status: RunStatus
    counts: dict[str, int] = Field(default_factory=dict)


Event = Annotated[
    RunStarted | AttemptStarted | AttemptFinished | NodeSucceeded | NodeFailed | NodeSkipped
    | RunFinished,
    Field(discriminator="event"),
]


EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise LedgerError(path, f"cannot read ledger: {exc.strerror}") from None


def read_events(path: Path) -> list[Event]:
    """Parse a ledger; a torn (incomplete or unparsable) last line is dropped."""
    return parse_events(_read(path), path)


def parse_events(raw: bytes, path: Path) -> list[Event]:
    """Parse ledger bytes (read from ``path``, named in errors)."""
    lines = raw.split(b"\n")
    torn_ok = not raw.endswith(b"\n")  # the last element is then an unterminated line
    events: list[Event] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deep
            if number == len(lines) and torn_ok:
                break  # torn by a crash mid-write
            raise LedgerError(path, f"line {number}: not JSON; the ledger is corrupt") from None
        version = data.get("schema_version") if isinstance(data, dict) else None
        if isinstance(version, int) and version > LEDGER_SCHEMA_VERSION:
            raise LedgerError(path, f"line {number}: schema_version {version} is newer than "
                              f"this runtime reads ({LEDGER_SCHEMA_VERSION}); upgrade")
        try:
            event = EVENT_ADAPTER.validate_python(data)
        except ValidationError as exc:
            if number == len(lines) and torn_ok:
                break
            raise LedgerError(path, f"line {number}: not a ledger event: "
                              f"{exc.errors()[0]['msg']}") from None
        # The runtime numbers lines 1, 2, 3, ...: a gap or a repeat means an edit.
        if event.seq != (events[-1].seq if events else 0) + 1:
            raise LedgerError(path, f"line {number}: seq {event.seq} does not follow "
                              f"{events[-1].seq if events else 0}; the ledger was edited")
        events.append(event)
    return events
