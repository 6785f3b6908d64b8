from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime.errors import TemplateError
from runtime.plan import plan_topology
from runtime.render import ALLOWED_VARIABLES
from tests.conftest import Project, make_topology


def _plan_with(project: Project, template: str) -> str:
    project.template("task.md.j2", template)
    topo = make_topology({"a": [], "b": ["a"]})
    topo["vars"] = {"target": "vault"}
    plan = plan_topology(project.write_topology(topo), project.prompts)
    return plan.prompts[plan.manifest.nodes["b"].prompt_digest].decode()


def test_allowed_variables_render(project: Project) -> None:
    text = _plan_with(project, "{{ topology.name }} {{ node.id }} {{ vars.target }} "
                      "{% for up in needs %}{{ up.artifacts[0].input_path }}{% endfor %}\n")
    assert text == "t b vault inputs/a/a.json\n"


@pytest.mark.parametrize(("template", "line", "name"), [
    ("ok\n{{ secrets }}\n", 2, "secrets"),
    ("{% if false %}\n\n{{ env.HOME }}\n{% endif %}\n", 3, "env"),
    ("{% for x in items %}{{ x }}{% endfor %}\n", 1, "items"),
])
def test_unknown_variable_is_a_plan_error(project: Project, template: str, line: int,
                                          name: str) -> None:
    with pytest.raises(TemplateError) as info:
        _plan_with(project, template)
    err = info.value
    assert (err.template, err.line, err.name) == ("task.md.j2", line, name)
    assert f"unknown variable {name!r}" in str(err)
    assert ", ".join(ALLOWED_VARIABLES) in str(err)
    assert str(err).startswith(f"prompts/task.md.j2:{line} (node a):")


def test_included_template_is_checked(project: Project) -> None:
    project.template("parts/x.md.j2", "line1\n{{ hostname }}\n")
    with pytest.raises(TemplateError) as info:
        _plan_with(project, '{% include "parts/x.md.j2" %}\n')
    assert (info.value.template, info.value.line, info.value.name) == (
        "parts/x.md.j2", 2, "hostname")


def test_locals_are_not_flagged(project: Project) -> None:
    text = _plan_with(project, "{% set n = node.id %}{% for a in node.artifacts %}{{ n }}"
                      "{{ a.path }}{% endfor %}{{ range(2) | list }}\n")
    assert text == "bb.json[0, 1]\n"


def test_dynamic_include_is_refused(project: Project) -> None:
    with pytest.raises(TemplateError, match="must be string literals"):
        _plan_with(project, "{% include node.id %}\n")


def test_include_outside_root_is_refused(project: Project) -> None:
    with pytest.raises(TemplateError, match="not found under the prompts root"):
        _plan_with(project, '{% include "../../etc/passwd" %}\n')


def test_include_symlink_outside_root_is_refused(project: Project, tmp_path: Path) -> None:
    (tmp_path / "outside.md").write_text("leaked")
    os.symlink(tmp_path / "outside.md", project.prompts / "leak.md.j2")
    with pytest.raises(TemplateError, match="resolves outside the prompts root"):
        _plan_with(project, '{% include "leak.md.j2" %}\n')


def test_syntax_error_names_line(project: Project) -> None:
    with pytest.raises(TemplateError) as info:
        _plan_with(project, "a\nb\n{% if %}\n")
    assert info.value.line == 3 and "syntax error" in str(info.value)


def test_missing_attribute_fails_render_with_line(project: Project) -> None:
    with pytest.raises(TemplateError) as info:
        _plan_with(project, "a\n{{ node.nope }}\n")
    assert info.value.line == 2 and "render failed" in str(info.value)


def test_sandbox_blocks_unsafe_access(project: Project) -> None:
    with pytest.raises(TemplateError, match="render failed"):
        _plan_with(project, "{{ node.__class__.__mro__[1].__subclasses__() }}\n")
