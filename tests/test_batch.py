from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from pydantic.main import IncEx

from runtime.batch import BatchOptions, run_batch
from runtime.cli import main
from runtime.errors import UsageError
from runtime.prompt.redact import Redactor
from runtime.run.summary import BatchEntry, BatchSummary
from tests.conftest import Project, make_topology


def _write(project: Project, name: str, topo: dict[str, object]) -> Path:
    path = project.root / "topologies" / f"{name}.yaml"
    path.parent.mkdir(exist_ok=True)
    import yaml

    path.write_text(yaml.safe_dump(topo, sort_keys=False))
    return path


@pytest.fixture
def batch_project(project: Project) -> Project:
    good = make_topology({"a": [], "b": ["a"]}, name="good", b={"retry_feedback": True})
    good["agents"]["sim"] = {"kind": "simulated", "mistakes": {
        "b": {"kind": "wrong_name", "unless_feedback": True}}}
    bad = make_topology({"x": []}, name="bad", x={"max_attempts": 1})
    bad["agents"]["sim"] = {"kind": "simulated", "mistakes": {"x": {"kind": "exit_nonzero"}}}
    _write(project, "good", good)
    _write(project, "bad", bad)
    (project.root / "topologies" / "broken.yaml").write_text("schema_version: 1\nname: b\n")
    return project


def _options(project: Project, **kw: object) -> BatchOptions:
    return BatchOptions(prompts=project.prompts, artifacts=project.artifacts,
                        redactor=Redactor(), **kw)  # type: ignore[arg-type]


def test_one_failure_never_stops_the_others(batch_project: Project) -> None:
    summary = run_batch([batch_project.root / "topologies"], _options(batch_project,
                                                                      batch_id="b1"))
    by = {e.topology or Path(e.source).stem: e for e in summary.entries}
    assert summary.status == "failed"
    assert by["good"].status == "succeeded"
    assert by["good"].retries_after_feedback == ["b"]
    assert by["good"].nodes["b"].attempts == 2
    assert by["good"].nodes["b"].succeeded_after_feedback
    assert by["bad"].status == "failed"
    assert by["bad"].nodes["x"].failure == "agent_exit"
    assert by["broken"].status == "invalid"
    assert "nodes" in (by["broken"].error or "")
    on_disk = BatchSummary.model_validate_json(
        (batch_project.artifacts / "batches" / "b1" / "summary.json").read_bytes())
    paths: dict[str, IncEx | bool] = {"report": True, "findings_file": True,
             "entries": {"__all__": {"run_dir": True, "report": True}}}
    assert on_disk.model_dump(exclude=paths) == summary.model_dump(exclude=paths)


def test_same_batch_id_resumes_and_keeps_finished_runs(batch_project: Project) -> None:
    first = run_batch([batch_project.root / "topologies"], _options(batch_project,
                                                                    batch_id="b2"))
    ledger = batch_project.artifacts / "runs" / "b2-good" / "ledger.jsonl"
    before = ledger.read_bytes()
    second = run_batch([batch_project.root / "topologies"], _options(batch_project,
                                                                     batch_id="b2"))
    assert ledger.read_bytes() == before  # a finished run is not run again
    assert [e.status for e in second.entries] == [e.status for e in first.entries]


@pytest.mark.parametrize("change", ["fewer topologies", "a topology that no longer compiles",
                                    "an edited topology"])
def test_a_batch_id_again_with_other_inputs_is_refused(batch_project: Project,
                                                       change: str) -> None:
    """Before: the batch was rewritten in silence (its summary lost the runs not given
    again, or reported an old run under a topology that now compiles to another plan)."""
    topologies = batch_project.root / "topologies"
    run_batch([topologies], _options(batch_project, batch_id="b3"))
    summary = batch_project.artifacts / "batches" / "b3" / "summary.json"
    before = summary.read_bytes()
    given = [topologies]
    if change == "fewer topologies":
        given = [topologies / "good.yaml"]
        message = "has runs of bad ("
    elif change == "a topology that no longer compiles":
        (topologies / "good.yaml").write_text("schema_version: 1\nname: good\nnodes: 3\n")
        message = "has runs of good ("
    else:
        good = yaml.safe_load((topologies / "good.yaml").read_text())
        good["nodes"][0]["max_attempts"] = 5
        (topologies / "good.yaml").write_text(yaml.safe_dump(good, sort_keys=False))
        message = "good.yaml (plan "
    with pytest.raises(UsageError, match=re.escape(message)):
        run_batch(given, _options(batch_project, batch_id="b3"))
    assert summary.read_bytes() == before


