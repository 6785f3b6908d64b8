"""Pre-flight checks and decisions, with real programs (python one-liners as preflight
commands, loopback sockets for http); the real claude and codex in test_agent_clis.py."""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime.agents import AnyProfile
from runtime.cli import main
from runtime.failures import FailureClass as F
from runtime.plan.compile import plan_topology
from runtime.plan.manifest import Manifest
from runtime.plan.profiles import CommandProfile, HttpProfile, PythonProfile, SimulatedProfile
from runtime.prompt.redact import Redactor
from runtime.run import preflight
from runtime.run.preflight import PreflightError, check_profile, decide, preflight_run
from runtime.run.records import RunSettings
from tests.conftest import Project, make_topology

PY = sys.executable


def script(code: str) -> list[str]:
    return [PY, "-c", code]


NOT_LOGGED_IN = script("import sys; print('Not logged in'); sys.exit(1)")
LOGGED_IN = script("print('Logged in using an API key')")


def command(preflight_argv: list[str] | None = None, argv0: str = PY) -> CommandProfile:
    return CommandProfile(kind="command", argv=[argv0, "agent.py"], preflight=preflight_argv)


def check(profile: AnyProfile, env: dict[str, str] | None = None) -> preflight.ProfileCheck:
    return check_profile("p", profile, env if env is not None else {"PATH": "/usr/bin:/bin"},
                         Redactor())


def test_missing_program_is_a_launch_error_with_the_install_command() -> None:
    c = check(command(argv0="claude"), {"PATH": "/nonexistent"})
    assert (c.failure, c.summary) == (F.LAUNCH_ERROR, "claude: not found on PATH")
    assert c.fix == "install it: npm install -g @anthropic-ai/claude-code"


def test_missing_preflight_program_is_a_launch_error() -> None:
    c = check(command(["no-such-program-xyz", "status"]))
    assert (c.failure, c.summary) == (F.LAUNCH_ERROR,
                                      "preflight no-such-program-xyz: not found on PATH")


@pytest.mark.parametrize(("argv", "failure", "summary"), [
    (NOT_LOGGED_IN, F.AGENT_AUTH, "Not logged in"),
    (LOGGED_IN, None, "Logged in using an API key"),
    (script("import sys; sys.stderr.write('boom: the config is corrupt\\n'); sys.exit(3)"),
     F.AGENT_EXIT, "boom: the config is corrupt"),
    (None, None, "no preflight command"),
])
def test_preflight_command_is_read_like_an_attempt(argv: list[str] | None, failure: F | None,
                                                   summary: str) -> None:
    c = check(command(argv))
    assert (c.failure, c.summary) == (failure, summary)
    assert c.program == PY
    assert c.version is None  # --version only for claude and codex


def test_preflight_that_hangs_is_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preflight, "PREFLIGHT_TIMEOUT_S", 0.5)
    c = check(command(script("import time; time.sleep(60)")))
    assert (c.failure, c.summary) == (F.AGENT_TIMEOUT, f"{PY} -c import time; time.sleep(60) "
                                      "did not finish in 0.5 s")


def test_preflight_gets_the_agent_environment_only() -> None:
    """A variable the profile does not list never reaches the preflight command."""
    probe = script("import os, sys; print(os.environ.get('SECRET_X', 'absent')); "
                   "sys.exit(0)")
    env = {"PATH": "/usr/bin:/bin", "SECRET_X": "leaked-value-123"}
    assert check(command(probe), env).summary == "absent"


def test_summary_is_redacted() -> None:
    token = "ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"
    c = check(command(script(f"import sys; print('token {token} rejected'); sys.exit(1)")))
    assert token not in c.summary
    assert "REDACTED" in c.summary


