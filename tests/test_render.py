from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime.errors import TemplateError
from runtime.plan.compile import plan_topology
from runtime.plan.render import ALLOWED_VARIABLES
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


def test_an_unset_objective_prints_nothing(project: Project) -> None:
    """Before: "Goal: None." reached the agent's prompt."""
    assert _plan_with(project, "Goal: {{ objective }}.{{ node.objective }}\n") == "Goal: .\n"


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
    # The template under the prompts root as given (here an absolute path).
    assert str(err).startswith(f"{project.prompts}/task.md.j2:{line} (node a):")


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


def test_an_undeclared_var_names_the_declared_ones(project: Project) -> None:
    with pytest.raises(TemplateError, match=r"has no attribute 'nope' \(the topology's "
                       r"vars: target\)"):
        _plan_with(project, "{{ vars.nope }}\n")


def test_a_missing_include_is_named_at_the_include(project: Project) -> None:
    """Before: reported as prompts/nope.md.j2:0, the missing file, at line 0."""
    with pytest.raises(TemplateError) as info:
        _plan_with(project, 'intro\n{% include "nope.md.j2" %}\n')
    assert (info.value.template, info.value.line) == ("task.md.j2", 2)
    assert "include of 'nope.md.j2': template not found" in str(info.value)


def test_syntax_error_names_line(project: Project) -> None:
    with pytest.raises(TemplateError) as info:
        _plan_with(project, "a\nb\n{% if %}\n")
    assert info.value.line == 3
    assert "syntax error" in str(info.value)


def test_missing_attribute_fails_render_with_line(project: Project) -> None:
    with pytest.raises(TemplateError) as info:
        _plan_with(project, "a\n{{ node.nope }}\n")
    assert info.value.line == 2
    assert "render failed" in str(info.value)


def test_sandbox_blocks_unsafe_access(project: Project) -> None:
    with pytest.raises(TemplateError, match="render failed"):
        _plan_with(project, "{{ node.__class__.__mro__[1].__subclasses__() }}\n")


def _plan_with_defaults(project: Project, template: str, **defaults: object) -> str:
    project.template("task.md.j2", template)
    topo = make_topology({"a": []})
    topo["vars"] = {"n": "100000000"}
    topo["defaults"].update(defaults)
    plan = plan_topology(project.write_topology(topo), project.prompts)
    return plan.prompts[plan.manifest.nodes["a"].prompt_digest].decode()


