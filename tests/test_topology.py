from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from runtime.errors import TopologyError
from runtime.plan.topology import load_topology
from tests.conftest import Project, make_topology

Mutation = Callable[[dict[str, Any]], None]


def _node(t: dict[str, Any], i: int) -> dict[str, Any]:
    node: dict[str, Any] = t["nodes"][i]
    return node


CASES: list[tuple[str, Mutation, str, str]] = [
    ("unknown key", lambda t: _node(t, 0).update(retries=3), "nodes[0].retries",
     "unknown key; see `runtime schema`"),
    ("unknown top-level key", lambda t: t.update(colour="red"), "colour", "unknown key"),
    ("an id ending in a newline", lambda t: _node(t, 2).update(id="c\n"), "nodes[2].id",
     "ids must match"),
    ("a list as a var", lambda t: t.update(vars={"target": [1, 2]}), "vars.target",
     "a var is a string, a number or true/false"),
    ("misspelt node key", lambda t: _node(t, 0).update(retry_feedbak=True),
     "nodes[0].retry_feedbak", "unknown key (did you mean retry_feedback?)"),
    ("misspelt top-level key", lambda t: t.update(defualts={}), "defualts",
     "unknown key (did you mean defaults?)"),
    ("misspelt artifact key", lambda t: _node(t, 0).update(artifacts=[{"path": "x",
                                                                       "requird": False}]),
     "nodes[0].artifacts[0].requird", "unknown key (did you mean required?)"),
    ("misspelt profile key", lambda t: t.update(agents={"c": {"kind": "command",
                                                              "argvs": ["x"]}}),
     "agents.c.argvs", "unknown key (did you mean argv?)"),
    ("wrong type", lambda t: _node(t, 0).update(max_attempts="many"), "nodes[0].max_attempts",
     "valid integer"),
    ("missing field", lambda t: _node(t, 0).pop("prompt"), "nodes[0].prompt",
     "required field is missing"),
    ("duplicate id", lambda t: _node(t, 1).update(id="a"), "nodes[1].id",
     "duplicate node id 'a' (first at nodes[0])"),
    ("unknown needs", lambda t: _node(t, 1).update(needs=["zz"]), "nodes[1].needs[0]",
     "unknown node 'zz'; known ids: a, b, c"),
    ("self loop", lambda t: _node(t, 0).update(needs=["a"]), "nodes[0].needs[0]",
     "node 'a' needs itself"),
    ("cycle", lambda t: _node(t, 0).update(needs=["c"]), "nodes[0].needs",
     "cycle: "),
    ("bad id", lambda t: _node(t, 2).update(id="Bad Id"), "nodes[2].id",
     "ids must match [a-z0-9][a-z0-9_-]*"),
    ("template escapes", lambda t: _node(t, 0).update(prompt="../x.md.j2"), "nodes[0].prompt",
     "'..' escapes the root"),
    ("absolute template", lambda t: _node(t, 0).update(prompt="/etc/passwd"), "nodes[0].prompt",
     "absolute paths are not allowed"),
    ("missing template", lambda t: _node(t, 0).update(prompt="nope.md.j2"), "nodes[0].prompt",
     "template 'nope.md.j2' not found under prompts root"),
    ("artifact escapes", lambda t: _node(t, 0).update(artifacts=[{"path": "../../x"}]),
     "nodes[0].artifacts[0].path", "'..' escapes the root"),
    ("absolute artifact", lambda t: _node(t, 0).update(artifacts=[{"path": "/tmp/x"}]),
     "nodes[0].artifacts[0].path", "absolute paths are not allowed"),
    ("backslash artifact", lambda t: _node(t, 0).update(artifacts=[{"path": "a\\b"}]),
     "nodes[0].artifacts[0].path", "use '/' separators"),
    ("bad artifact kind", lambda t: _node(t, 0).update(artifacts=[{"path": "x", "kind": "exe"}]),
     "nodes[0].artifacts[0].kind", "'file', 'json' or 'sarif'"),
    ("schema on a sarif artifact", lambda t: _node(t, 0).update(
        artifacts=[{"path": "x.sarif", "kind": "sarif", "schema": {"type": "object"}}]),
     "nodes[0].artifacts[0]", "kind sarif is checked against the SARIF 2.1.0 schema"),
    ("bad json schema", lambda t: _node(t, 0).update(
        artifacts=[{"path": "x", "kind": "json", "schema": {"type": "nonsense"}}]),
     "nodes[0].artifacts[0].schema", "not a valid JSON Schema"),
    ("agent without profile", lambda t: _node(t, 1).update(agent="gpt"), "nodes[1].agent",
     "no agent profile 'gpt'; known: sim, simulated"),
    ("fallback without profile", lambda t: _node(t, 1).update(fallback=["x"]),
     "nodes[1].fallback", "no agent profile 'x'"),
    ("default agent without profile", lambda t: t["defaults"].update(agent="gpt"),
     "defaults.agent", "no agent profile 'gpt'"),
    ("bad agent kind", lambda t: t["agents"].update(x={"kind": "magic"}), "agents.x",
     "agent kind must be one of: command, http, python, simulated"),
    ("agent field", lambda t: t["agents"].update(x={"kind": "command", "argv": []}),
     "agents.x.argv", "at least 1 item"),
    ("retry_on class", lambda t: t["defaults"].update(retry_on=["flaky"]),
     "defaults.retry_on[0]", "'agent_exit'"),
    ("preamble bound", lambda t: _node(t, 0).update(feedback_max_bytes=40000),
     "nodes[0].feedback_max_bytes", "less than or equal to 32768"),
    ("schema version", lambda t: t.update(schema_version=2), "schema_version", "1"),
]


