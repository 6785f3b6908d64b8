"""The shipped profiles against the real claude and codex CLIs (the versions pinned in
.ci/agent-clis/package.json, installed by .ci/run), as a new user meets them: an empty
HOME, no key, no network beyond the package registries."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from runtime.cli import main

REPO = Path(__file__).resolve().parent.parent
CLI_BIN = REPO / ".ci" / "agent-clis" / "node_modules" / ".bin"
KEYS = ("ANTHROPIC_API_KEY", "OPENAI_API_KEY", "CODEX_API_KEY", "CLAUDE_CODE_OAUTH_TOKEN")


@pytest.fixture
def new_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The real CLIs on PATH, an empty HOME, no key. Returns the artifacts root."""
    path = os.pathsep.join([str(CLI_BIN), os.environ.get("PATH", "")])
    missing = [p for p in ("claude", "codex") if shutil.which(p, path=path) is None]
    if missing:
        message = (f"{', '.join(missing)} not installed: .ci/run installs the pinned CLIs "
                   "(npm install --prefix .ci/agent-clis --no-package-lock)")
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("PATH", path)
    monkeypatch.setenv("HOME", str(home))
    for key in KEYS:
        monkeypatch.delenv(key, raising=False)
    return tmp_path / "artifacts"


def cli(artifacts: Path, *argv: str) -> int:
    return main([*argv, "--prompts", str(REPO / "prompts"), "--artifacts", str(artifacts)])


def with_fallback(tmp_path: Path, shipped: str, primary: str) -> Path:
    """A shipped topology, unchanged but for every node on ``primary`` with the shipped
    simulated ``demo`` profile as its fallback."""
    data: dict[str, Any] = yaml.safe_load((REPO / "topologies" / shipped).read_text())
    data["agents"]["demo"] = {"kind": "simulated"}  # no scripted mistakes: it succeeds
    for node in data["nodes"]:
        node["agent"], node["fallback"] = primary, ["demo"]
    out = tmp_path / shipped
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def test_claude_not_logged_in_is_agent_auth_everywhere(
        new_user: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No pre-flight: the attempt itself must say why. Exit 1 with the reason only in
    the result JSON on stdout (the incident): agent_auth, one attempt, not retried."""
    topology = str(REPO / "topologies" / "solidity-audit.yaml")
    code = cli(new_user, "run", topology, "--agent", "claude", "--no-preflight",
               "--run-id", "r1")
    out = capsys.readouterr().out
    assert code == 1
    assert "recon                    failed    attempts 1: 1:agent_auth" in out
    assert "last error: Not logged in · Please run /login" in out
    run_dir = new_user / "runs" / "r1"
    attempt = json.loads((run_dir / "nodes/recon/attempts/1/attempt.json").read_text())
    assert (attempt["outcome"], attempt["summary"]) == ("agent_auth",
                                                        "Not logged in · Please run /login")
    assert cli(new_user, "show", str(run_dir)) == 1
    assert "Not logged in · Please run /login" in capsys.readouterr().out
    assert "Not logged in · Please run /login" in (run_dir / "report.html").read_text()


def test_codex_not_logged_in_is_refused_by_preflight(
        new_user: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """codex exec would loop on "Reconnecting..." until the node's timeout (1800 s)."""
    topology = str(REPO / "topologies" / "web-service-review.yaml")
    assert cli(new_user, "run", topology, "--agent", "codex") == 2
    err = capsys.readouterr().err
    assert "profile codex cannot run (agent_auth: Not logged in)" in err
    assert "fix: run `codex login`" in err
    assert not (new_user / "runs").exists()


def test_doctor_reports_both_clis(new_user: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(new_user, "doctor", str(REPO / "topologies" / "web-service-review.yaml")) == 1
    out = capsys.readouterr().out
    assert "FAIL  claude: agent_auth: Not logged in" in out
    assert "FAIL  codex: agent_auth: Not logged in" in out
    version = json.loads((REPO / ".ci/agent-clis/package.json").read_text())["dependencies"]
    assert f"({version['@anthropic-ai/claude-code']} (Claude Code))" in out
    assert f"(codex-cli {version['@openai/codex']})" in out


def test_claude_with_a_key_and_no_way_out_is_unreachable_at_preflight(
        new_user: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Logged in by key (claude auth status passes), but the endpoint refuses: each
    attempt would wait ~190 s for claude's own ENOTFOUND (recorded fixture)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data: dict[str, Any] = yaml.safe_load(
        (REPO / "topologies" / "solidity-audit.yaml").read_text())
    data["agents"]["claude"]["env"] = ["ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL"]
    topology = tmp_path / "solidity-audit.yaml"
    topology.write_text(yaml.safe_dump(data, sort_keys=False))
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-api03-" + "f" * 40)
    monkeypatch.setenv("ANTHROPIC_BASE_URL", f"http://127.0.0.1:{port}")
    assert cli(new_user, "doctor", str(topology), "--agent", "claude") == 1
    out = capsys.readouterr().out
    assert f"FAIL  claude: agent_unreachable: cannot connect to 127.0.0.1:{port}" in out
    assert "sk-ant-api03-" not in out


def test_claude_not_logged_in_moves_to_the_fallback_at_once(
        new_user: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No pre-flight: the first attempt's agent_auth moves the node to its fallback,
    never a second attempt on claude."""
    topology = with_fallback(tmp_path, "solidity-audit.yaml", "claude")
    assert cli(new_user, "run", str(topology), "--no-preflight", "--run-id", "f1") == 0
    capsys.readouterr()
    assert cli(new_user, "show", "f1") == 0
    out = capsys.readouterr().out
    assert "recon                    succeeded attempts 2: 1:agent_auth[claude], " \
           "2:succeeded[demo]" in out


@pytest.mark.parametrize(("shipped", "primary"), [("solidity-audit.yaml", "claude"),
                                                   ("web-service-review.yaml", "codex")])
def test_preflight_starts_every_node_on_the_fallback(
        new_user: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], shipped: str,
        primary: str) -> None:
    topology = with_fallback(tmp_path, shipped, primary)
    assert cli(new_user, "run", str(topology), "--run-id", "f2", "--json") == 0
    captured = capsys.readouterr()
    assert f"pre-flight: skipping {primary}: agent_auth: Not logged in" in captured.err
    nodes = json.loads(captured.out)["nodes"]
    assert {n["status"] for n in nodes.values()} == {"succeeded"}
    assert {n["attempts"] for n in nodes.values()} == {1}
    started = [json.loads(line) for line in (new_user / "runs/f2/ledger.jsonl").read_text()
               .splitlines() if '"attempt.started"' in line]
    assert {e["profile"] for e in started} == {"demo"}
