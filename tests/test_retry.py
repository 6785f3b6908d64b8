"""`runtime retry`: failed and skipped nodes re-run in place, succeeded ones untouched."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.batch import run_batch
from runtime.cli import main
from runtime.failures import FailureClass, NodeStatus, RunStatus
from runtime.report.html import render_run_report
from runtime.run.events import RunStarted, read_events
from runtime.run.records import AttemptContext
from runtime.run.start import RetryRequest, retry_run
from runtime.run.summary import BatchSummary
from tests.conftest import Project, make_topology, python_agents, run_topology
from tests.test_batch import _options, batch_project  # noqa: F401 - a fixture


def _failed_run(project: Project) -> Path:
    topo = make_topology({"a": [], "b": ["a"], "c": []}, a={"max_attempts": 1})
    topo["agents"] = python_agents("write_all", "always_exit_2")
    topo["defaults"] = {"agent": "write_all"}
    topo["nodes"][0]["agent"] = "always_exit_2"
    result = run_topology(project, topo)
    assert result.status is RunStatus.FAILED
    assert result.state.nodes["b"].status is NodeStatus.SKIPPED
    return Path(result.run_dir)


def test_retry_reruns_failed_and_skipped_nodes_only(project: Project) -> None:
    run_dir = _failed_run(project)
    c_artifact = run_dir / "nodes" / "c" / "workspace" / "c.json"
    c_before = (c_artifact.read_bytes(), c_artifact.stat().st_mtime_ns)
    result = retry_run(run_dir, RetryRequest(agent="write_all"))
    assert result.status is RunStatus.SUCCEEDED
    a = result.state.nodes["a"]
    assert [(r.attempt, r.profile, r.outcome) for r in a.attempts] == [
        (1, "always_exit_2", FailureClass.AGENT_EXIT), (2, "write_all", "succeeded")]
    assert len(result.state.nodes["c"].attempts) == 1  # never re-run
    assert (c_artifact.read_bytes(), c_artifact.stat().st_mtime_ns) == c_before
    starts = [e for e in read_events(run_dir / "ledger.jsonl") if isinstance(e, RunStarted)]
    assert starts[-1].retried == ["a", "b"]
    assert starts[-1].settings["agent"] == "write_all"


def test_a_retried_node_gets_a_fresh_max_attempts(project: Project) -> None:
    run_dir = _failed_run(project)
    result = retry_run(run_dir, RetryRequest(sets=("a.max_attempts=2",)))
    a = result.state.nodes["a"]
    assert [r.attempt for r in a.attempts] == [1, 2, 3]  # numbers continue
    assert a.status is NodeStatus.FAILED
    assert a.retry_from == 2
    assert "attempts exhausted (2 of 2" in (a.reason or "")


@pytest.mark.parametrize("feedback", ["in the plan", "turned on by retry --set"])
def test_the_first_retried_attempt_names_the_failure_that_caused_the_retry(
        project: Project, feedback: str) -> None:
    """Before: after `runtime retry` the node's first attempt had no preamble (it replayed
    the prompt that had just failed) and the later ones read "attempt 3 of 2"."""
    topo = make_topology({"a": []}, a={"max_attempts": 2, "retry_feedback":
                                       feedback == "in the plan"})
    topo["agents"] = python_agents("always_exit_2")
    topo["defaults"] = {"agent": "always_exit_2"}
    run_dir = Path(run_topology(project, topo).run_dir)
    sets = ("a.retry_feedback=true",) if feedback != "in the plan" else ()
    result = retry_run(run_dir, RetryRequest(sets=sets))
    assert [r.attempt for r in result.state.nodes["a"].attempts] == [1, 2, 3, 4]
    adir = run_dir / "nodes" / "a" / "attempts"
    first = AttemptContext.model_validate_json((adir / "3" / "attempt.json").read_bytes())
    assert (first.trigger, first.prior_attempt, first.max_attempts) == ("retry", 2, 4)
    assert "# Retry: attempt 3 of 4" in (adir / "3" / "prompt.md").read_text()
    assert "<prior-failure-v1>" in (adir / "3" / "prompt.md").read_text()
    assert "# Retry: attempt 4 of 4" in (adir / "4" / "prompt.md").read_text()
    page = render_run_report(run_dir).read_text()
    assert "attempts 4 · max_attempts 2 per try · retry_feedback true" in page


def test_a_retried_runs_duration_leaves_out_the_time_between_tries(project: Project) -> None:
    """Before: the report counted the hour between the run and its retry as run time."""
    import time

    from runtime.report.html import run_times
    from runtime.run.start import Hooks

    run_dir = _failed_run(project)
    later = Hooks(clock=lambda: time.time() + 3600)  # the retry, an hour on
    retry_run(run_dir, RetryRequest(agent="write_all"), hooks=later)
    times = run_times(read_events(run_dir / "ledger.jsonl"))
    assert times.finished is not None
    assert times.started is not None
    assert times.finished - times.started > 3600
    assert times.duration is not None
    assert times.duration < 600
    # While a retry is still running, the run has no duration yet (a review: the partial
    # span counted, as an earlier try's run.finished was found).
    events = read_events(run_dir / "ledger.jsonl")
    last_start = max(i for i, e in enumerate(events) if isinstance(e, RunStarted))
    assert run_times(events[: last_start + 2]).duration is None


def test_retry_of_a_succeeded_run_changes_nothing(project: Project) -> None:
    topo = make_topology({"a": []})
    topo["agents"] = python_agents("write_all")
    topo["defaults"] = {"agent": "write_all"}
    run_dir = Path(run_topology(project, topo).run_dir)
    before = (run_dir / "ledger.jsonl").read_bytes()
    assert main(["retry", str(run_dir), "--artifacts", str(project.artifacts)]) == 0
    assert (run_dir / "ledger.jsonl").read_bytes() == before


def test_retry_a_batch_reruns_its_failed_runs_and_rewrites_the_summary(
        batch_project: Project,  # noqa: F811 - the imported fixture
        capsys: pytest.CaptureFixture[str]) -> None:
    first = run_batch([batch_project.root / "topologies"],
                      _options(batch_project, batch_id="rb"))
    good_ledger = batch_project.artifacts / "runs" / "rb-good" / "ledger.jsonl"
    good_before = good_ledger.read_bytes()
    capsys.readouterr()
    assert main(["retry", "rb", "--artifacts", str(batch_project.artifacts),
                 "--set", "x.max_attempts=2"]) == 1  # the scripted mistake persists
    out, err = capsys.readouterr()
    assert "bad: [" in err  # each event line names its topology, as batch's lines do
    assert "(1 run retried)" in out
    assert good_ledger.read_bytes() == good_before
    after = BatchSummary.model_validate_json(
        (batch_project.artifacts / "batches" / "rb" / "summary.json").read_bytes())
    bad = {e.topology: e for e in after.entries}["bad"]
    assert bad.nodes["x"].attempts == 3  # 1 before, then a fresh try of 2
    assert [e.source for e in after.entries] == [e.source for e in first.entries]