def test_http_without_its_key_is_agent_auth() -> None:
    c = check(HttpProfile(kind="http", base_url="http://127.0.0.1:9/v1", model="m",
                          api_key_env="TEST_KEY_VAR"), {})
    assert (c.failure, c.summary, c.fix) == (F.AGENT_AUTH, "TEST_KEY_VAR is not set",
                                             "set TEST_KEY_VAR")


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def open_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def test_http_endpoint_refusing_connections_is_unreachable(closed_port: int) -> None:
    c = check(HttpProfile(kind="http", base_url=f"http://127.0.0.1:{closed_port}/v1",
                          model="m"))
    assert c.failure is F.AGENT_UNREACHABLE
    assert c.summary.startswith(f"cannot connect to 127.0.0.1:{closed_port}")


def test_doctor_names_every_profile_one_check_covers(
        project: Project, open_port: int, capsys: pytest.CaptureFixture[str]) -> None:
    """A new user's trial: thirteen http profiles (one endpoint, thirteen models) showed
    as one line named after the first."""
    data = make_topology({"a": [], "b": []}, a={"agent": "fast"}, b={"agent": "deep"})
    data["defaults"] = {"agent": "fast"}
    data["agents"] = {name: {"kind": "http", "base_url": f"http://127.0.0.1:{open_port}/v1",
                             "model": name} for name in ("fast", "deep")}
    project.write_topology(data)
    assert main(project.cli("doctor", str(project.topology))) == 0
    out = capsys.readouterr().out
    assert "ok    deep, fast: 127.0.0.1:" in out
    assert "used by   t: a (fast)" in out
    assert "used by   t: b (deep)" in out


def test_http_endpoint_accepting_connections_is_ready(open_port: int) -> None:
    c = check(HttpProfile(kind="http", base_url=f"http://127.0.0.1:{open_port}/v1", model="m"))
    assert c.ok
    assert c.summary == f"127.0.0.1:{open_port} accepts connections"


def test_python_target_that_cannot_be_found() -> None:
    c = check(PythonProfile(kind="python", target="no_such_module_xyz:run"))
    assert (c.failure, c.summary) == (F.LAUNCH_ERROR, "module no_such_module_xyz not found")
    assert check(PythonProfile(kind="python", target="tests.agent_scripts:write_all")).ok


def test_simulated_is_always_ready() -> None:
    assert check(SimulatedProfile(kind="simulated")).ok


def test_preflight_may_not_use_placeholders() -> None:
    with pytest.raises(ValueError, match="preflight runs before any node: no placeholders"):
        CommandProfile(kind="command", argv=["x"], preflight=["x", "{workspace}"])


# ---------------------------------------------------------------------------- decisions


def topo(**node_extra: Any) -> dict[str, Any]:
    t = make_topology({"a": [], "b": ["a"]}, **node_extra)
    t["agents"] = {"broken": {"kind": "command", "argv": [PY, "agent.py"],
                              "preflight": NOT_LOGGED_IN},
                   "good": {"kind": "command", "argv": [PY, "agent.py"], "preflight": LOGGED_IN},
                   "sim": {"kind": "simulated"}}
    t["defaults"] = {"agent": "broken"}
    return t


def manifest_of(project: Project, data: dict[str, Any]) -> Manifest:
    project.write_topology(data)
    return plan_topology(project.topology, project.prompts).manifest


def test_failing_primary_with_a_fallback_starts_there(project: Project) -> None:
    m = manifest_of(project, topo(a={"fallback": ["broken", "good"]}, b={"agent": "sim"}))
    checks = preflight.check_profiles(m.agents)
    d = decide(m, RunSettings(), {n: checks[n] for n in ("broken", "good", "sim")})
    assert d.moved == {"a": "good"}
    assert d.problems == []
    assert d.skip == {"broken": "broken: agent_auth: Not logged in"}


def test_failing_primary_without_a_fallback_refuses_the_run(project: Project) -> None:
    m = manifest_of(project, topo(b={"agent": "sim"}))
    with pytest.raises(PreflightError) as err:
        preflight_run(m, RunSettings())
    assert str(err.value) == (
        "pre-flight: profile broken cannot run (agent_auth: Not logged in); nodes with no "
        "fallback that can: a\n(--no-preflight runs anyway)")


