"""Scheduler invariants over random DAGs, checked from the ledger (issue 12, item 4).

Each example is a random DAG (edges only from a lower to a higher index, so it is
acyclic), a per-node script of what each attempt does (succeed, fail with a non-zero
exit, fail the artifact contract, be lost under a dying worker), a per-node
``max_attempts``, a ``--jobs`` and sometimes a ``--max-total-attempts``. The run goes
through the real executor, scheduler, attempt and ledger; only the engine is scripted,
and it still runs the real ``python`` agents of ``tests.agent_scripts`` in process.
Everything asserted is read back from ``ledger.jsonl`` and folded with the runtime's
own read side (``load_run``).

The properties, besides an exact oracle of each node's fate:
- every node ends in exactly one terminal event;
- no node's first ``attempt.started`` comes before ``node.succeeded`` of every need;
- a skipped node never ran, and names a failed (or skipped-because-of-failed) ancestor,
  or the chain ends at a node the spent run budget kept from starting;
- the run succeeded iff every node did, and ``run.finished`` is the last event;
- charged attempts never exceed ``max_attempts``, nor all attempts the run budget.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.agents.base import AgentExit
from runtime.failures import FailureClass, NodeStatus, RunStatus
from runtime.plan.profiles import PythonProfile
from runtime.prompt.redact import Redactor
from runtime.run.engine import AgentOutcome, AgentRequest, LocalEngine, LocalSite
from runtime.run.events import (
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
from runtime.run.policy import LOST_STREAK_LIMIT
from runtime.run.read import load_run
from runtime.run.start import Hooks, resume_run
from runtime.run.state import RunState, charged_attempts
from tests.conftest import DEFAULT_TEMPLATE, Project, make_topology, run_topology

Step = Literal["ok", "exit", "contract", "lost"]
# What each scripted step runs: a real python agent, or (lost) no agent at all.
AGENT_FOR: dict[str, str] = {"ok": "write_all", "exit": "always_exit_2", "contract": "nothing"}
FAILS = {"exit": FailureClass.AGENT_EXIT, "contract": FailureClass.ARTIFACT_CONTRACT}
TERMINAL = (NodeSucceeded, NodeFailed, NodeSkipped)
PRIMARY, FALLBACKS = "primary", ("backup1", "backup2")


@dataclass(frozen=True)
class Script:
    """A node's attempts: ``steps[k]`` is attempt k+1, ``tail`` every later one."""

    steps: tuple[Step, ...]
    tail: Literal["ok", "exit"]
    max_attempts: int
    fallbacks: int = 0  # how many of FALLBACKS the node lists, one attempt each
    feedback: bool = False  # retry_feedback: a repeated failure ends the profile

    @property
    def profiles(self) -> tuple[str, ...]:
        return (PRIMARY, *FALLBACKS[:self.fallbacks])

    def step(self, attempt: int) -> Step:
        return self.steps[attempt - 1] if attempt <= len(self.steps) else self.tail


@dataclass(frozen=True)
class Case:
    n: int
    edges: frozenset[tuple[int, int]]
    scripts: tuple[Script, ...]
    jobs: int
    budget: int | None  # --max-total-attempts

    def needs(self, j: int) -> list[str]:
        return [_nid(i) for i in range(j) if (i, j) in self.edges]


def _nid(i: int) -> str:
    return f"n{i}"


class ScriptedEngine:
    """The local engine, with each attempt's agent chosen by the node's script: a lost
    step reports a dead worker (as the Ray engine does) without running anything."""

    name = "local"  # attempts run here, on the driver's workspace

    def __init__(self, scripts: dict[str, Script]) -> None:
        self.scripts = scripts
        self.local = LocalEngine()

    def run(self, request: AgentRequest, site: LocalSite) -> AgentOutcome:
        step = self.scripts[request.node].step(request.attempt)
        if step == "lost":
            return AgentOutcome(exit=AgentExit(), engine=self.name, host="h", worker="w",
                                started_at=0.0, finished_at=0.0,
                                lost="scripted: the worker died under the attempt")
        profile = PythonProfile(kind="python", target=f"tests.agent_scripts:{AGENT_FOR[step]}")
        return self.local.run(replace(request, profile=profile), site)


FAILURES: list[Step] = ["exit", "contract"]
LOST: Step = "lost"
STEPS: list[Step] = ["ok", "exit", "contract", LOST]
FAILURE = st.sampled_from(FAILURES)
# Mostly healthy nodes, so that small DAGs often succeed whole and failures stay local.
BEHAVIOUR = st.sampled_from(["ok", "ok", "ok", "fail", "flaky", "lost", "mixed"])


