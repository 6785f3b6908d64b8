from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from runtime.cli import main
from runtime.failures import Outcome
from runtime.run.events import AttemptFinished, AttemptStarted, Event, NodeSkipped
from tests.conftest import REPO, Project, make_topology, python_agents


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _files(root: Path) -> list[Path]:
    return sorted(root.rglob("*")) if root.exists() else []


def test_plan_json_and_verify(project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    project.write_topology(make_topology({"a": [], "b": ["a"]}))
    code, out, _ = _run(capsys, *project.cli("plan", str(project.topology), "--json"))
    assert code == 0
    result = json.loads(out)
    assert set(result) >= {"plan_digest", "plan_dir", "nodes"}
    assert Path(result["plan_dir"]).name == result["plan_digest"][:16]
    code, out, _ = _run(capsys, *project.cli("verify", result["plan_dir"], "--json"))
    assert code == 0
    assert json.loads(out) == {
        "ok": True, "target": result["plan_dir"], "plan_digest": result["plan_digest"],
        "differences": []}


def test_invalid_topology_exits_2_without_traceback_or_writes(
        project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    topo = make_topology({"a": ["b"], "b": ["a"]})
    topo["nodes"][0]["colour"] = "red"
    project.write_topology(topo)
    before = _files(project.root)
    code, out, err = _run(capsys, *project.cli("plan", str(project.topology)))
    assert code == 2
    assert out == ""
    assert "Traceback" not in err
    assert err.startswith(f"error: {project.topology}: 2 problems")
    assert "nodes[0].colour: unknown key" in err
    assert "cycle: " in err
    assert _files(project.root) == before


def test_one_bad_topology_of_several_writes_nothing(
        project: Project, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    good = project.write_topology(make_topology({"a": []}))
    bad = tmp_path / "bad.yaml"
    bad.write_text("schema_version: 1\nname: bad\nnodes: []\n")
    code, _, err = _run(capsys, *project.cli("plan", str(good), str(bad)))
    assert code == 2
    assert "nodes: List should have at least 1 item" in err
    assert not project.artifacts.exists()


def test_template_error_exits_2(project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    project.template("task.md.j2", "{{ api_key }}\n")
    project.write_topology(make_topology({"a": []}))
    code, _, err = _run(capsys, *project.cli("plan", str(project.topology)))
    assert code == 2
    assert "prompts/task.md.j2:1 (node a): unknown variable 'api_key'" in err


def test_bad_var_syntax(project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    project.write_topology(make_topology({"a": []}))
    code, _, err = _run(capsys, *project.cli("plan", str(project.topology), "--var", "novalue"))
    assert code == 2
    assert "--var 'novalue': expected KEY=VALUE" in err


def test_tampered_plan_exits_1_and_prints_each_difference(
        project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    project.write_topology(make_topology({"a": [], "b": ["a"]}))
    _, out, _ = _run(capsys, *project.cli("plan", str(project.topology), "--json"))
    plan_dir = Path(json.loads(out)["plan_dir"])
    for f in (plan_dir / "prompts").iterdir():
        os.chmod(f, 0o644)
        f.write_text("tampered\n")
    code, out, _ = _run(capsys, *project.cli("verify", str(plan_dir)))
    assert code == 1
    assert len([line for line in out.splitlines() if "modified" in line]) == 2


def test_golden_roundtrip_and_drift(project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    project.write_topology(make_topology({"a": [], "b": ["a"]}))
    golden = project.root / "golden.json"
    code, _, _ = _run(capsys, *project.cli("plan", str(project.topology),
                                           "--golden-out", str(golden)))
    assert code == 0
    code, out, _ = _run(capsys, *project.cli("verify", str(project.topology),
                                             "--golden", str(golden)))
    assert code == 0
    assert out.startswith("OK ")
    project.template("task.md.j2", "Changed wording for {{ node.id }}.\n")
    code, out, _ = _run(capsys, *project.cli("verify", str(project.topology),
                                             "--golden", str(golden)))
    assert code == 1
    lines = out.splitlines()
    assert [ln.split(":")[0] for ln in lines[:2]] == ["node a", "node b"]
    assert "prompt digest" in lines[0]
    assert lines[-1] == (f"if the change is intended, update the golden file: runtime plan "
                         f"{project.topology} --golden-out {golden}")


def test_golden_retry_toggle_changes_only_plan_digest(
        project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    project.write_topology(make_topology({"a": []}))
    golden = project.root / "golden.json"
    _run(capsys, *project.cli("plan", str(project.topology), "--golden-out", str(golden)))
    project.write_topology(make_topology({"a": []}, a={"retry_feedback": True}))
    code, out, _ = _run(capsys, *project.cli("verify", str(project.topology),
                                             "--golden", str(golden), "--json"))
    diffs = json.loads(out)["differences"]
    assert code == 1
    assert diffs[0].startswith("plan digest ")
    assert "every prompt and constant is unchanged: a setting in plan.json changed" in diffs[0]
    assert not any(d.startswith("node ") for d in diffs)


def test_verify_against_another_topologys_golden_says_so(
        project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: a list of prompt differences, and advice to overwrite that golden file."""
    golden = REPO / "tests" / "golden" / "solidity-audit.json"
    project.write_topology(make_topology({"a": []}))
    code, out, _ = _run(capsys, *project.cli("verify", str(project.topology),
                                             "--golden", str(golden), "--json"))
    diffs = json.loads(out)["differences"]
    assert code == 1
    assert diffs[0] == ("topology: the golden file is for 'solidity-audit', this topology is "
                        "'t' (the wrong --golden file?)")
    assert not any("update the golden file" in d for d in diffs)


@pytest.mark.parametrize(("argv", "message"), [
    (["verify", "nowhere"], "no such plan directory or topology file"),
    (["verify", "{topology}"], "verifying a topology needs --golden FILE"),
    (["verify", "{topology}", "--golden", "{root}/absent.json"], "cannot read golden file"),
])
def test_verify_usage_errors(project: Project, capsys: pytest.CaptureFixture[str],
                             argv: list[str], message: str) -> None:
    project.write_topology(make_topology({"a": []}))
    argv = [a.format(topology=project.topology, root=project.root) for a in argv]
    code, _, err = _run(capsys, *project.cli(*argv))
    assert code == 2
    assert message in err


@pytest.mark.parametrize(("fmt", "expected"), [
    ("mermaid", ['flowchart TD', '  n0["a"]', '  n1["b (retry feedback)"]', "  n0 --> n1"]),
    ("dot", ['digraph "t" {', '  "a" -> "b";']),
])
def test_graph(project: Project, capsys: pytest.CaptureFixture[str], fmt: str,
               expected: list[str]) -> None:
    project.write_topology(make_topology({"a": [], "b": ["a"]}, b={"retry_feedback": True}))
    code, out, _ = _run(capsys, *project.cli("graph", str(project.topology), "--format", fmt))
    assert code == 0
    for line in expected:
        assert line in out.splitlines()


def test_schema_is_json_schema_of_topology(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "schema")
    schema = json.loads(out)
    assert code == 0
    assert schema["title"] == "Topology"
    assert schema["additionalProperties"] is False
    assert "retry_feedback" in schema["$defs"]["Node"]["properties"]


@pytest.mark.parametrize(("node", "flagged"), [
    ({"id": "ok", "prompt": "task.md.j2", "needs": []}, False),
    ({"id": "A B", "prompt": "task.md.j2"}, True),
    ({"id": "ok", "prompt": "task.md.j2", "needs": ["Bad id"]}, True),
    ({"id": "ok", "prompt": "../task.md.j2"}, True),
    ({"id": "ok", "prompt": "/etc/passwd"}, True),
    ({"id": "ok", "prompt": "a\\b.j2"}, True),
    ({"id": "ok", "prompt": "a\rb.j2"}, False),  # legal: a line break matched too
])
def test_schema_flags_what_the_planner_refuses(capsys: pytest.CaptureFixture[str],
                                                node: dict[str, Any], flagged: bool) -> None:
    """A new user's trial: the schema editors read accepted ids with spaces and prompt
    paths with '..', which the planner then refused."""
    import jsonschema

    schema = json.loads(_run(capsys, "schema")[1])
    topo = {"schema_version": 1, "name": "t", "nodes": [node]}
    errors = list(jsonschema.Draft202012Validator(schema).iter_errors(topo))
    assert bool(errors) is flagged, [e.message for e in errors]


def test_unknown_verb_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["frobnicate"]) == 2


def test_python_dash_m_entry_point(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "runtime", "plan", str(REPO / "topologies" / "solidity-audit.yaml"),
         "--prompts", str(REPO / "prompts"), "--artifacts", str(tmp_path), "--json"],
        capture_output=True, text=True, check=False, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["plan_digest"]


def _sim_project(project: Project) -> None:
    topo = make_topology({"a": [], "b": ["a"], "c": []})
    topo["agents"]["flaky"] = {"kind": "simulated", "mistakes": {
        "a": {"kind": "wrong_name", "attempts": [1]}}}
    project.write_topology(topo)


def test_run_json_reports_each_node(project: Project,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    _sim_project(project)
    code, out, _ = _run(capsys, *project.cli("run", str(project.topology), "--json",
                                             "--run-id", "r1", "--jobs", "2"))
    result = json.loads(out)
    assert code == 0
    assert result["run_id"] == "r1"
    assert result["status"] == "succeeded"
    assert Path(result["run_dir"]) == project.artifacts / "runs" / "r1"
    assert {n: v["status"] for n, v in result["nodes"].items()} == {
        "a": "succeeded", "b": "succeeded", "c": "succeeded"}


def test_show_names_no_error_under_a_node_that_then_succeeded(
        project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    _sim_project(project)
    code, _, err = _run(capsys, *project.cli("run", str(project.topology), "--run-id", "r3",
                                             "--agent", "flaky"))
    assert code == 0, err
    code, out, _ = _run(capsys, *project.cli("show", "r3"))
    assert code == 0
    assert "1:artifact_contract[flaky], 2:succeeded[flaky]" in out
    assert "last error" not in out


def test_run_failure_exits_1_and_show_names_the_error(
        project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    _sim_project(project)
    code, out, _ = _run(capsys, *project.cli("run", str(project.topology), "--run-id", "r2",
                                             "--agent", "flaky", "--set", "a.max_attempts=1"))
    assert code == 1
    assert "skipped" in out
    assert "upstream a failed" in out
    code, out, _ = _run(capsys, *project.cli("show", "r2"))
    assert code == 1
    assert "1:artifact_contract[flaky]" in out
    assert "last error: a.json: required artifact missing; the workspace has: draft-a.json" in out
    code, out, _ = _run(capsys, *project.cli("show", "r2", "--json"))
    assert json.loads(out)["nodes"]["b"]["failed_ancestor"] == "a"


def test_run_then_resume_is_a_no_op(project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    _sim_project(project)
    _run(capsys, *project.cli("run", str(project.topology), "--run-id", "r3"))
    run_dir = project.artifacts / "runs" / "r3"
    code, out, _ = _run(capsys, *project.cli("resume", str(run_dir), "--json"))
    assert code == 0
    assert json.loads(out)["status"] == "succeeded"


def test_run_plan_directory(project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    _sim_project(project)
    _, out, _ = _run(capsys, *project.cli("plan", str(project.topology), "--json"))
    code, out, _ = _run(capsys, *project.cli("run", json.loads(out)["plan_dir"], "--json"))
    assert code == 0
    assert json.loads(out)["status"] == "succeeded"


@pytest.mark.parametrize(("extra", "message"), [
    (["--agent", "gpt"], "--agent gpt: topology 't' has no such profile; its profiles (and "
     "the built-in ones): flaky, sim, simulated"),
    (["--set", "zz.max_attempts=2"], "--set zz.max_attempts=2: no node 'zz' in the plan"),
    (["--set", "a.backoff_s=2"], "'backoff_s' cannot be set per run; settable: max_attempts"),
        (["--set", "a.timeout_s=nan"], "timeout_s takes seconds"),
    (["--set", "a.max_attempts=0"], "max_attempts takes a whole number from 1 to 20"),
    (["--set", "a.retry_feedback=maybe"], "retry_feedback takes true or false"),
    (["--set", "a.retry_on=flaky"], "unknown failure class 'flaky'"),
    (["--set", "nodot"], "expected NODE.FIELD=VALUE"),
    (["--jobs", "0"], "--jobs 0: must be from 1 to 256"),
    (["--run-id", "../escape"], "--run-id '../escape': use 1-128 of"),
])
def test_run_usage_errors(project: Project, capsys: pytest.CaptureFixture[str],
                          extra: list[str], message: str) -> None:
    _sim_project(project)
    code, _, err = _run(capsys, *project.cli("run", str(project.topology), *extra))
    assert code == 2, err
    assert message in err, err
    assert not (project.artifacts / "runs").exists() or not any(
        (project.artifacts / "runs").iterdir())


def test_existing_run_id_is_refused(project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    _sim_project(project)
    _run(capsys, *project.cli("run", str(project.topology), "--run-id", "dup"))
    code, _, err = _run(capsys, *project.cli("run", str(project.topology), "--run-id", "dup"))
    assert code == 2
    assert "run dup already exists" in err
    assert "runtime resume" in err


def test_resume_unknown_run(project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, *project.cli("resume", "nope"))
    assert code == 2
    assert "nope: not a run directory" in err


def test_tampered_plan_is_not_run(project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    _sim_project(project)
    _, out, _ = _run(capsys, *project.cli("plan", str(project.topology), "--json"))
    plan_dir = Path(json.loads(out)["plan_dir"])
    victim = sorted((plan_dir / "prompts").iterdir())[0]
    os.chmod(victim, 0o644)
    victim.write_text("tampered\n")
    code, _, err = _run(capsys, *project.cli("run", str(plan_dir)))
    assert code == 1
    assert "the plan does not verify; refusing to run" in err


def test_signal_handlers_are_restored_after_a_run(
        project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    import signal

    before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    _sim_project(project)
    _run(capsys, *project.cli("run", str(project.topology), "--run-id", "sig"))
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


@pytest.mark.parametrize(("event", "line"), [
    (AttemptStarted(node="a", attempt=2, profile="claude", trigger="retry",
                    prompt_digest="p", waited_s=3.0),
     "a: attempt 2 started on claude after waiting 3 s"),
    (AttemptFinished(node="a", attempt=1, outcome=Outcome.AGENT_AUTH,
                     summary="Not logged in \x1b[31m· Please run /login"),
     "a: attempt 1 agent_auth: Not logged in ?[31m· Please run /login"),
    (AttemptFinished(node="a", attempt=1, outcome=Outcome.SUCCEEDED), ""),
    (NodeSkipped(node="b", failed_ancestor="a"), "b: skipped (upstream a failed)"),
    (NodeSkipped(node="b", reason="run deadline passed"), "b: skipped (run deadline passed)"),
    (NodeSkipped(node="b", failed_ancestor="a", reason="run deadline passed"),
     "b: skipped (upstream a not finished: run deadline passed)"),
    (AttemptFinished(node="a", attempt=1, outcome=Outcome.DIGEST_MISMATCH,
                     summary="hashes to 75d9\n[... 49 characters dropped ...]\nthe plan"),
     "a: attempt 1 digest_mismatch: hashes to 75d9 [... 49 characters dropped ...] the plan"),
])
def test_progress_lines_name_the_node_and_keep_escapes_out(event: Event, line: str) -> None:
    from runtime.eventlines import event_line

    out = event_line(event)
    assert out.endswith(line) if line else out == ""


def test_a_full_disk_at_the_end_of_a_run_loses_no_outcome(
        project: Project, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """state.json and report.html cannot be written (ENOSPC): the run's outcome and exit
    code stand, each lost file is named, no traceback; ``resume`` writes them again."""
    import errno

    from runtime.report import html
    from runtime.run import scheduler, state

    def full(path: Path, *_: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    def full_report(run_dir: Path) -> None:
        full(run_dir / "report.html")

    project.write_topology(make_topology({"a": [], "b": ["a"]}))
    with monkeypatch.context() as patched:
        patched.setattr(scheduler, "_write_state", full)  # the refreshes during the run
        patched.setattr(state, "write_state", full)  # the final one
        patched.setattr(html, "report_run", full_report)
        code, out, err = _run(capsys, *project.cli("run", str(project.topology), "--run-id",
                                                   "full"))
    run_dir = project.artifacts / "runs" / "full"
    assert code == 0, err
    assert "Traceback" not in err
    assert f"{run_dir / 'state.json'} not written (No space left on device)" in caplog.text
    assert f"the report was not written (No space left on device: {run_dir / 'report.html'})" \
        in err
    assert "run full (t): succeeded" in out
    assert "report:" not in out
    assert not (run_dir / "report.html").exists()
    code, out, err = _run(capsys, *project.cli("resume", str(run_dir)))
    assert code == 0, err
    assert json.loads((run_dir / "state.json").read_text())["status"] == "succeeded"
    assert (run_dir / "report.html").is_file()


def test_resume_of_a_failed_run_points_at_retry(project: Project,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    topo = make_topology({"a": []}, a={"max_attempts": 1})
    topo["agents"] = python_agents("always_exit_2")
    topo["defaults"] = {"agent": "always_exit_2"}
    project.write_topology(topo)
    assert _run(capsys, *project.cli("run", str(project.topology), "--run-id", "f"))[0] == 1
    run_dir = project.artifacts / "runs" / "f"
    code, _, err = _run(capsys, *project.cli("resume", str(run_dir), "--deadline", "60"))
    assert code == 1
    assert (f"run f had already finished (failed): nothing to resume; `runtime retry "
            f"{run_dir}` re-runs its failed and skipped nodes") in err


def test_resume_of_a_finished_run_whose_views_cannot_be_written_only_warns(
        project: Project, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    """An unsandboxed agent turned state.json and report.html into directories: `resume`
    of the finished run names both, exits with the run's code, and leaves no temporary
    file behind (before: a traceback and exit 1, and a `.state.json.*.tmp` per try)."""
    project.write_topology(make_topology({"a": []}))
    code, _, err = _run(capsys, *project.cli("run", str(project.topology), "--run-id", "d"))
    assert code == 0, err
    run_dir = project.artifacts / "runs" / "d"
    for name in ("state.json", "report.html"):
        (run_dir / name).unlink()
        (run_dir / name).mkdir()
    code, out, err = _run(capsys, *project.cli("resume", str(run_dir)))
    assert code == 0, err
    assert "run d (t): succeeded" in out
    assert "Traceback" not in err
    assert f"{run_dir / 'state.json'} not written (Is a directory)" in caplog.text
    assert "the report was not written (Is a directory" in err
    assert sorted(p.name for p in run_dir.iterdir() if p.name.endswith(".tmp")) == []
