"""A crash at any point is resumable: nothing lost, nothing counted twice."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from runtime.failures import FailureClass, Outcome, RunStatus
from runtime.prompt.redact import Redactor
from runtime.run.events import AttemptFinished, AttemptStarted, Event, NodeSucceeded, read_events
from runtime.run.start import resume_run
from tests.conftest import REPO, Project, make_topology, python_agents, run_topology


def _topology() -> dict[str, Any]:
    topo = make_topology({"a": [], "b": ["a"], "c": ["a"], "d": ["b", "c"]},
                         b={"agent": "fail_first"})
    topo["agents"] = python_agents("write_all", "fail_first")
    topo["defaults"] = {"agent": "write_all", "max_attempts": 3}
    return topo


def _check_invariants(run_dir: Path) -> None:
    events = read_events(run_dir / "ledger.jsonl")
    started = [(e.node, e.attempt) for e in events if isinstance(e, AttemptStarted)]
    finished = [(e.node, e.attempt) for e in events if isinstance(e, AttemptFinished)]
    assert len(started) == len(set(started)), "an attempt number was reused"
    assert Counter(started) == Counter(finished), "an attempt has no terminal record"
    succeeded = [e.node for e in events if isinstance(e, NodeSucceeded)]
    assert len(succeeded) == len(set(succeeded)), "a node succeeded twice"
    done_at = {e.node: e.seq for e in events if isinstance(e, NodeSucceeded)}
    for e in events:
        if isinstance(e, AttemptStarted) and e.node in done_at:
            assert e.seq < done_at[e.node], f"{e.node} ran again after it succeeded"
    assert [e.seq for e in events] == list(range(1, len(events) + 1))


@pytest.fixture(scope="module")
def completed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    project = Project(tmp_path_factory.mktemp("crash") / "proj")
    project.root.mkdir()
    project.template("task.md.j2", "Task for {{ node.id }}.\n")
    result = run_topology(project, _topology(), jobs=2)
    assert result.status is RunStatus.SUCCEEDED
    return result.run_dir


def _event_count(run_dir: Path) -> int:
    return len((run_dir / "ledger.jsonl").read_bytes().splitlines())


@pytest.mark.parametrize("torn", [False, True], ids=["clean-cut", "torn-line"])
def test_crash_at_every_ledger_position_resumes(completed_run: Path, tmp_path: Path,
                                                torn: bool) -> None:
    lines = (completed_run / "ledger.jsonl").read_bytes().splitlines(keepends=True)
    for k in range(1, len(lines)):
        run_dir = tmp_path / f"crash-{k}"
        shutil.copytree(completed_run, run_dir)
        # The files of later steps stay, as they would after a real crash; only the
        # ledger (the source of truth) is cut back to the first k durable events.
        prefix = b"".join(lines[:k]) + (lines[k][: len(lines[k]) // 2] if torn else b"")
        os.chmod(run_dir / "ledger.jsonl", 0o644)
        (run_dir / "ledger.jsonl").write_bytes(prefix)
        before = read_events(run_dir / "ledger.jsonl")
        unfinished = {(e.node, e.attempt) for e in before if isinstance(e, AttemptStarted)} - {
            (e.node, e.attempt) for e in before if isinstance(e, AttemptFinished)}
        result = resume_run(run_dir, redactor=Redactor())
        assert result.status is RunStatus.SUCCEEDED, f"crash after event {k}"
        _check_invariants(run_dir)
        events = read_events(run_dir / "ledger.jsonl")
        lost = {(e.node, e.attempt) for e in events
                if isinstance(e, AttemptFinished) and e.outcome == Outcome.LOST}
        assert lost == unfinished, f"crash after event {k}"
        assert json.loads((run_dir / "state.json").read_text())["status"] == "succeeded"


def test_resume_of_a_finished_run_changes_nothing(completed_run: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "done"
    shutil.copytree(completed_run, run_dir)
    before = (run_dir / "ledger.jsonl").read_bytes()
    assert resume_run(run_dir).status is RunStatus.SUCCEEDED
    assert (run_dir / "ledger.jsonl").read_bytes() == before


class _Crash(BaseException):
    """Stands for the process dying right after an event became durable."""


def _crash_after_attempt_started(event: Event) -> None:
    if isinstance(event, AttemptStarted):
        raise _Crash


def _crashed_single_node_run(tmp_path: Path, **settings: Any) -> Path:
    """A one-node run whose process 'died' right after its first attempt started."""
    from runtime.run.start import Hooks

    project = Project(tmp_path / "proj")
    project.root.mkdir()
    project.template("task.md.j2", "Task.\n")
    topo = make_topology({"a": []})
    topo["agents"] = python_agents("write_all")
    topo["defaults"] = {"agent": "write_all", "max_attempts": 1}
    with pytest.raises(_Crash):
        run_topology(project, topo, hooks=Hooks(after_append=_crash_after_attempt_started),
                     **settings)
    return project.artifacts / "runs" / "test-run"


def test_lost_attempts_are_not_charged_but_three_in_a_row_fail(tmp_path: Path) -> None:
    from runtime.run.start import Hooks

    run_dir = _crashed_single_node_run(tmp_path)
    for _ in range(2):
        with pytest.raises(_Crash):
            resume_run(run_dir, hooks=Hooks(after_append=_crash_after_attempt_started))
    result = resume_run(run_dir)
    node = result.state.nodes["a"]
    assert [a.outcome for a in node.attempts] == [Outcome.LOST] * 3
    assert node.reason == "lost 3 times in a row"
    assert result.state.attempts_used == 3  # charged to the run, not to max_attempts


def test_one_lost_attempt_is_retried_without_charge(tmp_path: Path) -> None:
    from runtime.run.records import AttemptContext

    run_dir = _crashed_single_node_run(tmp_path)
    result = resume_run(run_dir)
    assert result.status is RunStatus.SUCCEEDED
    assert [a.outcome for a in result.state.nodes["a"].attempts] == [FailureClass.LOST,
                                                                     "succeeded"]
    # Attempt 2 of 2, not "2 of 1": the lost attempt was not charged (max_attempts 1).
    second = run_dir / "nodes" / "a" / "attempts" / "2" / "attempt.json"
    assert AttemptContext.model_validate_json(second.read_bytes()).max_attempts == 2


def _gated(blocked: str, release: Path) -> dict[str, Any]:
    """An agent profile that blocks node ``blocked`` (a marker file ``started`` in its
    workspace says it runs) until ``release`` exists: a signal sent after the marker
    appears always finds the agent running, however loaded the machine (no sleep window).
    Unsandboxed, so the agent sees ``release`` under the test's tmp_path."""
    script = (f'if [ "$RUNTIME_NODE" = {blocked} ]; then touch started; '
              f'while [ ! -e {release} ]; do sleep 0.01; done; fi; '
              'printf "{}" > "$RUNTIME_NODE.json"')
    return {"kind": "command", "sandbox": False, "argv": ["sh", "-c", script]}


