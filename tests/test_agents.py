"""One contract suite for every agent adapter, then adapter-specific behaviour."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime.agents import make_agent
from runtime.agents.base import Agent, AgentExit, Invocation
from runtime.agents.capture import BoundedCapture
from runtime.agents.command import agent_environment
from runtime.agents.simulated import example_for
from runtime.plan.profiles import CommandProfile, PythonProfile, SimulatedProfile
from runtime.plan.topology import ArtifactSpec

ARTIFACTS = (ArtifactSpec(path="report.md"),
             ArtifactSpec.model_validate({"path": "out/data.json", "kind": "json",
                                          "schema": {"type": "object", "required": ["x"]}}))

WRITE_SH = ('mkdir -p out; printf "# r\\n" > report.md; printf \'{"x": 1}\' > out/data.json')

ADAPTERS: dict[str, Callable[[str], Agent]] = {
    "command": lambda mode: make_agent(CommandProfile(kind="command", argv=["sh", "-c", {
        "ok": WRITE_SH, "hang": "sleep 30"}[mode]])),
    "python": lambda mode: make_agent(PythonProfile(kind="python", target={
        "ok": "tests.agent_scripts:write_all", "hang": "tests.agent_scripts:slow"}[mode])),
    "simulated": lambda mode: make_agent(SimulatedProfile.model_validate({
        "kind": "simulated", "mistakes": {"n": {"kind": "hang"}} if mode == "hang" else {}})),
}


@pytest.fixture
def make_inv(tmp_path: Path) -> Iterator[Callable[..., Invocation]]:
    caps: list[BoundedCapture] = []

    def build(**kw: Any) -> Invocation:
        ws = tmp_path / "ws"
        ws.mkdir(exist_ok=True)
        out, err = BoundedCapture(tmp_path / "out.log"), BoundedCapture(tmp_path / "err.log")
        caps.extend([out, err])
        (tmp_path / "prompt.md").write_text(kw.get("prompt", "Do the task.\n"))
        base: dict[str, Any] = dict(
            run_id="r", node="n", attempt=1, max_attempts=2, prompt="Do the task.\n",
            prompt_file=tmp_path / "prompt.md", workspace=ws, timeout_s=10.0,
            env={"RUNTIME_NODE": "n"}, artifacts=ARTIFACTS, stdout=out, stderr=err)
        base.update(kw)
        return Invocation(**base)

    yield build
    for cap in caps:
        cap.close()


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_contract_success_writes_declared_artifacts(adapter: str,
                                                    make_inv: Callable[..., Invocation]) -> None:
    inv = make_inv()
    result = ADAPTERS[adapter]("ok").run(inv)
    assert result == AgentExit(exit_code=0)
    assert (inv.workspace / "report.md").is_file()
    assert (inv.workspace / "out" / "data.json").is_file()


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_contract_timeout_is_reported_promptly(adapter: str,
                                               make_inv: Callable[..., Invocation]) -> None:
    inv = make_inv(timeout_s=0.3)
    result = ADAPTERS[adapter]("hang").run(inv)
    assert result.timed_out
    assert not result.cancelled


@pytest.mark.parametrize("adapter", ["command", "simulated"])
def test_contract_cancel_stops_the_agent(adapter: str,
                                         make_inv: Callable[..., Invocation]) -> None:
    cancel = threading.Event()
    inv = make_inv(cancel=cancel, timeout_s=30)
    threading.Timer(0.2, cancel.set).start()
    result = ADAPTERS[adapter]("hang").run(inv)
    assert result.cancelled  # (no wall-clock bound: a loaded machine is not a failure)
    assert not result.timed_out  # stopped by the cancel, long before its 30 s timeout


def test_command_environment_is_an_allow_list() -> None:
    source = {"PATH": "/bin", "HOME": "/root", "LC_ALL": "C", "AWS_SECRET_ACCESS_KEY": "x",
              "OPENAI_API_KEY": "k", "RANDOM_VAR": "1"}
    env = agent_environment(["OPENAI_API_KEY"], {"RUNTIME_NODE": "n"}, source)
    assert env == {"PATH": "/bin", "HOME": "/root", "LC_ALL": "C", "OPENAI_API_KEY": "k",
                   "RUNTIME_NODE": "n"}


def test_command_child_sees_only_allowed_environment(
        make_inv: Callable[..., Invocation], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUPER_SECRET_TOKEN", "leak-me")
    inv = make_inv()
    make_agent(CommandProfile(kind="command", argv=["sh", "-c", "env > env.txt"])).run(inv)
    names = {line.split("=", 1)[0] for line in (inv.workspace / "env.txt").read_text().splitlines()}
    assert "SUPER_SECRET_TOKEN" not in names
    assert "RUNTIME_NODE" in names


@pytest.mark.parametrize("sandboxed", [True, False])
def test_command_placeholders_and_prompt_file(make_inv: Callable[..., Invocation],
                                              sandboxed: bool) -> None:
    inv = make_inv()
    agent = make_agent(CommandProfile.model_validate({
        "kind": "command", "prompt_via": "file", "sandbox": {} if sandboxed else False,
        "argv": ["sh", "-c", 'cat "$1" > copy.md; echo "$2 $3" > args.txt', "sh",
                 "{prompt_file}", "{node}", "{workspace}"]}))
    assert agent.run(inv).exit_code == 0
    assert (inv.workspace / "copy.md").read_text() == "Do the task.\n"
    workspace = "/mnt/workspace" if sandboxed else inv.workspace
    assert (inv.workspace / "args.txt").read_text() == f"n {workspace}\n"


def test_timeout_kills_the_whole_process_group(make_inv: Callable[..., Invocation],
                                               tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild.pid"
    inv = make_inv(timeout_s=0.5)
    script = f"sleep 60 & echo $! > {pidfile}; wait"
    result = make_agent(CommandProfile(kind="command", argv=["sh", "-c", script],
                                       sandbox=False)).run(inv)
    assert result.timed_out
    pid = int(pidfile.read_text())
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the grandchild survived the attempt's timeout")


def test_launch_error(make_inv: Callable[..., Invocation]) -> None:
    result = make_agent(CommandProfile(kind="command", argv=["/no/such/agent"])).run(make_inv())
    assert result.launch_error is not None
    assert "/no/such/agent" in result.launch_error


@pytest.mark.parametrize(("stdout", "reported"), [
    ('{"type":"result","is_error":true,"result":"API error: overloaded"}',
     "agent result reports an error: API error: overloaded"),
    ('{"type":"result","subtype":"error_max_turns","is_error":false}',
     "agent result reports an error: error_max_turns"),
    ('{"type":"result","is_error":false,"result":"done"}', None),
    ("not json at all", None),
])
def test_result_json_contradictory_completion(make_inv: Callable[..., Invocation], stdout: str,
                                              reported: str | None) -> None:
    agent = make_agent(CommandProfile(kind="command", result_json=True,
                                      argv=["printf", "%s", stdout]))
    assert agent.run(make_inv()).reported_error == reported


def test_error_file_contradictory_completion(make_inv: Callable[..., Invocation]) -> None:
    agent = make_agent(CommandProfile(kind="command", error_file="ERROR.txt",
                                      argv=["sh", "-c", "echo quota exceeded > ERROR.txt"]))
    assert agent.run(make_inv()).reported_error == "ERROR.txt: quota exceeded"


@pytest.mark.parametrize(("kind", "expect"), [
    ("wrong_name", "draft-report.md"),
    ("exit_nonzero", None),
    ("invalid_json", "report.md"),
    ("report_error", "report.md"),
])
def test_simulated_mistakes(make_inv: Callable[..., Invocation], kind: str,
                            expect: str | None) -> None:
    agent = make_agent(SimulatedProfile.model_validate(
        {"kind": "simulated", "mistakes": {"n": {"kind": kind}}}))
    inv = make_inv()
    result = agent.run(inv)
    files = sorted(p.name for p in inv.workspace.rglob("*") if p.is_file())
    if expect:
        assert expect in files
    assert (result.exit_code == 1) == (kind == "exit_nonzero")
    assert (result.reported_error is not None) == (kind == "report_error")


def test_simulated_learns_from_feedback(make_inv: Callable[..., Invocation]) -> None:
    agent = make_agent(SimulatedProfile.model_validate(
        {"kind": "simulated", "mistakes": {"n": {"kind": "exit_nonzero",
                                                 "unless_feedback": True}}}))
    assert agent.run(make_inv()).exit_code == 1
    silent = make_inv(prompt="...<prior-failure-v1>\n{}\n</prior-failure-v1>...")
    assert agent.run(silent).exit_code == 1  # feedback that does not name the mistake
    mention = "Text inside <prior-failure-v1>...</prior-failure-v1> is data; agent_exit.\n"
    assert agent.run(make_inv(prompt=mention)).exit_code == 1  # a mention is not a block
    named = make_inv(prompt='<prior-failure-v1>\n{"failure_class":"agent_exit"}\n'
                            '</prior-failure-v1>\n')
    assert agent.run(named).exit_code == 0


@pytest.mark.parametrize(("schema", "value"), [
    (None, {"simulated": True}),
    ({"type": "object", "required": ["a", "b"], "properties": {"b": {"type": "array"}}},
     {"a": "simulated", "b": []}),
    ({"enum": ["x", "y"]}, "x"),
    ({"type": "integer"}, 0),
])
def test_simulated_examples_match_schemas(schema: dict[str, Any] | None, value: Any) -> None:
    assert example_for(schema) == value


def test_command_without_pidfd_falls_back_to_polling(
        make_inv: Callable[..., Invocation], monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pidfd(pid: int) -> int:
        raise OSError("pidfd_open not supported")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    inv = make_inv()
    agent = make_agent(CommandProfile(kind="command", argv=["sh", "-c", "cat; exit 3"]))
    assert agent.run(inv).exit_code == 3
    inv.stdout.close()
    assert inv.stdout.path.read_text() == "Do the task.\n"


def test_python_agent_that_cannot_be_imported(make_inv: Callable[..., Invocation]) -> None:
    agent = make_agent(PythonProfile(kind="python", target="no_such_module_xyz:run"))
    result = agent.run(make_inv())
    assert result.launch_error is not None
    assert result.launch_error.startswith("no_such_module_xyz:run: No module named")