@pytest.mark.parametrize("settings", [RunSettings(no_fallback=True),
                                      RunSettings(agent="broken")])
def test_no_fallback_and_agent_leave_nothing_to_start_on(project: Project,
                                                          settings: RunSettings) -> None:
    m = manifest_of(project, topo(a={"fallback": ["good"]}, b={"fallback": ["good"]}))
    with pytest.raises(PreflightError, match="nodes with no fallback that can: a, b"):
        preflight_run(m, settings)


def test_profiles_no_node_uses_are_not_checked(project: Project) -> None:
    m = manifest_of(project, topo(a={"agent": "sim"}, b={"agent": "sim"}))
    assert preflight.profiles_in_use(m, RunSettings()) == {"sim": ["a", "b"]}
    assert preflight_run(m, RunSettings())[1].skip == {}


# ---------------------------------------------------------------------------- CLI


def test_doctor_prints_each_profile_and_the_fix(project: Project,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    project.write_topology(topo(a={"fallback": ["good"]}))
    assert main(project.cli("doctor", str(project.topology))) == 1
    out = capsys.readouterr().out
    assert "FAIL  broken: agent_auth: Not logged in" in out
    assert "ok    good: Logged in using an API key" in out
    assert "t: `run` would refuse: profile broken cannot run" in out
    assert main(project.cli("doctor", str(project.topology), "--agent", "good")) == 0
    assert "broken" not in capsys.readouterr().out


def test_doctor_json(project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    project.write_topology(topo(a={"fallback": ["good"]}, b={"agent": "sim"}))
    assert main(project.cli("doctor", str(project.topology), "--json")) == 1
    obj = json.loads(capsys.readouterr().out)
    assert obj["ok"] is False
    assert {p["profile"]: p["failure"] for p in obj["profiles"]} == {
        "broken": "agent_auth", "good": None, "sim": None}
    assert obj["topologies"]["t"]["moved"] == {"a": "good"}


def test_doctor_names_what_it_cannot_read(project: Project,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(project.cli("doctor", str(project.root / "nothing-here"))) == 2
    assert "nothing-here: not a topology file, a directory of *.yaml or a plan directory" \
        in capsys.readouterr().err


def test_doctor_refuses_an_unknown_agent(project: Project,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    project.write_topology(topo())
    assert main(project.cli("doctor", str(project.topology), "--agent", "nope")) == 2
    assert "--agent nope: topology " in capsys.readouterr().err


def test_run_refuses_before_the_first_node(project: Project,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    project.write_topology(topo(b={"agent": "sim"}))
    assert main(project.cli("run", str(project.topology))) == 2
    err = capsys.readouterr().err
    assert "pre-flight: profile broken cannot run (agent_auth: Not logged in)" in err
    assert not (project.artifacts / "runs").exists()


def test_run_no_preflight_tries_anyway(project: Project,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    project.write_topology(topo(b={"agent": "sim"}))
    assert main(project.cli("run", str(project.topology), "--no-preflight", "--json")) == 1
    node = json.loads(capsys.readouterr().out)["nodes"]["a"]
    assert node["status"] == "failed"
    assert "can't open file" in node["summary"]  # python's own words, not "exit status 2"


def test_batch_refuses_before_anything_runs(project: Project,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    project.write_topology(topo(b={"agent": "sim"}))
    assert main(project.cli("batch", str(project.topology), "--batch-id", "b1")) == 2
    assert "t: profile broken cannot run (agent_auth: Not logged in)" in capsys.readouterr().err
    assert not (project.artifacts / "runs").exists()


def test_batch_no_preflight_tries_anyway(project: Project) -> None:
    project.write_topology(topo(b={"agent": "sim"}))
    assert main(project.cli("batch", str(project.topology), "--batch-id", "b2",
                            "--no-preflight", "--no-progress")) == 1
    assert (project.artifacts / "runs" / "b2-t").is_dir()


def test_shipped_profiles_declare_their_preflight() -> None:
    root = Path(__file__).resolve().parent.parent
    for path in sorted((root / "topologies").glob("*.yaml")):
        manifest = plan_topology(path, root / "prompts").manifest
        for name, profile in manifest.agents.items():
            if isinstance(profile, CommandProfile) and profile.argv[0] in ("claude", "codex"):
                expected = {"claude": ["claude", "auth", "status"],
                            "codex": ["codex", "login", "status"]}[profile.argv[0]]
                assert profile.preflight == expected, f"{path.name}: {name}"


@pytest.mark.parametrize(("env", "reached"), [
    ({"HTTPS_PROXY": "http://proxy:3128"}, None),  # goes another way: not ours to check
    ({"CLAUDE_CODE_USE_BEDROCK": "1"}, None),
    ({"ANTHROPIC_BASE_URL": "http://127.0.0.1:{closed}"}, "cannot connect to 127.0.0.1:{closed}"),
    ({"ANTHROPIC_BASE_URL": "http://127.0.0.1:{open}"}, None),
])
def test_claude_endpoint_is_checked_the_way_claude_would_go(
        env: dict[str, str], reached: str | None, closed_port: int, open_port: int) -> None:
    ports = {"closed": closed_port, "open": open_port}
    got = preflight._claude_endpoint({k: v.format(**ports) for k, v in env.items()})
    if reached is None:
        assert got is None
    else:
        assert got is not None
        assert got.startswith(reached.format(**ports))


def test_a_fallback_gets_one_attempt_when_pre_flight_leaves_the_primary_out(
        project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    """The README's "one attempt each" holds whether or not pre-flight ran (before: with
    the primary skipped, the first fallback took the primary's max_attempts)."""
    data = topo(a={"fallback": ["failing", "sim"], "max_attempts": 3}, b={"agent": "sim"})
    data["agents"]["failing"] = {"kind": "command", "argv": ["sh", "-c", "exit 2"],
                                 "sandbox": False}
    project.write_topology(data)
    for run_id, flags in (("pre", ()), ("nopre", ("--no-preflight",))):
        assert main(project.cli("run", str(project.topology), "--run-id", run_id,
                                *flags)) == 0, capsys.readouterr().err
        ledger = (project.artifacts / "runs" / run_id / "ledger.jsonl").read_text()
        started = [json.loads(line) for line in ledger.splitlines()
                   if '"attempt.started"' in line and '"node":"a"' in line]
        profiles = [e["profile"] for e in started]
        assert profiles[-2:] == ["failing", "sim"], (run_id, profiles)
        assert profiles.count("failing") == 1, (run_id, profiles)


def test_run_starts_a_node_on_its_fallback(project: Project,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    project.write_topology(topo(a={"fallback": ["sim"]}, b={"agent": "sim"}))
    code = main(project.cli("run", str(project.topology), "--run-id", "r1"))
    err = capsys.readouterr().err
    if "skip_profiles" not in RunSettings.model_fields:  # the executor's seam is not there
        assert code == 2
        assert ("pre-flight: broken: agent_auth: Not logged in; nodes a would have to start "
                "on a fallback, which this runtime cannot do yet") in err
        return
    assert code == 0
    assert "pre-flight: skipping broken: agent_auth: Not logged in" in err
    assert "pre-flight: starting on a fallback: a on sim" in err
    ledger = (project.artifacts / "runs" / "r1" / "ledger.jsonl").read_text().splitlines()
    started = [json.loads(line) for line in ledger if '"attempt.started"' in line]
    assert [(e["node"], e["profile"]) for e in started] == [("a", "sim"), ("b", "sim")]
    settings = json.loads(ledger[0])["settings"]
    assert settings["skip_profiles"] == {"broken": "broken: agent_auth: Not logged in"}