def _wait_for_file(path: Path) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def _run_in_background(project: Project, run_id: str) -> subprocess.Popen[str]:
    """``runtime run`` of the project's topology as its own process (stderr piped)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "runtime", *project.cli("run", str(project.topology), "--run-id",
                                                        run_id)],
        cwd=project.root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True)


@pytest.mark.slow
def test_sigkill_of_a_real_run_then_resume(tmp_path: Path) -> None:
    project = Project(tmp_path / "proj")
    project.root.mkdir()
    project.template("task.md.j2", "Task for {{ node.id }}.\n")
    topo = make_topology({"a": [], "b": ["a"], "c": ["b"]})
    release = tmp_path / "release"
    topo["agents"] = {"slow": _gated("b", release)}
    topo["defaults"] = {"agent": "slow"}
    project.write_topology(topo)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "runtime", *project.cli("run", str(project.topology),
                                                          "--run-id", "killed")]
    proc = subprocess.Popen(cmd, cwd=project.root, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_file(project.artifacts / "runs" / "killed" / "nodes" / "b" / "workspace"
                   / "started")  # node b's agent runs, blocked: kill now
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    release.touch()
    resumed = subprocess.run(
        [sys.executable, "-m", "runtime", *project.cli("resume", "killed", "--json")],
        cwd=project.root, env=env, capture_output=True, text=True, check=False, timeout=60)
    assert resumed.returncode == 0, resumed.stderr
    out = json.loads(resumed.stdout)
    assert out["status"] == "succeeded"
    assert out["nodes"]["a"]["attempts"] == 1  # never re-run
    run_dir = project.artifacts / "runs" / "killed"
    _check_invariants(run_dir)
    events = read_events(run_dir / "ledger.jsonl")
    lost = [e for e in events if isinstance(e, AttemptFinished) and e.outcome == "lost"]
    assert [(e.node, e.attempt) for e in lost] == [("b", 1)]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupt_cancels_cleanly_and_resume_finishes(tmp_path: Path, sig: int) -> None:
    project = Project(tmp_path / "proj")
    project.root.mkdir()
    project.template("task.md.j2", "Task for {{ node.id }}.\n")
    topo = make_topology({"a": [], "b": ["a"]})
    release = tmp_path / "release"
    topo["agents"] = {"slow": _gated("a", release)}
    topo["defaults"] = {"agent": "slow"}
    project.write_topology(topo)
    proc = _run_in_background(project, "int")
    ledger = project.artifacts / "runs" / "int" / "ledger.jsonl"
    _wait_for_file(project.artifacts / "runs" / "int" / "nodes" / "a" / "workspace" / "started")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert "a: attempt 1 started on slow" in err  # one line per event, as it happens
    assert "interrupted; the run is resumable: runtime resume int --artifacts" in err
    events = read_events(ledger)
    assert [(e.node, e.outcome) for e in events if isinstance(e, AttemptFinished)] == \
        [("a", Outcome.CANCELLED)]
    assert events[-1].event == "run.finished"
    assert events[-1].status == "cancelled"
    release.touch()
    result = resume_run(project.artifacts / "runs" / "int")
    assert result.status is RunStatus.SUCCEEDED
    a = result.state.nodes["a"]
    assert [x.outcome for x in a.attempts] == [FailureClass.CANCELLED, "succeeded"]
    _check_invariants(project.artifacts / "runs" / "int")


@pytest.mark.slow
def test_an_interrupted_batch_says_how_to_resume_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: exit 130 with no hint, and `runtime resume BATCH` said 'not a run
    directory'. The printed command, run as printed, resumes the batch."""
    project = Project(tmp_path / "proj")
    project.root.mkdir()
    project.template("task.md.j2", "Task for {{ node.id }}.\n")
    topo = make_topology({"a": []})
    release = tmp_path / "release"
    topo["agents"] = {"slow": _gated("a", release)}
    topo["defaults"] = {"agent": "slow"}
    project.write_topology(topo)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "runtime", *project.cli("batch", str(project.topology),
                                                        "--batch-id", "b5", "--no-progress")],
        cwd=project.root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True)
    _wait_for_file(project.artifacts / "runs")
    started = next((project.artifacts / "runs").glob("*/nodes/a/workspace"), None)
    deadline = time.monotonic() + 60
    while started is None or not (started / "started").exists():
        assert time.monotonic() < deadline, "the batch's agent never started"
        time.sleep(0.01)
        started = next((project.artifacts / "runs").glob("*/nodes/a/workspace"), None)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    printed = next(line for line in err.splitlines() if "the batch is resumable" in line)
    assert printed == (f"interrupted; the batch is resumable: cd {project.root} && runtime "
                       f"batch {project.topology} --batch-id b5 --no-progress --prompts "
                       f"{project.prompts} --artifacts {project.artifacts}")
    from runtime.cli import main

    release.touch()
    assert main(project.cli("resume", "b5")) == 2
    assert "b5 is a batch, not a run: `runtime batch PATH... --batch-id b5`" in \
        capsys.readouterr().err
    where, command = printed.split("resumable: cd ", 1)[1].split(" && ", 1)
    monkeypatch.chdir(where)
    assert main(shlex.split(command)[1:]) == 0


