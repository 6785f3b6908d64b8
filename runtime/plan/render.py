"""Strict, sandboxed, bounded jinja2 rendering of node prompts with a variable allow-list.

Templates load only from the prompts root, resolved once to an absolute real path; every
template, include, import and extends is resolved (symlinks followed) and refused
unless it lands inside that root, is a regular file, is at most ``TEMPLATE_MAX_BYTES``
(checked before reading) and is UTF-8. Before anything renders, every template a node
uses, and every template those include, is checked with ``jinja2.meta``: a name outside
the allow-list is a plan error even when it sits in a branch that would not execute.

Rendering is bounded (issue 9: nested ``range`` loops took 2.7 GB, ``lipsum(1e6)`` ran
past 30 s, ``n * 'x'`` built a 10 GB string): each template gets ``RenderLimits``
(time and output size, defaults overridable in the topology's ``defaults``); strings,
lists and integers built by ``*``, ``**``, ``%``, ``~``, calls, filters and block
captures are size-checked before they are built where the size is known in advance,
and after otherwise; ``lipsum`` is capped; a watchdog thread interrupts a render that
runs past its time or grows the process by more than ``RENDER_MAX_GROWTH_BYTES``.
Any exception a template raises (``1/0``, a recursive macro) is a ``TemplateError``.
"""

from __future__ import annotations

import functools
import os
import re
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import meta, nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.loaders import split_template_path
from jinja2.sandbox import SandboxedEnvironment
from jinja2.utils import generate_lorem_ipsum

from runtime.errors import TemplateError
from runtime.files import read_regular, within
from runtime.plan.topology import Node, Topology
from runtime.plan.watchdog import WATCHDOG, Overgrown, Overtime

ALLOWED_VARIABLES = ("acceptance", "needs", "node", "objective", "topology", "vars")
TEMPLATE_MAX_BYTES = 1024 * 1024
RENDER_TIMEOUT_S = 5.0
RENDER_MAX_BYTES = 1024 * 1024
RENDER_MAX_GROWTH_BYTES = 512 * 1024 * 1024
MAX_INT_BITS = 4096
LIPSUM_MAX_WORDS = 10_000
BUILD_BUDGET_FACTOR = 64


@dataclass(frozen=True)
class RenderLimits:
    """Per-template bounds; ``defaults.render_timeout_s`` / ``render_max_bytes`` set them."""

    timeout_s: float = RENDER_TIMEOUT_S
    max_bytes: int = RENDER_MAX_BYTES


class _TooLarge(Exception):
    """A value a template builds would pass the output bound."""