@pytest.mark.parametrize(("label", "mutate", "where", "message"), CASES,
                         ids=[c[0] for c in CASES])
def test_each_problem_class_is_named(project: Project, label: str, mutate: Mutation,
                                     where: str, message: str) -> None:
    topo = make_topology({"a": [], "b": ["a"], "c": ["b"]})
    mutate(topo)
    path = project.write_topology(topo)
    with pytest.raises(TopologyError) as info:
        load_topology(path, project.prompts)
    matching = [p for p in info.value.problems if p.where == where]
    assert matching, f"{label}: no problem at {where}: {info.value}"
    assert message in matching[0].message
    assert not matching[0].message.startswith("Value error, ")  # pydantic's own wording
    assert matching[0].file == str(path)
    assert matching[0].line > 0 or where.startswith("vars")


def test_cycle_is_printed(project: Project) -> None:
    topo = make_topology({"a": ["c"], "b": ["a"], "c": ["b"], "d": []})
    path = project.write_topology(topo)
    with pytest.raises(TopologyError) as info:
        load_topology(path, project.prompts)
    (problem,) = info.value.problems
    cycle = problem.message.removeprefix("cycle: ").split(" -> ")
    assert cycle[0] == cycle[-1]
    assert sorted(cycle[:-1]) == ["a", "b", "c"]


def test_all_problems_reported_at_once_sorted_and_counted(project: Project) -> None:
    topo = make_topology({"a": [], "b": ["zz"], "c": ["c"]})
    _node(topo, 0)["bogus"] = 1
    _node(topo, 1)["agent"] = "nobody"
    path = project.write_topology(topo)
    with pytest.raises(TopologyError) as info:
        load_topology(path, project.prompts)
    err = info.value
    # An unknown key (a type error) does not hide the graph or reference problems.
    assert sorted(p.where for p in err.problems) == [
        "nodes[0].bogus", "nodes[1].agent", "nodes[1].needs[0]", "nodes[2].needs[0]"]
    assert str(err).splitlines()[0] == f"{path}: 4 problems"
    lines = [p.line for p in err.problems]
    assert lines == sorted(lines)


