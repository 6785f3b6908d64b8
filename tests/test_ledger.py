from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from runtime.errors import LedgerError
from runtime.failures import FailureClass, NodeStatus, Outcome, RunStatus
from runtime.run.events import (
    EVENT_ADAPTER,
    AttemptFinished,
    AttemptStarted,
    Event,
    NodeFailed,
    NodeSkipped,
    NodeSucceeded,
    RunFinished,
    RunStarted,
    read_events,
)
from runtime.run.ledger import Ledger
from runtime.run.state import fold

EVENTS: list[Event] = [
    RunStarted(run_id="r", plan_digest="d" * 64, topology="t", settings={"jobs": 2}),
    AttemptStarted(node="a", attempt=1, profile="sim", trigger="initial",
                   prompt_digest="p" * 64),
    AttemptFinished(node="a", attempt=1, outcome=Outcome.AGENT_EXIT, exit_code=1,
                    error="boom", fingerprint="f" * 16, duration_s=0.5),
    AttemptStarted(node="a", attempt=2, profile="sim", trigger="retry", prior_attempt=1,
                   prompt_digest="q" * 64, preamble_digest="r" * 64),
    AttemptFinished(node="a", attempt=2, outcome=Outcome.SUCCEEDED, exit_code=0),
    NodeSucceeded(node="a", attempts=2),
    NodeFailed(node="b", failure=FailureClass.ARTIFACT_CONTRACT, reason="attempts exhausted"),
    NodeSkipped(node="c", failed_ancestor="b"),
    RunFinished(status=RunStatus.FAILED, counts={"failed": 1}),
]


@pytest.mark.parametrize("event", EVENTS, ids=[e.event + str(i) for i, e in enumerate(EVENTS)])
def test_each_event_round_trips(event: Event) -> None:
    line = event.model_dump_json()
    assert EVENT_ADAPTER.validate_json(line) == event
    assert json.loads(line)["schema_version"] == 1


def _write(tmp_path: Path, events: list[Event]) -> Path:
    ledger = Ledger(tmp_path / "ledger.jsonl", clock=lambda: 1.0)
    for e in events:
        ledger.append(e)
    ledger.close()
    return tmp_path / "ledger.jsonl"


def test_seq_is_monotonic_across_reopen(tmp_path: Path) -> None:
    path = _write(tmp_path, EVENTS[:3])
    _write(tmp_path, EVENTS[3:])
    assert [e.seq for e in read_events(path)] == list(range(1, len(EVENTS) + 1))


def test_torn_last_line_is_tolerated_and_cut_before_appending(tmp_path: Path) -> None:
    path = _write(tmp_path, EVENTS[:2])
    with path.open("ab") as fh:
        fh.write(b'{"schema_version":1,"seq":3,"event":"attempt.fin')
    assert len(read_events(path)) == 2
    _write(tmp_path, EVENTS[2:3])
    events = read_events(path)
    assert [e.event for e in events] == ["run.started", "attempt.started", "attempt.finished"]
    assert events[-1].seq == 3


@pytest.mark.parametrize(("line", "message"), [
    (b"garbage", "line 2: not JSON; the ledger is corrupt"),
    (b'{"event": "bogus"}', "line 2: not a ledger event"),
])
def test_a_bad_middle_line_is_an_error(tmp_path: Path, line: bytes, message: str) -> None:
    path = _write(tmp_path, EVENTS[:2])
    lines = path.read_bytes().split(b"\n")
    path.write_bytes(b"\n".join([lines[0], line, lines[1], b""]))
    with pytest.raises(LedgerError, match=message):
        read_events(path)


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    path.write_text(json.dumps({"schema_version": 2, "seq": 1, "event": "run.started"}) + "\n")
    with pytest.raises(LedgerError, match="schema_version 2 is newer than this runtime"):
        read_events(path)


def test_fold(tmp_path: Path) -> None:
    state = fold(read_events(_write(tmp_path, EVENTS)), ["a", "b", "c", "d"])
    assert state.status is RunStatus.FAILED
    assert state.attempts_used == 2
    a = state.nodes["a"]
    assert a.status is NodeStatus.SUCCEEDED
    assert a.charged == 2
    assert [r.outcome for r in a.attempts] == [FailureClass.AGENT_EXIT, "succeeded"]
    assert state.nodes["b"].reason == "attempts exhausted"
    assert state.nodes["c"].failed_ancestor == "b"
    assert state.nodes["d"].status is NodeStatus.PENDING


def test_fold_counts_lost_attempts_apart(tmp_path: Path) -> None:
    events: list[Event] = [EVENTS[0]]
    for n in (1, 2):
        events += [AttemptStarted(node="a", attempt=n, profile="s", trigger="initial",
                                  prompt_digest="p"),
                   AttemptFinished(node="a", attempt=n, outcome=Outcome.LOST)]
    events.append(AttemptStarted(node="a", attempt=3, profile="s", trigger="retry",
                                 prompt_digest="p"))
    state = fold(events, ["a"])
    a = state.nodes["a"]
    assert (a.charged, a.consecutive_lost, state.attempts_used) == (0, 2, 3)
    assert [r.attempt for r in a.unfinished()] == [3]
    assert a.status is NodeStatus.RUNNING


