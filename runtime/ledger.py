"""The append-only ledger (``ledger.jsonl``) and the run state folded from it.

One JSON object per line, each with ``schema_version``, a monotonically increasing
``seq`` and an ``event`` tag (DESIGN section 7). A line is written with one
``write(2)`` on an O_APPEND descriptor and made durable before ``append`` returns, so
the runtime never acts on an event that a crash could lose; concurrent appenders share
one sync (group commit). Appends use ``fdatasync``: it flushes the data and the file
size, all a reader needs, and skips the timestamps (4x cheaper than ``fsync`` here).
A torn last line, as a crash leaves it, is ignored on read.
``state.json`` and ``runtime resume`` are both derived by ``fold``.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from .errors import FatalRunError, LedgerError
from .failures import FailureClass, NodeStatus, RunStatus
from .files import replace_atomically

LEDGER_SCHEMA_VERSION = 1
STATE_SCHEMA_VERSION = 1


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
    outcome: Literal["succeeded"] | FailureClass
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


class Ledger:
    """Appends events durably. Thread-safe; one instance per run directory."""

    def __init__(self, path: Path, *, after_append: Callable[[Event], None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = path
        raw = _read(path) if path.exists() else b""
        if raw and not raw.endswith(b"\n"):
            # A crash mid-write left an unterminated last line: it was never durable,
            # and appending after it would corrupt the next line, so it is cut first.
            raw = raw[: raw.rfind(b"\n") + 1]
            os.truncate(path, len(raw))
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.fsync(self._fd)  # the cut, or the new file, is durable before any append
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self._written = 0
        self._synced = 0
        self.events: list[Event] = parse_events(raw, path)
        self._next_seq = (self.events[-1].seq if self.events else 0) + 1
        self._after_append = after_append
        self._clock = clock

    def append(self, event: Event, *, sync: bool = True) -> Event:
        """Assign ``seq``, write the line, fsync it; return the event as written.

        ``sync=False`` leaves the fsync to the next synced append. Only for an event the
        runtime never acts on by itself: ``attempt.finished`` is always followed by a
        synced ``attempt.started``, ``node.succeeded`` or ``node.failed`` before anything
        happens because of it, and if a crash loses it the attempt folds as ``lost``.
        """
        with self._lock:
            stamped = event.model_copy(update={"seq": self._next_seq, "ts": self._clock()})
            self._write_line(stamped.model_dump_json().encode() + b"\n")
            self._next_seq += 1
            self.events.append(stamped)
            self._written += 1
            mine = self._written
        if not sync:
            return self._notify(stamped)
        with self._sync_lock:
            if self._synced < mine:  # another appender's sync may already cover us
                target = self._written
                try:
                    os.fdatasync(self._fd)
                except OSError as exc:
                    raise FatalRunError(self.path, f"cannot make the ledger durable: "
                                        f"{exc.strerror or exc}") from None
                self._synced = target
        return self._notify(stamped)

    def _write_line(self, line: bytes) -> None:
        """Write one whole line or nothing.

        A short write (disk full mid-line) is completed or cut back, so the next append
        never lands after half a line.
        """
        start = os.lseek(self._fd, 0, os.SEEK_END)
        done = 0
        try:
            while done < len(line):
                done += os.write(self._fd, line[done:])
        except OSError as exc:
            with contextlib.suppress(OSError):  # else cut when the ledger is next opened
                os.truncate(self.path, start)
            raise FatalRunError(self.path, f"cannot append to the ledger: "
                                f"{exc.strerror or exc}") from None

    def _notify(self, stamped: Event) -> Event:
        if self._after_append is not None:
            self._after_append(stamped)
        return stamped

    def close(self) -> None:
        """Sync and close the ledger, so that every append is on disk before the run reports."""
        os.fsync(self._fd)  # whatever an unsynced append left, before the run reports
        os.close(self._fd)


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
    outcome: Literal["succeeded"] | FailureClass | None = None
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
    return sum(1 for a in attempts if a.outcome is not None
               and (a.outcome == "succeeded" or FailureClass(a.outcome).is_charged()))


def consecutive_lost(attempts: Iterable[AttemptRecord]) -> int:
    """How many of the latest finished attempts were lost, in a row."""
    count = 0
    for a in reversed([a for a in attempts if a.outcome is not None]):
        if a.outcome != FailureClass.LOST:
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
        failed = [a for a in self.attempts if a.outcome not in (None, "succeeded")]
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
        match ev:
            case RunStarted():
                self.head = self.head or ev
                self.settings = ev.settings
                self.status = RunStatus.RUNNING
                self.finished = False
                if ev.retried:
                    self.used = 0  # the run budget applies to each try
                for nid in ev.retried:
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
            nodes={n: NodeState.model_validate(d) for n, d in self.nodes.items()},
        )


def fold(events: Iterable[Event], node_ids: Iterable[str]) -> RunState:
    """Replay events into a run state. Pure."""
    folder = Folder(node_ids)
    for ev in events:
        folder.apply(ev)
    return folder.state()


def write_state(path: Path, state: RunState) -> None:
    """Replace ``state.json`` atomically (write a sibling, then rename over)."""
    replace_atomically(path, (state.model_dump_json(indent=2) + "\n").encode())