def test_agent_and_template_problems_together(project: Project) -> None:
    topo = make_topology({"a": [], "b": ["a"]})
    _node(topo, 0)["agent"] = "nobody"
    _node(topo, 1)["prompt"] = "missing.md.j2"
    path = project.write_topology(topo)
    with pytest.raises(TopologyError) as info:
        load_topology(path, project.prompts)
    assert [p.where for p in info.value.problems] == ["nodes[0].agent", "nodes[1].prompt"]


def test_symlinked_template_outside_root_is_refused(project: Project, tmp_path: Path) -> None:
    outside = tmp_path / "secret.md.j2"
    outside.write_text("secret")
    os.symlink(outside, project.prompts / "link.md.j2")
    topo = make_topology({"a": []})
    _node(topo, 0)["prompt"] = "link.md.j2"
    with pytest.raises(TopologyError, match=r"resolves outside the prompts root"):
        load_topology(project.write_topology(topo), project.prompts)


def test_var_overrides(project: Project) -> None:
    topo = make_topology({"a": []})
    topo["vars"] = {"target": "x"}
    path = project.write_topology(topo)
    assert load_topology(path, project.prompts, {"target": "y"}).vars == {"target": "y"}
    with pytest.raises(TopologyError, match=r"--var tagret: not a variable of this topology; "
                                            r"declared: target"):
        load_topology(path, project.prompts, {"tagret": "y"})


@pytest.mark.parametrize(("text", "message"), [
    ("[1, 2]", "expected a mapping"),
    ("", "expected a mapping"),
    ("name: [", "invalid YAML"),
])
def test_not_a_topology(project: Project, text: str, message: str) -> None:
    with pytest.raises(TopologyError, match=message):
        load_topology(project.write_topology(text), project.prompts)


def test_unreadable_file(project: Project) -> None:
    with pytest.raises(TopologyError, match="cannot read"):
        load_topology(project.root / "absent.yaml", project.prompts)


def test_defaults_follow_the_design(project: Project) -> None:
    topo = load_topology(project.write_topology(make_topology({"a": []})), project.prompts)
    d = topo.defaults
    assert (d.max_attempts, d.retry_feedback, d.backoff_s) == (2, False, 0)
    assert [c.value for c in d.retry_on] == ["agent_exit", "artifact_contract",
                                            "contradictory_completion"]
    assert d.feedback_max_bytes == 8192


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=1, max_value=12).flatmap(lambda n: st.tuples(
    st.just(n), st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)),
                         max_size=3 * n))))
def test_cycle_check_agrees_with_networkx(graph: tuple[int, list[tuple[int, int]]]) -> None:
    import networkx as nx

    from runtime.plan.topology import _has_cycle

    n, pairs = graph
    preds: dict[str, list[str]] = {f"n{i}": [] for i in range(n)}
    g: nx.DiGraph[str] = nx.DiGraph()
    g.add_nodes_from(preds)
    for a, b in pairs:
        if a != b:
            preds[f"n{b}"].append(f"n{a}")
            g.add_edge(f"n{a}", f"n{b}")
    assert _has_cycle(preds) == (not nx.is_directed_acyclic_graph(g))


def test_size_is_checked_before_reading(project: Project,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.plan import topology

    monkeypatch.setattr(topology, "MAX_YAML_BYTES", 16)
    project.write_topology("schema_version: 1\nname: t\n")
    with pytest.raises(TopologyError, match="cannot read: file is 26 bytes; at most 16"):
        load_topology(project.topology, project.prompts)


@pytest.mark.parametrize(("kind", "message"), [
    ("fifo", "cannot read: not a regular file; expected a regular file"),
    ("dir", "cannot read: a directory; expected a regular file"),
])
def test_non_regular_topology_is_refused(project: Project, kind: str, message: str) -> None:
    path = project.root / "t.yaml"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    with pytest.raises(TopologyError, match=message):
        load_topology(path, project.prompts)