@pytest.mark.parametrize("cut", range(1, len(EVENTS)))
def test_incremental_fold_equals_full_fold(tmp_path: Path, cut: int) -> None:
    from runtime.run.state import Folder

    events = read_events(_write(tmp_path, EVENTS))
    folder = Folder(["a", "b", "c", "d"])
    for ev in events[:cut]:
        folder.apply(ev)
    folder.state()  # a snapshot in between must not disturb the fold
    for ev in events[cut:]:
        folder.apply(ev)
    assert folder.state() == fold(events, ["a", "b", "c", "d"])


# -- issue 9: a ledger an agent edited is refused, a short write leaves no half line ----

def _node_events() -> list[Event]:
    return [EVENTS[0],
            AttemptStarted(node="a", attempt=1, profile="sim", trigger="initial",
                           prompt_digest="p" * 64),
            AttemptFinished(node="a", attempt=1, outcome=Outcome.AGENT_EXIT)]


@pytest.mark.parametrize(("forged", "message"), [
    ([NodeSucceeded(node="a", attempts=1)], "node a has no succeeded attempt"),
    ([RunFinished(status=RunStatus.SUCCEEDED, counts={})],
     "run succeeded while some nodes did not"),
    ([AttemptStarted(node="zz", attempt=1, profile="s", trigger="initial", prompt_digest="p")],
     "node 'zz' is not in the plan"),
    ([AttemptStarted(node="a", attempt=1, profile="s", trigger="retry", prompt_digest="p")],
     "attempt 1 of a was already started"),
    ([AttemptFinished(node="a", attempt=7, outcome=Outcome.SUCCEEDED)],
     "attempt 7 of a was never started"),
    ([AttemptStarted(node="a", attempt=2, profile="s", trigger="retry", prompt_digest="p"),
      AttemptFinished(node="a", attempt=2, outcome=Outcome.SUCCEEDED),
      NodeSucceeded(node="a", attempts=2),
      AttemptStarted(node="a", attempt=3, profile="s", trigger="retry", prompt_digest="p")],
     "node a is already succeeded"),
    ([RunFinished(status=RunStatus.FAILED, counts={}),
      NodeFailed(node="a", failure=FailureClass.AGENT_EXIT, reason="x")],
     "after run.finished"),
], ids=["succeeded-without-attempt", "run-succeeded", "unknown-node", "restarted-attempt",
        "unstarted-attempt", "attempt-after-success", "after-run-finished"])
def test_a_forged_event_is_refused(tmp_path: Path, forged: list[Event], message: str) -> None:
    path = _write(tmp_path, _node_events() + forged)
    with pytest.raises(LedgerError, match=message):
        fold(read_events(path), ["a"])


@pytest.mark.parametrize(("line", "message"), [
    (b'{"schema_version":1,"seq":2,"event":"run.finished","status":"\xff"}', "not JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "not JSON"),
    (b'{"schema_version":1,"seq":1,"event":"run.finished","status":"failed","counts":{}}',
     "seq 1 does not follow 1"),
    (b'{"schema_version":1,"seq":5,"event":"run.finished","status":"failed","counts":{}}',
     "seq 5 does not follow 1"),
])
def test_a_hostile_middle_line_is_a_clear_error(tmp_path: Path, line: bytes,
                                                message: str) -> None:
    path = _write(tmp_path, EVENTS[:2])
    lines = path.read_bytes().split(b"\n")
    path.write_bytes(b"\n".join([lines[0], line, lines[1], b""]))
    with pytest.raises(LedgerError, match=message):
        read_events(path)


def test_a_short_write_is_cut_back_and_stops_the_run(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import os

    from runtime.errors import FatalRunError

    path = _write(tmp_path, EVENTS[:2])
    before = path.read_bytes()
    ledger = Ledger(path)
    real_write = os.write
    calls = []

    def disk_fills(fd: int, data: bytes) -> int:
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, data[: len(data) // 2])  # half a line fits
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", disk_fills)
    with pytest.raises(FatalRunError, match="cannot append to the ledger: No space left"):
        ledger.append(EVENTS[2])
    monkeypatch.undo()
    assert path.read_bytes() == before  # no half line for the next append to land after
    ledger.append(EVENTS[2])
    ledger.close()
    assert [e.seq for e in read_events(path)] == [1, 2, 3]


def test_one_sync_makes_a_round_of_unsynced_appends_durable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler appends a round of events unsynced, then syncs once before acting."""
    ledger = Ledger(tmp_path / "ledger.jsonl")
    synced_sizes: list[int] = []
    real = os.fdatasync

    def counting(fd: int) -> None:
        real(fd)
        synced_sizes.append(os.fstat(fd).st_size)

    monkeypatch.setattr("runtime.run.ledger.os.fdatasync", counting)
    for event in EVENTS[:4]:
        ledger.append(event, sync=False)
    assert synced_sizes == []
    ledger.sync()
    size = (tmp_path / "ledger.jsonl").stat().st_size
    assert synced_sizes == [size]  # one sync, covering every line appended before it
    ledger.sync()
    assert synced_sizes == [size]  # nothing new: no second sync
    ledger.append(EVENTS[4])
    assert len(synced_sizes) == 2
    ledger.close()
