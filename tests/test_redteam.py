"""Red-team regressions for the execution core: hostile agents and a hostile environment."""

from __future__ import annotations

import contextlib
import stat
from pathlib import Path
from typing import Any

from runtime.failures import RunStatus
from runtime.run.events import AttemptFinished, RunFinished, read_events
from tests.conftest import Project, make_topology, run_topology


def _script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(path)


def _project(tmp_path: Path) -> Project:
    project = Project(tmp_path / "proj")
    project.root.mkdir()
    project.template("task.md.j2", "Task for {{ node.id }}.\n")
    return project


def test_agent_replacing_its_attempt_json_with_a_directory_does_not_crash_the_run(
        tmp_path: Path) -> None:
    """An unsandboxed agent turns attempt.json into a directory: its attempt fails, the run goes on.

    Today the final record's replace_atomically raises IsADirectoryError out of
    Attempt.complete (the _guard's own recovery writes the record again and raises again),
    out of the scheduler's loop: every other running agent is killed, no run.finished, and
    `runtime resume` crashes the same way for as long as the agent does it.
    """
    project = _project(tmp_path)
    evil = _script(tmp_path / "evil.sh", 'rm -f "$RUNTIME_ATTEMPT_CONTEXT"; '
                   'mkdir "$RUNTIME_ATTEMPT_CONTEXT"; echo "{}" > evil.json\n')
    good = _script(tmp_path / "good.sh", "sleep 1; echo '{}' > good.json\n")
    topo: dict[str, Any] = make_topology({"evil": [], "good": []})
    topo["agents"] = {
        "evil": {"kind": "command", "argv": [evil], "sandbox": False},
        "good": {"kind": "command", "argv": [good], "sandbox": False}}
    topo["defaults"] = {"agent": "good", "max_attempts": 1}
    topo["nodes"][0]["agent"] = "evil"
    result = run_topology(project, topo, jobs=2)
    assert result.status is RunStatus.FAILED
    events = read_events(result.run_dir / "ledger.jsonl")
    finished = {e.node: e for e in events if isinstance(e, AttemptFinished)}
    assert finished["good"].outcome.value == "succeeded"
    assert finished["evil"].outcome.value != "succeeded"
    assert isinstance(events[-1], RunFinished)


_SARIF_WRITER = r'''
import json
res = [{"ruleId": f"R{i % 50}", "level": "warning", "message": {"text": "x" * 40},
        "locations": [{"physicalLocation": {"artifactLocation": {"uri": f"src/f{i}.c"},
                                             "region": {"startLine": i % 1000 + 1}}}]}
       for i in range(30000)]
json.dump({"version": "2.1.0", "runs": [{"tool": {"driver": {"name": "t"}}, "results": res}]},
          open("f.sarif", "w"))
'''


def test_validating_one_agents_artifact_does_not_hold_up_another_agents_timeout(
        tmp_path: Path) -> None:
    """A big (but allowed: under 10 MiB) SARIF artifact must not stall every other agent's timeout.

    Recording an attempt (here ~7 s of SARIF schema validation for 30,000 results, 5 MB)
    runs on a step thread: on the loop's thread no other agent's timeout, cancellation or
    kill escalation was acted on meanwhile, and the sleeper below, with a 2 s timeout, was
    recorded after ~8 s.
    """
    import sys

    project = _project(tmp_path)
    (tmp_path / "w.py").write_text(_SARIF_WRITER)
    big = _script(tmp_path / "big.sh", f"exec {sys.executable} {tmp_path / 'w.py'}\n")
    slow = _script(tmp_path / "slow.sh", "exec sleep 60\n")
    topo: dict[str, Any] = make_topology({"big": [], "slow": []})
    topo["agents"] = {
        "big": {"kind": "command", "argv": [big], "sandbox": False},
        "slow": {"kind": "command", "argv": [slow], "sandbox": False}}
    topo["defaults"] = {"agent": "slow", "max_attempts": 1}
    topo["nodes"][0].update(agent="big", artifacts=[{"path": "f.sarif", "kind": "sarif"}])
    topo["nodes"][1].update(timeout_s=2)
    result = run_topology(project, topo, jobs=2)
    events = read_events(result.run_dir / "ledger.jsonl")
    finished = {e.node: e for e in events if isinstance(e, AttemptFinished)}
    assert finished["big"].outcome.value == "succeeded"
    assert finished["slow"].outcome.value == "agent_timeout"
    assert finished["slow"].duration_s < 5.0, finished["slow"].duration_s  # not ~8


class _Crash(BaseException):
    """Stands for anything that escapes the scheduler's loop."""


