"""Every invalid input exits 2 with a message naming the file or flag and what is
accepted, prints no traceback, and writes nothing, plan directories included (issue 9)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from runtime.cli import main
from tests.conftest import Project, make_topology


def _snapshot(root: Path) -> list[Path]:
    return sorted(root.rglob("*"))


def _invalid(project: Project, capsys: pytest.CaptureFixture[str], argv: list[str],
             message: str) -> None:
    before = _snapshot(project.root)
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, err
    assert message in err, err
    assert "Traceback" not in err
    assert out == ""
    assert _snapshot(project.root) == before


@pytest.fixture
def topo(project: Project) -> Path:
    data = make_topology({"a": [], "b": ["a"]})
    data["vars"] = {"x": "v"}
    return project.write_topology(data)


@pytest.mark.parametrize(("extra", "message"), [
    (["--jobs", "300"], "--jobs 300: must be from 1 to 256"),
    (["--jobs", "0"], "--jobs 0: must be from 1 to 256"),
    (["--max-total-attempts", "0"], "--max-total-attempts 0: must be at least 1"),
    (["--deadline", "-5"], "--deadline -5: must be a positive, finite number of seconds"),
    (["--deadline", "0"], "--deadline 0: must be a positive, finite number of seconds"),
    (["--deadline", "nan"], "--deadline nan: must be a positive, finite number of seconds"),
    (["--deadline", "inf"], "--deadline inf: must be a positive, finite number of seconds"),
    (["--run-id", "../escape"], "--run-id '../escape': use 1-128 of"),
    (["--agent", "gpt"], "--agent gpt: topology 't' has no such profile; its profiles (and "
     "the built-in ones): sim, simulated"),
    (["--set", "zz.max_attempts=2"], "--set zz.max_attempts=2: no node 'zz' in the plan"),
    (["--set", "a.max_attempts=0"], "max_attempts takes a whole number from 1 to 20"),
    (["--set", "a.rate_limit_wait_s=100000"], "rate_limit_wait_s takes seconds, a number "
     "from 0 to 86400"),
    (["--operator-prompt", "/nonexistent/op.txt"],
     "--operator-prompt /nonexistent/op.txt: cannot read: No such file or directory"),
    (["--operator-prompt", "/dev/zero"],
     "--operator-prompt /dev/zero: not a regular file; expected a regular file"),
    (["--var", "x=\udcff"], "--var 'x=\\udcff': not valid UTF-8"),
])
def test_run_rejects_before_writing_the_plan(project: Project, topo: Path,
                                             capsys: pytest.CaptureFixture[str],
                                             extra: list[str], message: str) -> None:
    _invalid(project, capsys, project.cli("run", str(topo), *extra), message)


def test_run_rejects_a_non_utf8_operator_prompt(project: Project, topo: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    prompt = tmp_path / "op.txt"
    prompt.write_bytes(b"ok \xfe")
    _invalid(project, capsys, project.cli("run", str(topo), "--operator-prompt", str(prompt)),
             f"--operator-prompt {prompt}: not UTF-8 (byte 0xfe at offset 3)")


def test_run_rejects_an_existing_run_id_before_planning(
        project: Project, topo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (project.artifacts / "runs" / "taken").mkdir(parents=True)
    _invalid(project, capsys, project.cli("run", str(topo), "--run-id", "taken"),
             "run taken already exists")


@pytest.mark.parametrize(("argv", "message"), [
    (["plan", "{topo}", "--golden-out", "{tmp}"], "--golden-out {tmp}: is a directory; give a "
     "file path"),
    (["plan", "{topo}", "--golden-out", "{topo}/golden.json"], "{topo} is not a directory"),
    (["plan", "{topo}", "--var", "x=\udcff"], "--var 'x=\\udcff': not valid UTF-8"),
    (["plan", "/dev/zero"], "/dev/zero: cannot read: not a regular file"),
    (["plan", "{tmp}"], "cannot read: a directory; expected a regular file"),
    (["batch", "{topo}", "--node-jobs", "300"], "--node-jobs 300: must be from 1 to 256"),
    (["batch", "{topo}", "--jobs", "0"], "--jobs 0: must be from 1 to 256"),
    (["resume", "r", "--deadline", "nan"], "--deadline nan: must be a positive"),
    (["plan", "{topo}", "--golden-out", "{tmp}/new/"], "{tmp}/new/ names a directory; give a "
     "file path"),
    (["run", "{tmp}/missing.yaml"], "{tmp}/missing.yaml: no such file"),
    (["batch", "{topo}", "--batch-id", "a/b"], "--batch-id 'a/b': use 1-128 of"),
    (["run", "{topo}", "--timeout", "0"], "--timeout 0: timeout_s takes seconds, a number from "
     "0.001"),
    (["verify", "{tmp}", "--digest", "deadbeef"], "--digest 'deadbeef': a plan digest is 64 "
     "lowercase hex characters"),
])
def test_plan_batch_resume_inputs(project: Project, topo: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str], argv: list[str],
                                  message: str) -> None:
    argv = [a.format(topo=topo, tmp=tmp_path) for a in argv]
    _invalid(project, capsys, project.cli(*argv), message.format(topo=topo, tmp=tmp_path))


@pytest.mark.parametrize(("output", "message"), [
    ("{tmp}", "-o {tmp}: is a directory; give a file path"),
    ("{tmp}/new/", "{tmp}/new/ names a directory; give a file path"),
])
def test_findings_output_must_be_a_file(project: Project, topo: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str], output: str,
                                        message: str) -> None:
    """Before: a traceback, and a temporary file left in the directory's parent."""
    assert main(project.cli("run", str(topo), "--run-id", "r")) == 0
    capsys.readouterr()
    before = sorted(p.name for p in tmp_path.parent.iterdir())
    out = output.format(tmp=tmp_path)
    _invalid(project, capsys, project.cli("findings", "r", "-o", out),
             message.format(tmp=tmp_path))
    assert sorted(p.name for p in tmp_path.parent.iterdir()) == before


