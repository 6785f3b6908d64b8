"""Strict, sandboxed jinja2 rendering of node prompts with an explicit variable allow-list.

Templates load only from the prompts root (include/extends/import allowed inside it,
symlinks out of it refused). Before anything renders, every template a node uses, and
every template those include, is checked with ``jinja2.meta``: a name outside the
allow-list is a plan error even when it sits in a branch that would not execute.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import meta, nodes
from jinja2.sandbox import SandboxedEnvironment

from .errors import TemplateError
from .files import within
from .topology import Node, Topology

ALLOWED_VARIABLES = ("acceptance", "needs", "node", "objective", "topology", "vars")


class _RootedLoader(jinja2.FileSystemLoader):
    """A FileSystemLoader that refuses files whose real path leaves the root."""

    def __init__(self, root: Path) -> None:
        super().__init__(str(root), followlinks=False)
        self._root = root

    def get_source(
        self, environment: jinja2.Environment, template: str
    ) -> tuple[str, str, Callable[[], bool]]:
        source, filename, uptodate = super().get_source(environment, template)
        if within(self._root, filename) is None:
            raise jinja2.TemplateNotFound(f"{template} (resolves outside the prompts root)")
        return source, filename, uptodate


def make_environment(prompts_root: Path) -> SandboxedEnvironment:
    """The one jinja2 environment planning uses: sandboxed, strict, no autoescape."""
    return SandboxedEnvironment(
        loader=_RootedLoader(prompts_root),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        auto_reload=False,
    )


class Renderer:
    """Checks and renders node prompts for one topology against one prompts root."""

    def __init__(self, prompts_root: Path) -> None:
        self.root = prompts_root
        self.env = make_environment(prompts_root)
        self._allowed = frozenset(ALLOWED_VARIABLES) | frozenset(self.env.globals)
        self._checked: set[str] = set()

    def check(self, template: str, node: str | None = None) -> None:
        """Raise TemplateError if ``template`` or anything it includes names a disallowed
        variable, has a syntax error, or includes a template that cannot be found."""
        pending = [template]
        while pending:
            name = pending.pop()
            if name in self._checked:
                continue
            ast = self._parse(name, node)
            undeclared = meta.find_undeclared_variables(ast) - self._allowed
            if undeclared:
                bad, line = min((_first_line(ast, n), n) for n in undeclared)[::-1]
                raise TemplateError(
                    name, line,
                    f"unknown variable {bad!r}; templates may use only: "
                    f"{', '.join(ALLOWED_VARIABLES)}",
                    node=node, name=bad,
                )
            for ref in meta.find_referenced_templates(ast):
                if ref is None:
                    raise TemplateError(name, _first_include_line(ast), "include/extends/"
                                        "import names must be string literals so the "
                                        "planner can check them", node=node)
                pending.append(ref)
            self._checked.add(name)

    def _parse(self, name: str, node: str | None) -> nodes.Template:
        try:
            source, _, _ = self.env.loader.get_source(self.env, name)  # type: ignore[union-attr]
        except jinja2.TemplateNotFound as exc:
            raise TemplateError(name, 0, f"template not found under the prompts root: "
                                f"{exc.message or name}", node=node) from None
        try:
            return self.env.parse(source, name=name)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(name, exc.lineno, f"syntax error: {exc.message}",
                                node=node) from None

    def render(self, template: str, context: Mapping[str, Any], node: str) -> str:
        """Render ``template`` with ``context``; translate jinja2 errors to TemplateError."""
        self.check(template, node)
        try:
            return self.env.get_template(template).render(context)
        except jinja2.TemplateError as exc:
            tmpl, line = _template_frame(exc, template, self.root)
            raise TemplateError(tmpl, line, f"render failed: {exc}", node=node) from None


def _first_line(ast: nodes.Template, name: str) -> int:
    lines = [n.lineno for n in ast.find_all(nodes.Name) if n.name == name and n.ctx == "load"]
    return min(lines) if lines else 0


def _first_include_line(ast: nodes.Template) -> int:
    found = [n.lineno for n in ast.find_all((nodes.Include, nodes.Extends, nodes.Import,
                                             nodes.FromImport))]
    return min(found) if found else 0


def _template_frame(exc: BaseException, default: str, root: Path) -> tuple[str, int]:
    """jinja2 rewrites tracebacks so template frames carry the template file and line."""
    real_root = os.path.realpath(root)
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        real = within(real_root, frame.filename)
        if real is not None:
            return Path(os.path.relpath(real, real_root)).as_posix(), frame.lineno or 0
    return default, getattr(exc, "lineno", 0) or 0


def node_context(topo: Topology, node: Node, by_id: Mapping[str, Node]) -> dict[str, Any]:
    """The allow-listed variables one node's template sees: plain, deterministic data.

    Upstream artifacts are named by their workspace-relative input path
    (``inputs/<upstream>/<path>``), never by a run-specific or absolute path.
    """
    needs = [
        {
            "id": up,
            "objective": by_id[up].objective,
            "artifacts": [
                {"path": a.path, "kind": a.kind, "input_path": f"inputs/{up}/{a.path}"}
                for a in by_id[up].artifacts
            ],
        }
        for up in node.needs
    ]
    return {
        "topology": {"name": topo.name, "description": topo.description},
        "node": {
            "id": node.id,
            "objective": node.objective,
            "acceptance": list(node.acceptance),
            "needs": list(node.needs),
            "artifacts": [
                {"path": a.path, "kind": a.kind, "required": a.required} for a in node.artifacts
            ],
        },
        "vars": dict(topo.vars),
        "needs": needs,
        "objective": node.objective,
        "acceptance": list(node.acceptance),
    }