def test_symlink_out_with_a_relative_root_is_refused(
        project: Project, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 9: with the default relative --prompts, the root was joined twice and a
    symlink to a host file rendered into the plan."""
    (tmp_path / "secret").write_text("host secret\n")
    os.symlink(tmp_path / "secret", project.prompts / "leak")
    project.template("task.md.j2", "{% include 'leak' %}\n")
    project.write_topology(make_topology({"a": []}))
    monkeypatch.chdir(project.root)
    with pytest.raises(TemplateError, match="resolves outside the prompts root"):
        plan_topology(Path("topology.yaml"), Path("prompts"))


def test_relative_root_messages_name_the_template_once(
        project: Project, monkeypatch: pytest.MonkeyPatch) -> None:
    project.template("task.md.j2", "a\n{{ node.nope }}\n")
    project.write_topology(make_topology({"a": []}))
    monkeypatch.chdir(project.root)
    with pytest.raises(TemplateError) as info:
        plan_topology(Path("topology.yaml"), Path("prompts"))
    assert str(info.value).startswith("prompts/task.md.j2:2 (node a): render failed")


@pytest.mark.parametrize(("template", "line", "message"), [
    ("ok\n{{ 1/0 }}\n", 2, "render failed: ZeroDivisionError: division by zero"),
    ("{{ (vars.n|int) / 0 }}\n", 1, "ZeroDivisionError"),
    ("{% macro m(x) %}{{ m(x) }}{% endmacro %}{{ m(1) }}\n", 1, "recursion too deep"),
    ("{% include 'task.md.j2' %}\n", 1, "recursion too deep"),
    ("{{ 'a' + 1 }}\n", 1, "render failed: TypeError"),
])
def test_template_exceptions_are_template_errors(project: Project, template: str, line: int,
                                                 message: str) -> None:
    with pytest.raises(TemplateError) as info:
        _plan_with_defaults(project, template)
    assert message in str(info.value)
    assert info.value.template == "task.md.j2"
    assert info.value.line == line


@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "{{ lipsum(1000000) }}",
    "{{ vars.n|int * 'x' }}",
    "{{ 'x' * 10000000000 }}",
    "{{ ['x'] * 10000000000 }}",
    "{{ 2 ** 100000 }}",
    "{{ 'x'|center(1000000000) }}",
    "{{ 'x'.ljust(1000000000) }}",
    "{{ '%0999999999d' % 1 }}",
    "{{ '%0999999999d'|format(1) }}",
    "{{ ('a\\n' * 1000)|indent('x' * 10000) }}",
    "{{ ('x' * 1000000)|replace('x', 'yy') }}",
    "{{ ('x' * 100000).replace('x', 'y' * 100) }}",
    "{{ (['x' * 1000000] * 3)|join }}",
    "{{ ('-').join(['x' * 600000, 'y' * 600000]) }}",
    "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}",
    "{% macro m(s) %}{{ m(s ~ s) }}{% endmacro %}{{ m('x') }}",
    "{% set s %}{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}{% endset %}",
])
def test_templates_cannot_build_unbounded_values(project: Project, template: str) -> None:
    """Issue 9: each of these took gigabytes or minutes; now each stops at the bound."""
    with pytest.raises(TemplateError, match=r"exceeds 1048576 bytes; set "
                       r"defaults\.render_max_bytes"):
        _plan_with_defaults(project, template + "\n")


def test_render_max_bytes_is_overridable(project: Project) -> None:
    text = _plan_with_defaults(project, "{{ 'x' * 2000000 }}", render_max_bytes=4 * 1024 * 1024)
    assert len(text) == 2_000_000


def test_render_time_is_bounded(project: Project) -> None:
    """A loop that prints nothing and builds nothing is stopped by the watchdog."""
    template = ("{% macro m() %}{% for i in range(100000) %}{% for j in range(100000) %}"
                "{% endfor %}{% endfor %}{% endmacro %}{{ m() }}\n")
    with pytest.raises(TemplateError, match=r"rendering took longer than 0\.2 s; set "
                       r"defaults\.render_timeout_s"):
        _plan_with_defaults(project, template, render_timeout_s=0.2)
    # The watchdog fired once and is disarmed: the next render in this thread is fine.
    assert _plan_with_defaults(project, "ok {{ node.id }}\n") == "ok a\n"


def test_non_utf8_template_is_a_template_error(project: Project) -> None:
    (project.prompts / "task.md.j2").write_bytes(b"ok\nbad \xff\n")
    project.write_topology(make_topology({"a": []}))
    with pytest.raises(TemplateError, match=r"task.md.j2:2 .*not UTF-8 \(byte 0xff"):
        plan_topology(project.topology, project.prompts)


def test_included_non_regular_file_is_refused(project: Project) -> None:
    os.mkfifo(project.prompts / "pipe")
    with pytest.raises(TemplateError, match="not a regular file"):
        _plan_with(project, "{% include 'pipe' %}\n")


def test_oversized_template_is_refused_before_reading(
        project: Project, monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.plan import render

    monkeypatch.setattr(render, "TEMPLATE_MAX_BYTES", 64)
    project.template("big.md.j2", "x" * 65)
    with pytest.raises(TemplateError, match="cannot use template: file is 65 bytes; at most 64"):
        _plan_with(project, "{% include 'big.md.j2' %}\n")


_GROW = ("{% set l = [] %}{% for i in range(100000) %}{% for j in range(100000) %}"
         "{% if l.append(i) %}{% endif %}{% endfor %}{% endfor %}\n")
_GROW_BIG = ("{% set l = [] %}{% for i in range(100000) %}{% if l.append('x' * 1000000) %}"
             "{% endif %}{% endfor %}\n")


def test_list_grown_by_append_is_bounded(project: Project) -> None:
    with pytest.raises(TemplateError, match="exceeds 4096 bytes"):
        _plan_with_defaults(project, _GROW, render_max_bytes=4096)


def test_values_built_in_all_are_bounded(project: Project) -> None:
    """Each 1 MB string passes; 100,000 of them kept in a list would be 100 GB."""
    with pytest.raises(TemplateError, match=r"values built while rendering exceed 64 x "
                       r"1048576 bytes in all; set defaults\.render_max_bytes"):
        _plan_with_defaults(project, _GROW_BIG)


def test_render_memory_growth_is_bounded(project: Project,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the size bounds (lifted here), the watchdog stops a render that grows the
    process by more than RENDER_MAX_GROWTH_BYTES."""
    from runtime.plan import render

    monkeypatch.setattr(render, "RENDER_MAX_GROWTH_BYTES", 32 * 1024 * 1024)
    monkeypatch.setattr(render, "BUILD_BUDGET_FACTOR", 1 << 20)
    with pytest.raises(TemplateError, match="rendering grew the process by more than 32 MiB"):
        _plan_with_defaults(project, _GROW_BIG, render_timeout_s=120)
