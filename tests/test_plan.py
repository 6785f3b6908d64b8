from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from runtime.digest import blake3_hex, canonical_json
from runtime.plan.compile import plan_topology, write_plan
from runtime.prompt.assemble import constant_digests
from tests.conftest import REPO, Project, make_topology

SHIPPED = sorted((REPO / "topologies").glob("*.yaml"))


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.mark.parametrize("topology", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_planning_twice_gives_byte_identical_directories(topology: Path, tmp_path: Path) -> None:
    dirs = [write_plan(plan_topology(topology, REPO / "prompts"), tmp_path / name)
            for name in ("one", "two")]
    assert dirs[0].name == dirs[1].name
    assert _tree(dirs[0]) == _tree(dirs[1])
    raw = (dirs[0] / "plan.json").read_bytes()
    assert blake3_hex(raw).startswith(dirs[0].name)
    assert canonical_json(json.loads(raw)) == raw
    for forbidden in (str(tmp_path), str(REPO), "/home/", "/root/", "/tmp/"):
        assert forbidden.encode() not in raw


def test_prompt_files_are_read_only_and_content_addressed(project: Project) -> None:
    plan = plan_topology(project.write_topology(make_topology({"a": [], "b": ["a"]})),
                         project.prompts)
    plan_dir = write_plan(plan, project.artifacts)
    files = sorted((plan_dir / "prompts").iterdir())
    assert len(files) == 2
    for f in [*files, plan_dir / "plan.json"]:
        assert stat.S_IMODE(f.stat().st_mode) == 0o444
    for f in files:
        assert blake3_hex(f.read_bytes()) + ".md" == f.name


def test_identical_prompts_share_one_file(project: Project) -> None:
    project.template("task.md.j2", "Same text for every node.\n")
    plan = plan_topology(project.write_topology(make_topology({"a": [], "b": [], "c": ["a"]})),
                         project.prompts)
    assert len(plan.prompts) == 1
    assert len({n.prompt_digest for n in plan.manifest.nodes.values()}) == 1


@pytest.mark.parametrize(("field", "value"), [
    ("retry_feedback", True), ("max_attempts", 5), ("retry_on", ["agent_timeout"]),
])
def test_retry_settings_change_plan_digest_not_prompt_digests(
        project: Project, field: str, value: object) -> None:
    base = make_topology({"a": [], "b": ["a"]})
    toggled = make_topology({"a": [], "b": ["a"]}, b={field: value})
    p1 = plan_topology(project.write_topology(base), project.prompts)
    p2 = plan_topology(project.write_topology(toggled), project.prompts)
    assert p1.digest != p2.digest
    assert {n: v.prompt_digest for n, v in p1.manifest.nodes.items()} == \
        {n: v.prompt_digest for n, v in p2.manifest.nodes.items()}


def test_manifest_resolves_defaults_and_carries_constants(project: Project) -> None:
    topo = make_topology({"a": [], "b": ["a"]}, b={"max_attempts": 4, "retry_feedback": True})
    topo["defaults"].update(max_attempts=3, timeout_s=60)
    m = plan_topology(project.write_topology(topo), project.prompts).manifest
    assert (m.nodes["a"].max_attempts, m.nodes["a"].retry_feedback) == (3, False)
    assert (m.nodes["b"].max_attempts, m.nodes["b"].retry_feedback) == (4, True)
    assert m.nodes["a"].timeout_s == 60
    assert m.nodes["a"].agent == "sim"
    assert m.constants == constant_digests()
    assert "simulated" in m.agents


def test_a_profiles_timeout_is_its_nodes_default(project: Project) -> None:
    """A new user's trial: a profile's timeout_s ("default per-attempt timeout for nodes
    on this profile") was ignored; its http nodes ran on the 1800 s default."""
    topo = make_topology({"own": [], "by-profile": [], "by-default": []},
                         own={"timeout_s": 5, "agent": "quick"},
                         by_profile={"agent": "quick"})
    topo["agents"]["quick"] = {"kind": "simulated", "timeout_s": 8}
    topo["defaults"]["timeout_s"] = 60
    nodes = plan_topology(project.write_topology(topo), project.prompts).manifest.nodes
    assert {n: nodes[n].timeout_s for n in nodes} == {"own": 5, "by-profile": 8,
                                                      "by-default": 60}


def test_var_override_changes_prompts(project: Project) -> None:
    project.template("task.md.j2", "target={{ vars.target }}\n")
    topo = make_topology({"a": []})
    topo["vars"] = {"target": "x"}
    path = project.write_topology(topo)
    a = plan_topology(path, project.prompts)
    b = plan_topology(path, project.prompts, {"target": "y"})
    assert a.manifest.nodes["a"].prompt_digest != b.manifest.nodes["a"].prompt_digest
    assert b.prompts[b.manifest.nodes["a"].prompt_digest] == b"target=y\n"


def test_replanning_into_an_existing_directory_reuses_it(project: Project) -> None:
    plan = plan_topology(project.write_topology(make_topology({"a": []})), project.prompts)
    first = write_plan(plan, project.artifacts)
    assert write_plan(plan, project.artifacts) == first
    assert [p.name for p in (project.artifacts / "plans").iterdir()] == [first.name]


@pytest.mark.parametrize("topology", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_manifest_bytes_are_stable_under_reserialisation(topology: Path) -> None:
    """plan.json is built as plain data; parsing and re-dumping it must give the same
    canonical bytes, or a reader that re-serialises would compute another digest."""
    from runtime.plan.manifest import Manifest

    plan = plan_topology(topology, REPO / "prompts")
    assert Manifest.model_validate_json(plan.manifest_bytes).to_bytes() == plan.manifest_bytes
    assert plan.manifest.to_bytes() == plan.manifest_bytes


@pytest.mark.parametrize("setting", [{"render_timeout_s": 10}, {"render_max_bytes": 2048}])
def test_render_bounds_enter_the_digest_only_when_set(project: Project,
                                                      setting: dict[str, int]) -> None:
    base = make_topology({"a": []})
    plain = plan_topology(project.write_topology(base), project.prompts)
    base["defaults"].update(setting)
    bounded = plan_topology(project.write_topology(base), project.prompts)
    assert plain.manifest.nodes["a"].prompt_digest == bounded.manifest.nodes["a"].prompt_digest
    assert plain.digest != bounded.digest
    assert plain.manifest.topology.digest != bounded.manifest.topology.digest