def test_resume_can_extend_the_deadline(tmp_path: Path) -> None:
    import time as _time

    run_dir = _crashed_single_node_run(tmp_path)
    ledger = run_dir / "ledger.jsonl"
    first = json.loads(ledger.read_text().splitlines()[0])
    assert first["settings"]["deadline_at"] is None
    deadline = _time.time() + 600
    result = resume_run(run_dir, deadline_at=deadline)
    assert result.status is RunStatus.SUCCEEDED
    resumed = [json.loads(line) for line in ledger.read_text().splitlines()
               if '"run.started"' in line][-1]
    assert resumed["resumed"] is True
    assert resumed["settings"]["deadline_at"] == deadline


def test_resume_refuses_a_run_whose_plan_was_edited(tmp_path: Path) -> None:
    from runtime.errors import PlanIntegrityError

    run_dir = _crashed_single_node_run(tmp_path)
    manifest = run_dir / "plan.json"
    os.chmod(manifest, 0o644)
    manifest.write_bytes(manifest.read_bytes().replace(b'"max_attempts":1', b'"max_attempts":9'))
    with pytest.raises(PlanIntegrityError, match="the run started with"):
        resume_run(run_dir)


# -- issue 9: one writer per run; a start that crashes leaves a whole run or none -------

@pytest.mark.parametrize("alias", ["same path", "symlink to the run", "symlinked parent"])
def test_a_run_in_use_is_refused_with_the_holders_pid(tmp_path: Path, alias: str) -> None:
    """Whatever path reaches the run (before: a symlink to it took a second lock, and two
    writers interleaved the ledger for good)."""
    from runtime.errors import InUseError
    from runtime.run.lock import hold

    run_dir = _crashed_single_node_run(tmp_path)
    from runtime.cli import main

    other = run_dir
    if alias == "symlink to the run":
        other = tmp_path / "alias"
        other.symlink_to(run_dir)
    elif alias == "symlinked parent":
        (tmp_path / "runs-link").symlink_to(run_dir.parent)
        other = tmp_path / "runs-link" / run_dir.name
    with hold(run_dir, "run test-run"):
        with pytest.raises(InUseError) as info:
            resume_run(other)
        assert main(["resume", str(other)]) == 2
    assert f"run {other.name} is in use by pid {os.getpid()}" in str(info.value)
    assert resume_run(run_dir).status is RunStatus.SUCCEEDED  # released with its holder


