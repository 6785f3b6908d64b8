"""Shared builders: small projects (topology + prompts) written under tmp_path."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

if TYPE_CHECKING:
    from runtime.run.start import RunResult

REPO = Path(__file__).resolve().parent.parent
AGENT_CLIS = REPO / ".ci" / "agent-clis" / "node_modules" / ".bin"


def pytest_configure(config: pytest.Config) -> None:
    """The pinned claude and codex CLIs that .ci/components installs come first on PATH,
    for the tests and every process they start (a global install may be another version)."""
    if AGENT_CLIS.is_dir():
        os.environ["PATH"] = f"{AGENT_CLIS}{os.pathsep}{os.environ.get('PATH', '')}"

DEFAULT_TEMPLATE = "Task for {{ node.id }} in {{ topology.name }}.\n"


@dataclass
class Project:
    root: Path

    @property
    def prompts(self) -> Path:
        return self.root / "prompts"

    @property
    def artifacts(self) -> Path:
        return self.root / "artifacts"

    @property
    def topology(self) -> Path:
        return self.root / "topology.yaml"

    def write_topology(self, data: Mapping[str, Any] | str) -> Path:
        text = data if isinstance(data, str) else yaml.safe_dump(dict(data), sort_keys=False)
        self.topology.write_text(text)
        return self.topology

    def template(self, name: str, text: str) -> None:
        path = self.prompts / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def cli(self, *argv: str) -> list[str]:
        """Common flags pointing the CLI at this project."""
        return [*argv, "--prompts", str(self.prompts), "--artifacts", str(self.artifacts)]


def make_topology(
    dag: Mapping[str, list[str]], *, name: str = "t", **node_extra: Mapping[str, Any]
) -> dict[str, Any]:
    """A topology dict from ``{"a": [], "b": ["a"]}``; each node gets one json artifact."""
    nodes = []
    for nid, needs in dag.items():
        node: dict[str, Any] = {"id": nid, "prompt": "task.md.j2", "needs": list(needs),
                                "artifacts": [{"path": f"{nid}.json", "kind": "json"}]}
        node.update(node_extra.get(nid.replace("-", "_"), {}))
        nodes.append(node)
    return {"schema_version": 1, "name": name, "agents": {"sim": {"kind": "simulated"}},
            "defaults": {"agent": "sim"}, "nodes": nodes}


@pytest.fixture
def project(tmp_path: Path) -> Project:
    p = Project(tmp_path / "proj")
    p.root.mkdir()
    p.template("task.md.j2", DEFAULT_TEMPLATE)
    return p


def python_agents(*names: str) -> dict[str, Any]:
    return {n: {"kind": "python", "target": f"tests.agent_scripts:{n}"} for n in names}


def plan_dir_for(project: Project, topo: Mapping[str, Any]) -> Path:
    from runtime.plan.compile import plan_topology, write_plan

    project.write_topology(topo)
    return write_plan(plan_topology(project.topology, project.prompts), project.artifacts)


def run_topology(project: Project, topo: Mapping[str, Any], **settings: Any) -> RunResult:
    """Plan and run in-process; returns the RunResult."""
    from runtime.prompt.redact import Redactor
    from runtime.run.records import RunSettings
    from runtime.run.start import Hooks, start_run

    hooks = settings.pop("hooks", None) or Hooks()
    run_id = settings.pop("run_id", "test-run")
    redactor = settings.pop("redactor", None) or Redactor.from_environment({})
    return start_run(plan_dir_for(project, topo), project.artifacts, RunSettings(**settings),
                     run_id=run_id, redactor=redactor, hooks=hooks)