@st.composite
def scripts(draw: st.DrawFn) -> Script:
    """Succeed; fail always; fail the first k attempts; be lost k times; or any mix."""
    kind = draw(BEHAVIOUR)
    k = draw(st.integers(1, 4))
    steps: tuple[Step, ...] = ()
    tail: Literal["ok", "exit"] = "ok"
    if kind == "fail":
        steps, tail = tuple(draw(st.lists(FAILURE, max_size=2))), "exit"
    elif kind == "flaky":
        steps = tuple(draw(st.lists(FAILURE, min_size=k, max_size=k)))
    elif kind == "lost":
        steps = (LOST,) * k
    elif kind == "mixed":
        steps = tuple(draw(st.lists(st.sampled_from(STEPS), max_size=5)))
        tail = draw(st.sampled_from(["ok", "exit"]))
    return Script(steps, tail, draw(st.integers(1, 4)), fallbacks=draw(st.integers(0, 2)),
                  feedback=draw(st.booleans()))


@st.composite
def cases(draw: st.DrawFn) -> Case:
    n = draw(st.integers(1, 12))
    pairs = [(i, j) for j in range(n) for i in range(j)]
    # Sparse-ish (each edge 1 in 4): wide DAGs with parallel branches, and some chains.
    edges = frozenset(p for p in pairs if draw(st.booleans()) and draw(st.booleans()))
    return Case(n, edges, tuple(draw(scripts()) for _ in range(n)), draw(st.integers(1, 3)),
                draw(st.one_of(st.none(), st.none(), st.integers(1, 8))))


@dataclass(frozen=True)
class Fate:
    status: NodeStatus
    failure: FailureClass | None
    profiles: tuple[str, ...]  # the profile of each attempt, in order


def expected_fate(script: Script) -> Fate:
    """What a node whose needs all succeeded does. A lost attempt is retried uncharged
    until LOST_STREAK_LIMIT in a row. A failure (both scripted classes are in the default
    retry_on) is retried on the same profile until its allowance is charged (max_attempts
    on the primary, one on each fallback) or, with retry_feedback, until the same failure
    repeats; then the next fallback takes over, and past the last one the node fails."""
    index, lost, used = 0, 0, []
    on_profile: list[Step] = []  # charged failures on the current profile
    while True:
        used.append(script.profiles[index])
        step = script.step(len(used))
        if step == "ok":
            return Fate(NodeStatus.SUCCEEDED, None, tuple(used))
        if step == "lost":
            lost += 1
            if lost >= LOST_STREAK_LIMIT:
                return Fate(NodeStatus.FAILED, FailureClass.LOST, tuple(used))
            continue
        lost = 0
        on_profile.append(step)
        allowance = script.max_attempts if index == 0 else 1
        repeated = script.feedback and on_profile[-2:] == [step, step]
        if repeated or len(on_profile) >= allowance:
            index, on_profile = index + 1, []
            if index == len(script.profiles):
                return Fate(NodeStatus.FAILED, FAILS[step], tuple(used))


def _topology(case: Case) -> dict[str, Any]:
    topo = make_topology({_nid(j): case.needs(j) for j in range(case.n)})
    for node, script in zip(topo["nodes"], case.scripts, strict=True):
        node.update(max_attempts=script.max_attempts, retry_feedback=script.feedback,
                    fallback=list(script.profiles[1:]))
    # The engine picks each attempt's agent from the script; the profiles only differ
    # in name, which is what fallback is about.
    topo["agents"] = {p: {"kind": "python", "target": "tests.agent_scripts:write_all"}
                      for p in (PRIMARY, *FALLBACKS)}
    topo["defaults"] = {"agent": PRIMARY}
    return topo


def _engine(case: Case) -> ScriptedEngine:
    return ScriptedEngine({_nid(j): s for j, s in enumerate(case.scripts)})


def _dag(case: Case) -> nx.DiGraph[str]:
    dag: nx.DiGraph[str] = nx.DiGraph()
    dag.add_nodes_from(_nid(j) for j in range(case.n))
    dag.add_edges_from((_nid(i), _nid(j)) for i, j in case.edges)
    return dag


def _read_back(run_dir: Path) -> tuple[list[Event], RunState]:
    """The ledger, and its fold by the runtime's read side."""
    events = read_events(run_dir / "ledger.jsonl")
    _, state = load_run(run_dir)
    return events, state