def test_two_resumes_at_once_run_each_node_once(tmp_path: Path) -> None:
    """The second `runtime resume` of a live run exits 2 naming the first's pid; nothing
    runs twice (before: two node.succeeded and duplicate seq values)."""
    run_dir = _crashed_single_node_run(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "runtime", "resume", str(run_dir), "--json"]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.returncode, err) for p in procs
               for _, err in [p.communicate(timeout=60)]]
    codes = sorted(code for code, _ in results)
    assert codes in ([0, 0], [0, 2])  # the second either finds the run done or in use
    if codes == [0, 2]:
        assert any("is in use by pid" in err for code, err in results if code == 2), results
    events = read_events(run_dir / "ledger.jsonl")
    assert len([e for e in events if e.event == "node.succeeded"]) == 1
    seqs = [e.seq for e in events]
    assert seqs == sorted(set(seqs))


def test_a_start_that_crashed_before_the_rename_leaves_no_run(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              ) -> None:
    """The run directory appears with run.started already in its ledger, or not at all;
    the staging directory of the crashed start is removed by the next start."""
    project = Project(tmp_path / "proj")
    project.root.mkdir()
    project.template("task.md.j2", "Task.\n")
    topo = make_topology({"a": []})
    topo["agents"] = python_agents("write_all")
    topo["defaults"] = {"agent": "write_all"}

    real_rename = os.rename

    def crash(src: str, dst: str) -> None:
        if Path(dst).name == "test-run":  # the run directory's own rename
            raise _Crash()
        real_rename(src, dst)

    # runtime.run renames the staging directory with os.rename (the same module object).
    monkeypatch.setattr(os, "rename", crash)
    with pytest.raises(_Crash):
        run_topology(project, topo)
    monkeypatch.undo()
    runs = project.artifacts / "runs"
    assert not (runs / "test-run").exists()
    assert (runs / ".test-run.tmp").is_dir()
    result = run_topology(project, topo)
    assert result.status is RunStatus.SUCCEEDED
    assert not (runs / ".test-run.tmp").exists()
    assert read_events(runs / "test-run" / "ledger.jsonl")[0].event == "run.started"


def test_resume_keeps_the_operator_prompt_and_refuses_an_edited_one(tmp_path: Path) -> None:
    """The ledger records only the operator prompt's digest; the text is kept in the run
    directory, so attempts after a resume get the same trusted text."""
    from runtime.errors import PlanIntegrityError

    run_dir = _crashed_single_node_run(tmp_path,
                                       operator_prompt="Scope: staging only. Token tk-123.")
    ledger = (run_dir / "ledger.jsonl").read_text()
    assert "tk-123" not in ledger
    assert "operator_prompt_digest" in ledger
    edited = run_dir / "operator-prompt.md"
    original = edited.read_bytes()
    edited.chmod(0o644)
    edited.write_text("Scope: everything.")
    with pytest.raises(PlanIntegrityError, match=r"operator-prompt\.md hashes to"):
        resume_run(run_dir)
    edited.write_bytes(original)
    assert resume_run(run_dir).status is RunStatus.SUCCEEDED
    prompt = (run_dir / "nodes" / "a" / "attempts" / "2" / "prompt.md").read_text()
    assert "Scope: staging only. Token tk-123." in prompt