def test_an_exception_out_of_the_loop_does_not_wait_for_thread_agents(tmp_path: Path) -> None:
    """When the loop dies, agents on the thread pool are cancelled, not waited for.

    The pool's exit waits for every thread agent: without the cancel event set, a hung
    simulated agent (an http agent: up to its timeout_s, 1800 s by default) holds the dying
    run for its whole timeout.
    """
    import time

    import pytest

    from runtime.run.events import Event
    from runtime.run.start import Hooks

    def crash_when_quick_finishes(event: Event) -> None:
        if isinstance(event, AttemptFinished) and event.node == "b-quick":
            raise _Crash

    project = _project(tmp_path)
    topo: dict[str, Any] = make_topology({"a-hung": [], "b-quick": []})
    topo["agents"] = {
        "quick": {"kind": "command", "argv": ["sh", "-c", "sleep 0.5"], "sandbox": False},
        "sim": {"kind": "simulated", "mistakes": {"a-hung": {"kind": "hang", "attempts": [1]}}}}
    topo["defaults"] = {"agent": "sim", "max_attempts": 1}
    topo["nodes"][0]["timeout_s"] = 60
    topo["nodes"][1]["agent"] = "quick"
    began = time.monotonic()
    with pytest.raises(_Crash):
        run_topology(project, topo, jobs=2,
                     hooks=Hooks(after_append=crash_when_quick_finishes))
    assert time.monotonic() - began < 30  # not the hung agent's 60 s


def test_sandboxed_agent_cannot_read_the_hidden_artifacts_root_through_error_file(
        tmp_path: Path) -> None:
    """error_file is read outside the sandbox following symlinks: a sandbox read-out.

    The sandbox hides the artifacts root (other workspaces, the ledger). A sandboxed agent
    whose profile has ``error_file`` makes it a relative symlink to another node's
    workspace file (``../../secret/workspace/secret.json``) and exits 0; the runtime
    (outside the sandbox) follows it, records the content as the contradictory_completion
    error, and the retry preamble hands it back to the agent. (Pre-existing: the same in
    f81dccb.)
    """

    project = _project(tmp_path)
    secret = _script(tmp_path / "secret.sh", """echo '{"k": "TOPSECRET-7f3a"}' > secret.json\n""")
    spy = _script(tmp_path / "spy.sh",
                  "ln -s ../../secret/workspace/secret.json err.txt\nexit 0\n")
    topo: dict[str, Any] = make_topology({"secret": [], "spy": []})
    topo["agents"] = {
        "secret": {"kind": "command", "argv": [secret]},
        "spy": {"kind": "command", "argv": [spy], "error_file": "err.txt"}}
    topo["defaults"] = {"agent": "secret", "max_attempts": 2}
    topo["nodes"][0]["artifacts"] = [{"path": "secret.json", "kind": "json"}]
    topo["nodes"][1].update(agent="spy", retry_feedback=True, artifacts=[])
    result = run_topology(project, topo, jobs=1)
    assert b"TOPSECRET" not in (result.run_dir / "ledger.jsonl").read_bytes()
    for prompt in (result.run_dir / "nodes" / "spy" / "attempts").glob("*/prompt.md"):
        assert b"TOPSECRET" not in prompt.read_bytes()


def _pids_running(marker: str) -> list[int]:
    import os
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline:
                out.append(int(name))
    return out


def test_running_out_of_descriptors_neither_crashes_the_run_nor_leaves_agents(
        tmp_path: Path) -> None:
    """EMFILE (RLIMIT_NOFILE 80, --jobs 20: as 1024 is with --jobs 256) is an attempt's problem.

    Each supervised agent now holds more descriptors (pipes, pidfd, attempt.json kept
    open, two logs). The capture's log open raises EMFILE inside Supervisor.poll, out of the
    scheduler's loop; Supervisor.close then raises EMFILE too (listing /proc in
    kill_descendants) after the first agent, so the others are never killed: unsandboxed
    agents outlive the runtime. f81dccb recorded launch errors and finished the run.
    """
    import os
    import resource
    import signal
    import subprocess
    import sys
    import time

    import yaml

    project = _project(tmp_path)
    agent = _script(tmp_path / "chatty-agent.sh",
                    "sleep 1; echo out; echo err >&2; sleep 20; echo '{}' > o.json\n")
    topo: dict[str, Any] = make_topology({f"n{i:02d}": [] for i in range(40)})
    for node in topo["nodes"]:
        node["artifacts"] = [{"path": "o.json", "kind": "json"}]
    topo["agents"] = {"c": {"kind": "command", "argv": [agent], "sandbox": False}}
    topo["defaults"] = {"agent": "c", "max_attempts": 1, "timeout_s": 5}
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(topo))

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (80, 80))

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "runtime", *project.cli("run", str(path), "--jobs", "20")],
            capture_output=True, text=True, env=env, preexec_fn=limit, timeout=120,
            check=False)
        time.sleep(0.5)
        left = _pids_running(str(tmp_path / "chatty-agent.sh"))
        assert not left, f"{len(left)} agents outlived the runtime"
        assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    finally:
        for pid in _pids_running(str(tmp_path / "chatty-agent.sh")):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