@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_scheduler_invariants_hold_on_random_dags(case: Case) -> None:
    with tempfile.TemporaryDirectory(prefix="props-") as tmp:
        project = Project(Path(tmp))
        project.template("task.md.j2", DEFAULT_TEMPLATE)
        result = run_topology(project, _topology(case), jobs=case.jobs,
                              max_total_attempts=case.budget, hooks=Hooks(engine=_engine(case)))
        events, state = _read_back(result.run_dir)
    assert result.state == state  # what the run returned is what its ledger folds to
    assert sum(isinstance(e, RunStarted) for e in events) == 1
    check_invariants(case, events, state)
    # Uninterrupted, each node that ran did exactly what its script and max_attempts say
    # (unless the run budget refused an attempt: then it stopped early).
    if case.budget is not None and state.attempts_used >= case.budget:
        return
    dag = _dag(case)
    for j, script in enumerate(case.scripts):
        node = state.nodes[_nid(j)]
        if node.status is NodeStatus.SKIPPED:
            continue
        fate = expected_fate(script)
        assert (node.status, node.failure) == (fate.status, fate.failure)
        assert tuple(a.profile for a in node.attempts) == fate.profiles
        assert [a.outcome for a in node.attempts] == [
            _outcome(script.step(a.attempt)) for a in node.attempts]
        assert all(state.nodes[u].status is NodeStatus.SUCCEEDED for u in dag.pred[_nid(j)])