def test_resume_of_a_finished_run_refreshes_a_stale_state_json(tmp_path: Path) -> None:
    run_dir = _crashed_single_node_run(tmp_path)
    resume_run(run_dir)
    state = run_dir / "state.json"
    stale = json.loads(state.read_text())
    stale["status"] = "running"
    state.write_text(json.dumps(stale))
    assert resume_run(run_dir).status is RunStatus.SUCCEEDED
    assert json.loads(state.read_text())["status"] == "succeeded"


def test_a_link_planted_as_the_run_lock_is_refused(tmp_path: Path) -> None:
    """The lock is opened without following links: a planted symlink is a clear error,
    not a traceback and not a write through the link."""
    from runtime.errors import UsageError
    from runtime.run.lock import lock_path

    run_dir = _crashed_single_node_run(tmp_path)
    target = tmp_path / "victim"
    target.write_text("keep\n")
    lock = lock_path(run_dir)
    lock.unlink()
    lock.symlink_to(target)
    with pytest.raises(UsageError, match=r"cannot open the lock of run test-run"):
        resume_run(run_dir)
    assert target.read_text() == "keep\n"


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_and_the_run_stays_resumable(tmp_path: Path) -> None:
    """The first Ctrl-C winds down (SIGTERM, a grace, SIGKILL); a second does not wait."""
    project = Project(tmp_path / "proj")
    project.root.mkdir()
    project.template("task.md.j2", "Task for {{ node.id }}.\n")
    topo = make_topology({"a": []})
    release = tmp_path / "release"
    # Survives SIGTERM (it notes it and goes on), so a graceful cancel would wait the grace.
    script = (f"trap 'touch got-term' TERM; echo $$ > pid; touch started; "
              f"while [ ! -e {release} ]; do sleep 0.01; done; printf '{{}}' > a.json")
    topo["agents"] = {"stubborn": {"kind": "command", "sandbox": False,
                                   "argv": ["sh", "-c", script]}}
    topo["defaults"] = {"agent": "stubborn"}
    project.write_topology(topo)
    proc = _run_in_background(project, "twice")
    ws = project.artifacts / "runs" / "twice" / "nodes" / "a" / "workspace"
    _wait_for_file(ws / "started")
    pid = int((ws / "pid").read_text())
    proc.send_signal(signal.SIGINT)
    _wait_for_file(ws / "got-term")  # the first Ctrl-C is being acted on
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    events = read_events(project.artifacts / "runs" / "twice" / "ledger.jsonl")
    assert events[-1].event != "run.finished", err  # stopped, not wound down
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the agent did not outlive the runtime
    release.touch()
    result = resume_run(project.artifacts / "runs" / "twice")
    assert result.status is RunStatus.SUCCEEDED
    assert [x.outcome for x in result.state.nodes["a"].attempts] == [Outcome.LOST,
                                                                     Outcome.SUCCEEDED]


def test_an_agent_started_but_not_yet_taken_in_does_not_outlive_an_abrupt_stop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node's step starts its agent; if the loop stops (a second Ctrl-C) before it takes
    the agent in, the agent is still killed on the way out."""
    from concurrent.futures import Future

    from runtime.run import scheduler

    project = Project(tmp_path / "proj")
    project.root.mkdir()
    project.template("task.md.j2", "Task for {{ node.id }}.\n")
    topo = make_topology({"a": []})
    topo["agents"] = {"slow": {"kind": "command", "sandbox": False,
                               "argv": ["sh", "-c", "sleep 60"]}}
    topo["defaults"] = {"agent": "slow"}
    apply = scheduler.Scheduler._apply_step

    def stop_before_taking_it_in(self: scheduler.Scheduler, nid: str, step: Any) -> None:
        if isinstance(step, scheduler._Flight) and step.started is not None:
            done: Future[Any] = Future()
            done.set_result(step)
            self._steps_done.put((nid, done))  # still waiting for the loop
            raise KeyboardInterrupt  # what a second Ctrl-C raises in the loop
        apply(self, nid, step)

    monkeypatch.setattr(scheduler.Scheduler, "_apply_step", stop_before_taking_it_in)
    with pytest.raises(KeyboardInterrupt):
        run_topology(project, topo)
    leaders = project.artifacts / "runs" / "test-run" / "leaders.jsonl"
    pid = json.loads(leaders.read_text().splitlines()[0])["pid"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return  # killed (and reaped) on the way out
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    pytest.fail(f"agent {pid} outlived the scheduler")