def test_a_batch_cut_short_resumes_from_another_directory(
        batch_project: Project, monkeypatch: pytest.MonkeyPatch) -> None:
    """A review: a crash mid-batch leaves a summary of the finished entries only, and
    paths are as typed: the same command was refused, and so was the same batch started
    from another directory."""
    monkeypatch.chdir(batch_project.root)
    run_batch([Path("topologies")], _options(batch_project, batch_id="b4"))
    summary = batch_project.artifacts / "batches" / "b4" / "summary.json"
    cut = BatchSummary.model_validate_json(summary.read_bytes())
    summary.write_text(cut.model_copy(update={"entries": cut.entries[:1]}).model_dump_json())
    monkeypatch.chdir(batch_project.root.parent)
    again = run_batch([batch_project.root / "topologies"], _options(batch_project,
                                                                   batch_id="b4"))
    assert len(again.entries) == len(cut.entries)


def test_a_ctrl_c_after_every_run_finished_changes_nothing(batch_project: Project) -> None:
    """A review: a SIGINT that landed after the last run had succeeded marked the batch
    cancelled (and the CLI printed 'interrupted', exit 130)."""
    import threading

    cancel = threading.Event()

    def late_ctrl_c(entry: BatchEntry) -> BatchEntry:
        cancel.set()  # after this (the only) topology's run has finished
        return entry

    good = batch_project.root / "topologies" / "good.yaml"
    summary = run_batch([good], _options(batch_project, batch_id="b9"), None, cancel,
                        late_ctrl_c)
    assert summary.status == "succeeded"