def _read_template(real: str, name: str, max_bytes: int) -> str:
    """A template's text: a regular file, size checked before reading, UTF-8."""
    try:
        raw = read_regular(real, max_bytes)
    except OSError as exc:
        raise TemplateError(name, 0, f"cannot read template: {exc.strerror}") from None
    except ValueError as exc:
        raise TemplateError(name, 0, f"cannot use template: {exc}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise TemplateError(name, line, f"not UTF-8 (byte 0x{raw[exc.start]:02x} at offset "
                            f"{exc.start}); save the template as UTF-8") from None


class _RootedLoader(jinja2.BaseLoader):
    """Loads templates from one real, absolute root.

    Refuses anything that resolves outside it (``..``, absolute names, symlinks out),
    non-files and oversized files.
    """

    def __init__(self, real_root: str) -> None:
        self.root = real_root

    def get_source(
        self, environment: jinja2.Environment, template: str
    ) -> tuple[str, str, Callable[[], bool]]:
        pieces = split_template_path(template)  # TemplateNotFound on '..'
        path = os.path.join(self.root, *pieces)
        if not os.path.lexists(path):
            raise jinja2.TemplateNotFound(template)
        real = within(self.root, path)
        if real is None:
            raise jinja2.TemplateNotFound(f"{template} (resolves outside the prompts root)")
        return _read_template(real, template, TEMPLATE_MAX_BYTES), real, lambda: False


class _BoundedCodeGenerator(CodeGenerator):
    """``a ~ b`` joins through the environment, so its size can be checked."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


_SIZED = (str, bytes, list, tuple, dict, set, frozenset)


def _size(value: Any) -> int:
    """Length of a string or container, bytes of an int.

    What a template could blow up. Called on every attribute and call result, so the common
    types go first.
    """
    kind = type(value)
    if kind is str or kind is list or kind is dict or kind is tuple:
        return len(value)
    if kind is int:
        return value.bit_length() >> 3  # type: ignore[no-any-return]
    if isinstance(value, _SIZED):
        return len(value)
    return 0


_WIDTH_CALLS = frozenset(["center", "ljust", "rjust", "zfill", "expandtabs", "indent",
                          "wordwrap"])
_BIG_FORMAT = re.compile(r"%[-#0 +]*(?:\d{7,}|\*)|%[-#0 +]*\d*\.(?:\d{7,}|\*)|\{[^}]*\d{7,}")


class _BoundedSandbox(SandboxedEnvironment):
    """jinja2's sandbox with every way a template can build a large value bounded."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset(["*", "**", "%", "+", "//"])

    def __init__(self, loader: jinja2.BaseLoader) -> None:
        # finalize: an unset optional field ({{ objective }} on a node without one) prints
        # nothing, not "None" in the agent's prompt.
        super().__init__(loader=loader, undefined=jinja2.StrictUndefined, autoescape=False,
                         keep_trailing_newline=True, auto_reload=False,
                         finalize=lambda value: "" if value is None else value)
        self.max_len = RENDER_MAX_BYTES
        self.built = 0  # bytes built by the current render; reset by Renderer
        self.globals["lipsum"] = self._lipsum
        for name, func in list(self.filters.items()):
            self.filters[name] = self._bounded_filter(name, func)

    def _check(self, value: Any, *, built: bool = True) -> Any:
        size = _size(value)
        if size > self.max_len:
            raise _TooLarge
        if built:
            # Each value is bounded; so is their sum, or a loop appending 1 MiB strings
            # to a list would build gigabytes from values that each pass.
            self.built += size
            if self.built > BUILD_BUDGET_FACTOR * self.max_len:
                raise _TooLarge(f"values built while rendering exceed "
                                f"{BUILD_BUDGET_FACTOR} x {self.max_len} bytes in all")
        return value

    def concat(self, parts: Any) -> str:
        return self._check("".join([str(p) for p in parts]))  # type: ignore[no-any-return]

    def _lipsum(self, n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
        if int(n) * int(max) > LIPSUM_MAX_WORDS:
            raise _TooLarge
        text: str = self._check(generate_lorem_ipsum(n, html, min, max))
        return text

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(n, int) and _size(seq) * n > self.max_len:
                    raise _TooLarge
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                    and right > 0 and right * left.bit_length() > MAX_INT_BITS:
                raise _TooLarge
        elif operator == "%" and isinstance(left, str) and _BIG_FORMAT.search(left):
            raise _TooLarge
        return self._check(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        subject = getattr(__obj, "__self__", None)
        # A list grown by ``l.append`` in a loop is seen here, through its method.
        __self._check(subject, built=False)
        __self._precheck(getattr(__obj, "__name__", ""), subject, args, kwargs)
        return __self._check(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        return self._check(super().getattr(obj, attribute), built=False)

    def _precheck(self, name: str, subject: Any, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> None:
        """Refuse calls whose result size is known, before it is built.

        Widths (center, ljust, zfill, indent...), joins, replacements, format widths.
        ``subject`` is the string a method is bound to; None for filters and functions,
        whose subject is their first argument.
        """
        values = list(args) + list(kwargs.values())
        if subject is None and values:
            subject, values = values[0], values[1:]
        if name in _WIDTH_CALLS:
            widest = max((v if isinstance(v, int) else _size(v) for v in values), default=0)
            lines = subject.count("\n") + 1 if isinstance(subject, str) else 1
            if _size(subject) + lines * widest > self.max_len:
                raise _TooLarge
        elif name == "join" and values:
            parts, glue = (values[0], subject) if isinstance(subject, str) else (subject, values[0])
            if isinstance(parts, list | tuple) and isinstance(glue, str) and sum(
                    _size(p) + len(glue) for p in parts) > self.max_len:
                raise _TooLarge
        elif name == "replace" and len(values) >= 2 and isinstance(subject, str):
            old, new = values[0], values[1]
            if isinstance(old, str) and isinstance(new, str):
                hits = subject.count(old) if old else len(subject) + 1
                if len(subject) + hits * len(new) > self.max_len:
                    raise _TooLarge
        elif name == "format" and isinstance(subject, str) and _BIG_FORMAT.search(subject):
            raise _TooLarge

    def _bounded_filter(self, name: str, func: Callable[..., Any]) -> Callable[..., Any]:
        passes_context = getattr(func, "jinja_pass_arg", None) is not None

        @functools.wraps(func)
        def bounded(*args: Any, **kwargs: Any) -> Any:
            values = args[1:] if passes_context else args
            self._precheck(name, None, tuple(values), kwargs)
            return self._check(func(*args, **kwargs))

        return bounded


def make_environment(prompts_root: Path) -> SandboxedEnvironment:
    """The one jinja2 environment planning uses.

    Sandboxed, strict, bounded, no autoescape, loading from the real path of
    ``prompts_root``.
    """
    return _BoundedSandbox(_RootedLoader(os.path.realpath(prompts_root)))




class Renderer:
    """Checks and renders node prompts for one topology against one prompts root."""

    def __init__(self, prompts_root: Path, limits: RenderLimits | None = None) -> None:
        self.root = Path(os.path.realpath(prompts_root))
        # How errors name a template: under the root as given (relative to the working
        # directory when it lies below it), so the path printed is one the user can open.
        shown = os.path.abspath(prompts_root)
        here = os.getcwd()
        self.shown_root = os.path.relpath(shown, here) if shown.startswith(here + os.sep) \
            else shown
        self.limits = limits or RenderLimits()
        self.env = make_environment(self.root)
        self.env.max_len = self.limits.max_bytes  # type: ignore[attr-defined]
        self._allowed = frozenset(ALLOWED_VARIABLES) | frozenset(self.env.globals)
        self._checked: set[str] = set()

    def check(self, template: str, node: str | None = None) -> None:
        """Raise TemplateError if ``template`` or its includes are not fit to render.

        Not fit: it (or anything it includes) names a disallowed variable, has a syntax
        error, or includes a template that cannot be found (named at the include).
        """
        try:
            self._check(template, node)
        except TemplateError as exc:
            raise exc.under(self.shown_root) from None

    def _check(self, template: str, node: str | None) -> None:
        pending: list[tuple[str, str | None, int]] = [(template, None, 0)]
        while pending:
            name, includer, at = pending.pop()
            if name in self._checked:
                continue
            try:
                ast = self._parse(name, node)
            except TemplateError as exc:
                if includer is None or not exc.bare.startswith("template not found"):
                    raise
                raise TemplateError(includer, at, f"include of {name!r}: {exc.bare}",
                                    node=node) from None
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
                pending.append((ref, name, _include_line(ast, ref)))
            self._checked.add(name)

    def _parse(self, name: str, node: str | None) -> nodes.Template:
        try:
            source, _, _ = self.env.loader.get_source(self.env, name)  # type: ignore[union-attr]
        except jinja2.TemplateNotFound as exc:
            raise TemplateError(name, 0, f"template not found under the prompts root: "
                                f"{exc.message or name}", node=node) from None
        except TemplateError as exc:
            raise TemplateError(exc.template, exc.line, exc.bare, node=node) from None
        try:
            return self.env.parse(source, name=name)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(name, exc.lineno, f"syntax error: {exc.message}",
                                node=node) from None

    def render(self, template: str, context: Mapping[str, Any], node: str) -> str:
        """Render ``template`` with ``context`` within ``self.limits``.

        Every failure (jinja2's, the template's own such as ``1/0``, a bound) is a
        TemplateError.
        """
        try:
            return self._render_checked(template, context, node)
        except TemplateError as exc:
            raise exc.under(self.shown_root) from None

    def _render_checked(self, template: str, context: Mapping[str, Any], node: str) -> str:
        self._check(template, node)  # render() names the root, once
        limits = self.limits
        token = WATCHDOG.arm(limits.timeout_s, RENDER_MAX_GROWTH_BYTES)
        try:
            try:
                text = self._render(template, context)
            finally:
                WATCHDOG.disarm_safely(token)
        except Overtime:
            WATCHDOG.disarm_safely(token)
            raise TemplateError(template, 0, f"rendering took longer than {limits.timeout_s:g}"
                                " s; set defaults.render_timeout_s to allow more",
                                node=node) from None
        except Overgrown:
            WATCHDOG.disarm_safely(token)
            raise TemplateError(template, 0, "rendering grew the process by more than "
                                f"{RENDER_MAX_GROWTH_BYTES >> 20} MiB", node=node) from None
        except _TooLarge as exc:
            tmpl, line = _template_frame(exc, template, self.root)
            what = exc.args[0] if exc.args else (f"output or a value built while rendering "
                                                 f"exceeds {limits.max_bytes} bytes")
            raise TemplateError(tmpl, line, f"{what}; set defaults.render_max_bytes to allow "
                                "more", node=node) from None
        except TemplateError as exc:
            raise TemplateError(exc.template, exc.line, exc.bare, node=node) from None
        except RecursionError as exc:
            tmpl, line = _template_frame(exc, template, self.root)
            raise TemplateError(tmpl, line, "render failed: recursion too deep (a macro "
                                "that calls itself, or a template that includes itself?)",
                                node=node) from None
        except Exception as exc:  # noqa: BLE001 - whatever a template raises is its error
            tmpl, line = _template_frame(exc, template, self.root)
            hint = ""
            if isinstance(exc, jinja2.UndefinedError) and "'dict object'" in str(exc):
                # Most often {{ vars.x }} for a var the topology does not declare.
                declared = ", ".join(sorted(context.get("vars", {}))) or "none"
                hint = f" (the topology's vars: {declared})"
            raise TemplateError(tmpl, line, f"render failed: {_describe(exc)}{hint}",
                                node=node) from None
        if len(text.encode()) > limits.max_bytes:
            raise TemplateError(template, 0, f"output exceeds {limits.max_bytes} bytes; set "
                                "defaults.render_max_bytes to allow more", node=node)
        return text

    def _render(self, template: str, context: Mapping[str, Any]) -> str:
        """Stream the output so a loop that prints is stopped at the bound, not after."""
        parts: list[str] = []
        size = 0
        self.env.built = 0  # type: ignore[attr-defined]
        tmpl = self.env.get_template(template)
        # Template.generate without its per-chunk wrapper; on error, jinja2's
        # handle_exception still maps the traceback to template lines.
        try:
            for chunk in tmpl.root_render_func(tmpl.new_context(dict(context))):
                size += len(chunk)  # characters <= bytes: an early, cheap bound
                if size > self.limits.max_bytes:
                    raise _TooLarge
                parts.append(chunk)
        except Exception:  # noqa: BLE001 - jinja2 rewrites it with template frames
            self.env.handle_exception()
        return "".join(parts)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, jinja2.TemplateError):
        return str(exc.message or exc)
    return f"{type(exc).__name__}: {exc}"


def _first_line(ast: nodes.Template, name: str) -> int:
    lines = [n.lineno for n in ast.find_all(nodes.Name) if n.name == name and n.ctx == "load"]
    return min(lines) if lines else 0


def _include_line(ast: nodes.Template, ref: str) -> int:
    """The line of the first include/extends/import of ``ref`` in ``ast``."""
    found = [n.lineno for n in ast.find_all((nodes.Include, nodes.Extends, nodes.Import,
                                             nodes.FromImport))
             if isinstance(getattr(n, "template", None), nodes.Const)
             and n.template.value == ref]  # type: ignore[attr-defined]
    return min(found) if found else 0


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