def test_a_full_stdout_is_one_error_line_not_a_traceback() -> None:
    """A review: with --json the error was written to the stdout that had just failed,
    which raised again (two tracebacks)."""
    import subprocess
    import sys

    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "runtime", "schema", "--json"],
                              stdout=full, stderr=subprocess.PIPE, text=True, check=False,
                              cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 2
    assert proc.stderr == "error: No space left on device\n"


def test_with_json_an_error_is_json_on_stdout_too(
        project: Project, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """For a script reading --json output (before: an empty stdout)."""
    code = main(project.cli("run", str(tmp_path / "missing.yaml"), "--json"))
    out, err = capsys.readouterr()
    assert code == 2
    assert json.loads(out) == {"error": f"{tmp_path / 'missing.yaml'}: no such file (give a "
                               "topology file or a plan directory)", "exit_code": 2}
    assert err.startswith("error: ")


@pytest.mark.parametrize("verb", ["plan", "run", "batch"])
def test_artifacts_that_is_a_file(project: Project, topo: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str], verb: str) -> None:
    afile = tmp_path / "passwd"
    afile.write_text("root:x:0:0\n")
    argv = [verb, str(topo), "--prompts", str(project.prompts), "--artifacts", str(afile)]
    _invalid(project, capsys, argv, f"--artifacts {afile}: is not a directory")
    assert afile.read_text() == "root:x:0:0\n"


def test_a_missing_prompts_root_is_one_problem(project: Project, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Before: one 'template not found' per node."""
    project.write_topology(make_topology({"a": [], "b": ["a"], "c": []}))
    argv = ["plan", str(project.topology), "--prompts", str(tmp_path / "none"),
            "--artifacts", str(project.artifacts)]
    _invalid(project, capsys, argv, f"1 problem\n  {project.topology}: prompts: the prompts "
             f"root {tmp_path / 'none'} is not a directory")


@pytest.mark.parametrize("verb", ["plan", "run", "batch"])
def test_artifacts_that_cannot_be_written(project: Project, topo: Path,
                                          capsys: pytest.CaptureFixture[str], verb: str) -> None:
    """Before: a traceback from deep in the planner (exit 1)."""
    argv = [verb, str(topo), "--prompts", str(project.prompts), "--artifacts", "/proc/self/x"]
    _invalid(project, capsys, argv, "--artifacts /proc/self/x: /proc/self cannot be written")


@pytest.mark.parametrize(("template", "message"), [
    ("{{ 1/0 }}\n", "prompts/task.md.j2:1 (node a): render failed: ZeroDivisionError"),
    ("{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}\n", "recursion too deep"),
    ("{% include 'task.md.j2' %}\n", "recursion too deep"),
    (b"bad \xff\n", "prompts/task.md.j2:1 (node a): not UTF-8 (byte 0xff at offset 4)"),
    ("{{ 'x' * 10000000000 }}\n", "exceeds 1048576 bytes"),
])
def test_template_failures_exit_2(project: Project, topo: Path,
                                  capsys: pytest.CaptureFixture[str], template: str | bytes,
                                  message: str) -> None:
    path = project.prompts / "task.md.j2"
    if isinstance(template, bytes):
        path.write_bytes(template)
    else:
        path.write_text(template)
    for verb in ("plan", "run"):
        _invalid(project, capsys, project.cli(verb, str(topo)), message)


@pytest.mark.parametrize(("agents", "message"), [
    ("{1: {kind: simulated}}", "agents: key 1 is not a string; names here are strings"),
    ("{null: {kind: simulated}}", "agents: key null is not a string"),
])
def test_non_string_agent_names(project: Project, capsys: pytest.CaptureFixture[str],
                                agents: str, message: str) -> None:
    project.write_topology("schema_version: 1\nname: t\nagents: " + agents +
                           "\nnodes:\n  - {id: a, prompt: task.md.j2}\n")
    _invalid(project, capsys, project.cli("plan", str(project.topology)),
             f"{project.topology}:3: {message}")


def test_deeply_nested_large_yaml(project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    nodes = "".join(f"  - {{id: n{i}, prompt: task.md.j2}}\n" for i in range(8000))
    project.write_topology("schema_version: 1\nname: t\ndescription: " + "[" * 900
                           + "]" * 900 + "\nnodes:\n" + nodes)
    assert os.path.getsize(project.topology) > 256 * 1024
    _invalid(project, capsys, project.cli("plan", str(project.topology)),
             "nest more than 64 levels deep")


def test_a_valid_deadline_is_recorded_from_the_run_start(
        project: Project, topo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import time

    from runtime.run.events import RunStarted, read_events

    before = time.time()
    code = main(project.cli("run", str(topo), "--run-id", "dl", "--deadline", "3600"))
    capsys.readouterr()
    started = read_events(project.artifacts / "runs" / "dl" / "ledger.jsonl")[0]
    assert code == 0
    assert isinstance(started, RunStarted)
    assert before + 3600 <= started.settings["deadline_at"] <= time.time() + 3600