def test_batch_cli_json_and_reports(batch_project: Project,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    code = main(batch_project.cli("batch", str(batch_project.root / "topologies"), "--json",
                                  "--batch-id", "b3", "--jobs", "2", "--node-jobs", "2"))
    out = json.loads(capsys.readouterr().out)
    assert code == 1
    assert out["batch_id"] == "b3"
    assert Path(out["report"]).is_file()
    for entry in out["entries"]:
        if entry["run_dir"]:
            assert Path(entry["report"]).is_file()


def test_batch_cli_human_output_ends_with_the_report(
        batch_project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    topo = batch_project.root / "topologies"
    (topo / "bad.yaml").unlink()
    (topo / "broken.yaml").unlink()
    code = main(batch_project.cli("batch", str(topo), "--batch-id", "b4"))
    out = capsys.readouterr().out
    assert code == 0
    assert out.splitlines()[-1] == \
        f"report: {batch_project.artifacts / 'batches' / 'b4' / 'report.html'}"


def test_batch_set_must_name_a_node_some_topology_has(
        batch_project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(batch_project.cli("batch", str(batch_project.root / "topologies"),
                                  "--set", "nope.max_attempts=3", "--batch-id", "b5"))
    assert code == 2
    assert "--set nope.max_attempts=3: no topology in this batch has a node 'nope'" in \
        capsys.readouterr().err
    assert not batch_project.artifacts.exists()  # invalid input writes nothing


def test_batch_set_applies_to_the_topology_that_has_the_node(batch_project: Project) -> None:
    summary = run_batch([batch_project.root / "topologies"], _options(
        batch_project, batch_id="b6", sets=("b.retry_feedback=false",)))
    good = next(e for e in summary.entries if e.topology == "good")
    assert good.status == "failed"
    assert good.nodes["b"].attempts == 2  # no feedback, no fix


def test_live_progress_shows_attempts_and_retries(batch_project: Project) -> None:
    import io

    from rich.console import Console

    from runtime.progress import LiveProgress, summary_table

    (batch_project.root / "topologies" / "broken.yaml").unlink()
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=140, color_system=None)
    with LiveProgress(console, 2) as progress:
        summary = run_batch([batch_project.root / "topologies"],
                            _options(batch_project, batch_id="b7"), progress)
    console.print(summary_table(summary))
    text = out.getvalue()
    assert "good" in text
    assert "attempts   3  retries  1  succeeded" in text
    assert "attempts   1  retries  0  failed" in text
    assert "2/2" in text  # the overall bar completed


def test_summary_table_names_the_first_failure_in_the_agent_s_words(
        batch_project: Project) -> None:
    import io

    from rich.console import Console

    from runtime.progress import summary_table

    summary = run_batch([batch_project.root / "topologies"], _options(batch_project,
                                                                      batch_id="b8"))
    bad = next(e for e in summary.entries if e.topology == "bad")
    assert bad.nodes["x"].summary != ""
    out = io.StringIO()
    Console(file=out, width=400, color_system=None).print(summary_table(summary))
    assert f"x: agent_exit: {bad.nodes['x'].summary}" in out.getvalue()
    good = next(e for e in summary.entries if e.topology == "good")
    assert good.nodes["b"].summary == ""  # it failed once, then succeeded: nothing to fix


def test_summary_table_keeps_names_and_statuses_whole_at_80_columns() -> None:
    """Before: 'incident-rep…' and 'succe…' at 80 columns, and names cut even at 120; a
    long source path of an invalid entry then squeezed the other columns away."""
    import io

    from rich.console import Console

    from runtime.progress import summary_table

    summary = BatchSummary(batch_id="b", status="failed", entries=[
        BatchEntry(source="t/a.yaml", topology="incident-replay-long-name", status="succeeded",
                   retries_after_feedback=["durable-handler"]),
        BatchEntry(source="t/b.yaml", topology="supply-chain-review", status="cancelled"),
        BatchEntry(source="topologies/a-rather-long-directory-name/broken-topology.yaml",
                   status="invalid", error="nodes: required field is missing")])
    out = io.StringIO()
    Console(file=out, width=80, color_system=None).print(summary_table(summary))
    text = out.getvalue()
    assert "…" not in text  # a long name folds onto the next line: no character is lost
    for whole in ("topology", "status", "attempts", "findings", "failure", "succeeded",
                  "cancelled", "invalid", "supply-chain-rev"):
        assert whole in text, text


def test_batch_takes_the_run_options_and_logs_events_without_a_terminal(
        batch_project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 10: batch accepts run's options and applies them to every run; with stderr
    not a terminal (CI) it prints one line per node event, prefixed with the topology."""
    topo = batch_project.root / "topologies"
    (topo / "broken.yaml").unlink()
    operator = batch_project.root / "operator.md"
    operator.write_text("Scope: staging.\n")
    code = main(batch_project.cli(
        "batch", str(topo), "--batch-id", "b6", "--timeout", "30", "--no-fallback",
        "--max-total-attempts", "9", "--deadline", "600", "--operator-prompt", str(operator)))
    err = capsys.readouterr().err
    assert code == 1  # bad fails, as scripted
    assert "good: [" in err
    assert "b: attempt 1 artifact_contract" in err
    assert "bad: [" in err
    assert "x: failed, agent_exit" in err
    assert "\nbad: failed\n" in err
    ledger = batch_project.artifacts / "runs" / "b6-good" / "ledger.jsonl"
    settings = json.loads(ledger.read_text().splitlines()[0])["settings"]
    assert settings["no_fallback"] is True
    assert settings["max_total_attempts"] == 9
    assert settings["deadline_at"] is not None
    assert settings["operator_prompt_digest"]
    assert settings["overrides"]["a"] == {"timeout_s": 30.0}


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--max-total-attempts", "0", "--max-total-attempts"),
    ("--deadline", "-5", "--deadline"),
    ("--timeout", "nan", "timeout_s"),
])
def test_batch_refuses_bad_run_options_before_writing(
        batch_project: Project, capsys: pytest.CaptureFixture[str], flag: str, value: str,
        message: str) -> None:
    code = main(batch_project.cli("batch", str(batch_project.root / "topologies"),
                                  "--batch-id", "b7", flag, value))
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (batch_project.artifacts / "batches" / "b7").exists()


def test_summary_json_holds_no_host_path(batch_project: Project) -> None:
    """Issue 10: records name files relative to the artifacts root."""
    run_batch([batch_project.root / "topologies"], _options(batch_project, batch_id="b8"))
    raw = (batch_project.artifacts / "batches" / "b8" / "summary.json").read_text()
    assert str(batch_project.artifacts) not in raw
    summary = json.loads(raw)
    good = next(e for e in summary["entries"] if e.get("topology") == "good")
    assert good["run_dir"] == "runs/b8-good"
    assert summary["findings_file"] == "batches/b8/findings.sarif"