@settings(max_examples=15, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.floats(0, 1, exclude_max=True), st.booleans())
def test_invariants_hold_after_a_crash_anywhere_and_a_resume(
        case: Case, where: float, torn: bool) -> None:
    """The same run cut back to a random durable prefix of its ledger (optionally with
    half of the next line, as a crash mid-write leaves it), then resumed."""
    with tempfile.TemporaryDirectory(prefix="props-") as tmp:
        project = Project(Path(tmp))
        project.template("task.md.j2", DEFAULT_TEMPLATE)
        result = run_topology(project, _topology(case), jobs=case.jobs,
                              max_total_attempts=case.budget, hooks=Hooks(engine=_engine(case)))
        ledger = result.run_dir / "ledger.jsonl"
        lines = ledger.read_bytes().splitlines(keepends=True)
        k = 1 + int(where * (len(lines) - 1))  # keep run.started, lose run.finished
        os.chmod(ledger, 0o644)
        ledger.write_bytes(b"".join(lines[:k]) + (lines[k][: len(lines[k]) // 2] if torn
                                                   else b""))
        resumed = resume_run(result.run_dir, redactor=Redactor.from_environment({}),
                             hooks=Hooks(engine=_engine(case)))
        events, state = _read_back(result.run_dir)
    assert resumed.state == state
    assert sum(isinstance(e, RunStarted) for e in events) == 2
    check_invariants(case, events, state)


def check_invariants(case: Case, events: list[Event], state: RunState) -> None:
    """What any finished run's ledger must show, however many times it was resumed."""
    nodes = [_nid(j) for j in range(case.n)]
    dag = _dag(case)
    # run.started first, one run.finished and it is last, seq 1, 2, 3, ...
    assert isinstance(events[0], RunStarted)
    assert isinstance(events[-1], RunFinished)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert sum(isinstance(e, RunFinished) for e in events) == 1

    terminal: dict[str, list[Event]] = {n: [] for n in nodes}
    first_start: dict[str, int] = {}
    for e in events:
        if isinstance(e, TERMINAL):
            terminal[e.node].append(e)
        if isinstance(e, AttemptStarted):
            first_start.setdefault(e.node, e.seq)
    succeeded_at = {n: t[0].seq for n, t in terminal.items()
                    if t and isinstance(t[0], NodeSucceeded)}

    for j, nid in enumerate(nodes):
        assert len(terminal[nid]) == 1, f"{nid}: terminal events {terminal[nid]}"
        end = terminal[nid][0]
        node = state.nodes[nid]
        assert node.status.is_terminal()
        assert node.status.value == end.event.split(".")[1]
        assert all(a.outcome is not None for a in node.attempts)  # none left unfinished
        script = case.scripts[j]
        for profile, allowance in zip(script.profiles, (script.max_attempts, 1, 1),
                                      strict=False):
            on_profile = [a for a in node.attempts if a.profile == profile]
            assert charged_attempts(on_profile) <= allowance, f"{nid} on {profile}"
        assert {a.profile for a in node.attempts} <= set(script.profiles)
        if nid in first_start:
            for need in dag.pred[nid]:
                assert need in succeeded_at, (
                    f"{nid} started at seq {first_start[nid]} before its need {need} "
                    "succeeded")
                assert succeeded_at[need] < first_start[nid], (
                    f"{nid} started at seq {first_start[nid]} before its need {need} "
                    "succeeded")
            assert first_start[nid] < end.seq
        if isinstance(end, NodeSkipped):
            assert not node.attempts
            assert nid not in first_start
            _assert_blocked(nid, end, state, case)
        if isinstance(end, NodeSucceeded):
            last = node.attempts[-1]
            assert last.outcome == "succeeded"
            assert end.artifacts == last.artifacts

    all_ok = all(n.status is NodeStatus.SUCCEEDED for n in state.nodes.values())
    final = events[-1]
    assert isinstance(final, RunFinished)
    assert final.status is (RunStatus.SUCCEEDED if all_ok else RunStatus.FAILED)
    assert state.status is final.status
    started = [(e.node, e.attempt) for e in events if isinstance(e, AttemptStarted)]
    finished = [(e.node, e.attempt) for e in events if isinstance(e, AttemptFinished)]
    assert sorted(started) == sorted(finished)
    assert len(set(started)) == len(started)
    assert len(started) == state.attempts_used
    assert case.budget is None or state.attempts_used <= case.budget


def _outcome(step: Step) -> str:
    return "succeeded" if step == "ok" else FAILS.get(step, FailureClass.LOST)


def _assert_blocked(nid: str, end: NodeSkipped, state: RunState, case: Case) -> None:
    """The skip names an ancestor that failed, or one that was itself skipped because of
    a failed ancestor of its own (followed to the failure). Under a run budget the chain
    may end instead at a node the spent budget kept from starting: its reason says so."""
    ancestors = nx.ancestors(_dag(case), nid)
    seen = {nid}
    blocker, reason = end.failed_ancestor, end.reason
    while blocker is not None:
        assert blocker in ancestors, f"{nid}: {blocker} is not its ancestor"
        assert blocker not in seen
        seen.add(blocker)
        up = state.nodes[blocker]
        if up.status is NodeStatus.FAILED:
            return
        assert up.status is NodeStatus.SKIPPED, f"{nid}: blocker {blocker} is {up.status}"
        blocker, reason = up.failed_ancestor, up.reason or ""
    assert case.budget is not None, (
        f"{nid}: skipped without a failed ancestor, reason {reason!r}")
    assert reason.startswith(f"run attempt budget exhausted ({case.budget} attempts)"), (
        f"{nid}: skipped without a failed ancestor, reason {reason!r}")


@pytest.mark.parametrize(("script", "fate"), [
    (Script(("lost", "lost", "ok"), "exit", 1),
     Fate(NodeStatus.SUCCEEDED, None, ("primary",) * 3)),
    (Script(("lost",) * 3, "ok", 4), Fate(NodeStatus.FAILED, FailureClass.LOST, ("primary",) * 3)),
    (Script(("exit", "lost", "contract"), "ok", 2),
     Fate(NodeStatus.FAILED, FailureClass.ARTIFACT_CONTRACT, ("primary",) * 3)),
    (Script((), "exit", 3), Fate(NodeStatus.FAILED, FailureClass.AGENT_EXIT, ("primary",) * 3)),
    (Script(("exit",), "ok", 1, fallbacks=1),
     Fate(NodeStatus.SUCCEEDED, None, ("primary", "backup1"))),
    (Script(("exit", "exit", "exit"), "ok", 4, fallbacks=2, feedback=True),
     Fate(NodeStatus.SUCCEEDED, None, ("primary", "primary", "backup1", "backup2"))),
    (Script(("exit", "contract", "exit"), "ok", 3, feedback=True),
     Fate(NodeStatus.FAILED, FailureClass.AGENT_EXIT, ("primary",) * 3)),
    (Script(("exit", "lost", "lost", "exit"), "ok", 1, fallbacks=1),
     Fate(NodeStatus.FAILED, FailureClass.AGENT_EXIT, ("primary", "backup1", "backup1",
                                                       "backup1"))),
], ids=["lost-uncharged", "lost-streak", "charged-only", "fail-always", "fallback",
        "feedback-repeat-ends-profile", "feedback-no-repeat", "lost-on-fallback"])
def test_the_oracle(script: Script, fate: Fate) -> None:
    """The model the property compares against, on cases worked out by hand."""
    assert expected_fate(script) == fate
