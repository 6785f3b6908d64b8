"""Topology models (pydantic) and loading with every problem reported at once.

A topology is a YAML DAG of agent nodes (DESIGN section 3). Loading it checks types and
unknown keys (pydantic), then the graph (networkx: duplicate ids, unknown needs,
self-loops, cycles), agent names, and that every template exists inside the prompts
root. All problems found are raised together in one ``TopologyError``.
"""

from __future__ import annotations

import difflib
import graphlib
import os
import re
import typing
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    ValidationError,
    field_validator,
    model_validator,
)

from runtime.errors import Problem, TopologyError
from runtime.failures import DEFAULT_RETRY_ON, FailureClass
from runtime.files import read_regular, within
from runtime.plan.profiles import BUILTIN_PROFILES, AgentProfile
from runtime.plan.yamlsafe import MAX_BYTES as MAX_YAML_BYTES
from runtime.plan.yamlsafe import LoadedYaml, load_yaml

SCHEMA_VERSION = 1
NODE_ID = re.compile(r"^[a-z0-9][a-z0-9_-]*$")
_DRIVE = re.compile(r"^[A-Za-z]:")
VAR_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
PREAMBLE_DEFAULT_BYTES = 8 * 1024
PREAMBLE_MAX_BYTES = 32 * 1024


def check_relative_path(value: str) -> str:
    """Accept a relative POSIX path that stays below its root; reject anything else."""
    if not value or value.strip() != value:
        raise ValueError("must be a non-empty relative path without surrounding spaces")
    if "\\" in value or "\x00" in value:
        raise ValueError(f"{value!r}: use '/' separators; backslashes and NUL are not allowed")
    if value.startswith("/") or _DRIVE.match(value):
        raise ValueError(f"{value!r}: absolute paths are not allowed; give a relative path")
    if ".." in value.split("/"):
        raise ValueError(f"{value!r}: '..' escapes the root; give a path inside it")
    return value


# The schema (`runtime schema`, for editors) says what the validators enforce: relative,
# no '..' segment, no backslash. ECMAScript regex, as JSON Schema uses.
# ECMAScript's '.' does not match line breaks, which a path may hold: [\s\S] instead.
RelPath = Annotated[str, Field(min_length=1, max_length=512, json_schema_extra={
    "pattern": r"^(?!/)(?![\s\S]*\\)(?!([\s\S]*/)?\.\.(/|$))[\s\S]+$"})]
# Node ids, in the schema as the validator has them.
_ID_SCHEMA: dict[str, JsonValue] = {"pattern": NODE_ID.pattern, "maxLength": 128}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


class ArtifactSpec(_Frozen):
    """A file the node must leave in its workspace: its acceptance contract."""

    path: RelPath = Field(description="Workspace-relative path.")
    kind: Literal["file", "json", "sarif"] = Field(
        default="file", description="json: must parse as JSON (and match `schema` if given); "
        "sarif: a SARIF 2.1.0 log, checked against the official OASIS schema."
    )
    required: bool = Field(default=True, description="A missing optional artifact is no failure.")
    max_bytes: int = Field(default=10 * 1024 * 1024, gt=0, le=1 << 32)
    json_schema: dict[str, Any] | None = Field(
        default=None, alias="schema", description="JSON Schema (2020-12) the JSON must match."
    )

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        return check_relative_path(value)

    @model_validator(mode="after")
    def _sarif_has_its_own_schema(self) -> ArtifactSpec:
        # A second schema on a SARIF log would be a silent, partial override of the
        # official one: refuse it rather than guess which wins.
        if self.kind == "sarif" and self.json_schema is not None:
            raise ValueError("kind sarif is checked against the SARIF 2.1.0 schema; "
                             "remove `schema` (or use kind json)")
        return self

    @field_validator("json_schema")
    @classmethod
    def _schema_valid(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is not None:
            # Imported here: jsonschema costs ~40 ms at start-up and most plans declare
            # no schema.
            from jsonschema import Draft202012Validator
            from jsonschema.exceptions import SchemaError

            try:
                Draft202012Validator.check_schema(schema)
            except SchemaError as exc:
                raise ValueError(f"not a valid JSON Schema: {exc.message}") from None
        return schema


class Defaults(_Frozen):
    """Settings every node inherits unless it sets its own."""

    agent: str = Field(default="simulated", description="Agent profile name.")
    max_attempts: int = Field(default=2, ge=1, le=20)
    retry_feedback: bool = False
    retry_on: list[FailureClass] = Field(default_factory=lambda: list(DEFAULT_RETRY_ON))
    timeout_s: float = Field(default=1800.0, gt=0, le=7 * 24 * 3600)
    backoff_s: float = Field(default=0.0, ge=0, le=3600, description="Wait before a retry.")
    feedback_max_bytes: int = Field(default=PREAMBLE_DEFAULT_BYTES, ge=1024, le=PREAMBLE_MAX_BYTES)
    # Plan-time bounds (issue 9). None means the runtime's default (5 s, 1 MiB) and is
    # left out of the topology digest, so plans that do not set them keep their digests.
    render_timeout_s: float | None = Field(
        default=None, gt=0, le=600,
        description="Per-template render time limit in seconds (default 5).")
    render_max_bytes: int | None = Field(
        default=None, ge=1024, le=64 * 1024 * 1024,
        description="Per-template rendered output limit in bytes (default 1048576).")


class Node(_Frozen):
    """One agent node of the DAG."""

    id: str = Field(description="Unique id, matching [a-z0-9][a-z0-9_-]*.",
                    json_schema_extra=_ID_SCHEMA)
    prompt: RelPath = Field(description="Template path relative to the prompts root.")
    needs: list[str] = Field(default_factory=list, description="Upstream node ids.",
                             json_schema_extra={"items": {"type": "string", **_ID_SCHEMA}})
    agent: str | None = Field(default=None, description="Agent profile name.")
    fallback: list[str] = Field(
        default_factory=list, description="Profiles tried, one attempt each, once spent."
    )
    objective: str | None = None
    acceptance: list[str] = Field(default_factory=list)
    max_attempts: int | None = Field(default=None, ge=1, le=20)
    retry_feedback: bool | None = None
    retry_on: list[FailureClass] | None = None
    timeout_s: float | None = Field(default=None, gt=0, le=7 * 24 * 3600)
    backoff_s: float | None = Field(default=None, ge=0, le=3600)
    feedback_max_bytes: int | None = Field(default=None, ge=1024, le=PREAMBLE_MAX_BYTES)
    artifacts: list[ArtifactSpec] = Field(default_factory=list)

    @field_validator("id")
    @classmethod
    def _id(cls, value: str) -> str:
        if not NODE_ID.fullmatch(value) or len(value) > 128:  # ('$' allows a final "\n")
            raise ValueError(f"{value!r}: ids must match [a-z0-9][a-z0-9_-]* (at most 128)")
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: str) -> str:
        return check_relative_path(value)


VarValue = str | int | float | bool


class Topology(_Frozen):
    """A topology file: a named DAG of agent nodes with its agents and defaults."""

    schema_version: Literal[1] = Field(description="Format version; this runtime reads 1.")
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=128)
    description: str = ""
    vars: dict[str, VarValue] = Field(
        default_factory=dict, description="Plan-time variables; override with --var."
    )
    agents: dict[str, AgentProfile] = Field(default_factory=dict)
    defaults: Defaults = Field(default_factory=Defaults)
    nodes: list[Node] = Field(min_length=1)

    @field_validator("vars")
    @classmethod
    def _var_names(cls, value: dict[str, VarValue]) -> dict[str, VarValue]:
        bad = sorted(k for k in value if not VAR_NAME.match(k))
        if bad:
            raise ValueError(f"variable names must be identifiers: {bad}")
        return value

    def profiles(self) -> MappingProxyType[str, Any]:
        """Every profile a node may name: the built-ins overlaid by the topology's own."""
        return MappingProxyType({**BUILTIN_PROFILES, **self.agents})


def load_topology(path: Path, prompts_root: Path, overrides: dict[str, str] | None = None,
                  ) -> Topology:
    """Read, parse and validate a topology file; raise one TopologyError listing all problems.

    Args:
        path: the topology YAML file.
        prompts_root: the template root; every node's template must exist inside it.
        overrides: ``--var`` values; each must name a variable the topology declares.
    """
    file = str(path)
    try:
        raw = read_regular(path, MAX_YAML_BYTES)
    except OSError as exc:
        raise TopologyError(file, [Problem(file, 0, "", f"cannot read: {exc.strerror}")]) from None
    except ValueError as exc:
        raise TopologyError(file, [Problem(file, 0, "", f"cannot read: {exc}")]) from None
    loaded, problems = load_yaml(raw, file)
    if loaded is None:
        raise TopologyError(file, problems)
    data = loaded.data
    if not isinstance(data, dict):
        raise TopologyError(file, [Problem(file, 1, "", "expected a mapping with "
                                           "schema_version, name, agents, defaults, nodes")])
    problems = _graph_problems(data, loaded, file)
    problems += _reference_problems(data, loaded, file, prompts_root)
    topo: Topology | None = None
    try:
        topo = Topology.model_validate(data)
    except ValidationError as exc:
        problems += _pydantic_problems(exc, loaded, file)
    if topo is not None and overrides:
        topo, var_problems = _apply_overrides(topo, overrides, file)
        problems += var_problems
    if problems or topo is None:
        raise TopologyError(file, problems)
    return topo


_VAR_TYPES = ("bool", "float", "int", "str")  # the members of a var's union


def _pydantic_problems(exc: ValidationError, loaded: LoadedYaml, file: str) -> list[Problem]:
    out = []
    vars_seen: set[tuple[Any, ...]] = set()
    for err in exc.errors(include_url=False):
        yaml_loc = _file_loc(tuple(err["loc"]))
        if len(yaml_loc) == 3 and yaml_loc[0] == "vars" and yaml_loc[2] in _VAR_TYPES:
            # One problem, not one per member of the union the value failed.
            if yaml_loc[:2] not in vars_seen:
                vars_seen.add(yaml_loc[:2])
                out.append(Problem(file, loaded.line_of(yaml_loc[:2]), _dotted(yaml_loc[:2]),
                                   "a var is a string, a number or true/false (not a list "
                                   "or a mapping)"))
            continue
        msg = err["msg"].removeprefix("Value error, ")  # pydantic's, not ours to show
        if err["type"] == "extra_forbidden":
            msg = "unknown key" + _did_you_mean(str(err["loc"][-1]), tuple(err["loc"][:-1])) \
                + "; see `runtime schema` for the accepted fields"
        elif err["type"] == "missing":
            msg = "required field is missing"
        elif err["type"] == "union_tag_invalid":
            msg = "agent kind must be one of: command, http, python, simulated"
        if yaml_loc and yaml_loc[-1] == "[key]" and len(yaml_loc) >= 2:
            # pydantic gives the key as text: None and True were YAML's null and true.
            key = str(yaml_loc[-2])
            shown = {"None": "null", "True": "true", "False": "false"}.get(key, key)
            yaml_loc = yaml_loc[:-2]
            msg = (f"key {shown} is not a string; names here are strings (quote it: "
                   f"'{shown}')")
        out.append(Problem(file, loaded.line_of(yaml_loc), _dotted(yaml_loc), msg))
    return out


_AGENT_KINDS = ("command", "http", "python", "simulated")


def _did_you_mean(key: str, loc: tuple[Any, ...]) -> str:
    """`` (did you mean retry_feedback?)`` for a near miss of a key the model accepts."""
    model: Any = Topology
    for part in loc:
        if isinstance(part, int) or model is None:
            continue  # a list index: the list's model is already the current one
        if part in _AGENT_KINDS and model is dict:
            model = _profile_model(part)
            continue
        fields = getattr(model, "model_fields", None)
        if fields is None:  # inside a dict (agents.<name>): the next part names the kind
            continue
        model = _inner_model(fields[part].annotation) if part in fields else None
    fields = getattr(model, "model_fields", None)
    near = difflib.get_close_matches(key, list(fields or ()), n=1, cutoff=0.75)
    return f" (did you mean {near[0]}?)" if near else ""


def _inner_model(annotation: Any) -> Any:
    """The pydantic model a field holds (through list[...], dict[str, ...], X | None)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) is dict:
        return dict  # agents: the key is a name, the value a profile chosen by kind
    for arg in typing.get_args(annotation):
        inner = _inner_model(arg)
        if inner is not None:
            return inner
    return None


def _profile_model(kind: str) -> Any:
    """The profile model of ``kind``, read off the ``AgentProfile`` union itself."""
    for model in typing.get_args(typing.get_args(AgentProfile)[0]):
        if typing.get_args(model.model_fields["kind"].annotation) == (kind,):
            return model
    return None


def _file_loc(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """Drop the union tag pydantic inserts after an agent's name (agents.x.command.argv)."""
    if len(loc) >= 3 and loc[0] == "agents" and loc[2] in _AGENT_KINDS:
        return loc[:2] + loc[3:]
    return loc


def _dotted(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


# C901: Each check appends its problems so all are reported at once (STYLE rule 7).
def _graph_problems(data: dict[str, Any], loaded: LoadedYaml, file: str) -> list[Problem]:  # noqa: C901
    """Duplicate ids, unknown needs, self-loops and cycles, from the raw data.

    Checked on raw data so that a type error elsewhere does not hide a cycle.
    """
    raw_nodes = data.get("nodes")
    if not isinstance(raw_nodes, list):
        return []
    problems: list[Problem] = []
    index: dict[str, int] = {}
    edges: dict[str, list[str]] = {}
    for i, raw in enumerate(raw_nodes):
        if not isinstance(raw, dict) or not isinstance(raw.get("id"), str):
            continue
        nid = raw["id"]
        if nid in index:
            problems.append(Problem(file, loaded.line_of(("nodes", i, "id")), f"nodes[{i}].id",
                                    f"duplicate node id {nid!r} (first at nodes[{index[nid]}])"))
            continue
        index[nid] = i
        edges[nid] = []
    for nid, i in index.items():
        needs = raw_nodes[i].get("needs") or []
        if not isinstance(needs, list):
            continue
        for j, up in enumerate(needs):
            where = (("nodes", i, "needs", j), f"nodes[{i}].needs[{j}]")
            if not isinstance(up, str):
                continue
            if up == nid:
                problems.append(Problem(file, loaded.line_of(where[0]), where[1],
                                        f"node {nid!r} needs itself"))
            elif up not in index:
                problems.append(Problem(file, loaded.line_of(where[0]), where[1],
                                        f"unknown node {up!r}; known ids: "
                                        f"{_sample(sorted(index))}"))
            else:
                edges[nid].append(up)
    if _has_cycle(edges):
        problems += _cycle_problems(edges, index, loaded, file)
    return problems


def _has_cycle(predecessors: dict[str, list[str]]) -> bool:
    """Tell whether the dependency graph has a cycle, without importing networkx.

    The stdlib's topological sorter answers "is it a DAG?" in O(V+E) without importing
    networkx (~100 ms at start-up), which only the diagnosis needs.
    """
    try:
        graphlib.TopologicalSorter(predecessors).prepare()
    except graphlib.CycleError:
        return True
    return False


def _cycle_problems(predecessors: dict[str, list[str]], index: dict[str, int],
                    loaded: LoadedYaml, file: str) -> list[Problem]:
    """One problem per strongly connected component, naming one cycle through it."""
    import networkx as nx

    graph: nx.DiGraph[str] = nx.DiGraph()
    graph.add_nodes_from(predecessors)
    graph.add_edges_from((up, nid) for nid, ups in predecessors.items() for up in ups)
    problems = []
    for component in nx.strongly_connected_components(graph):
        if len(component) > 1:
            cycle = nx.find_cycle(graph.subgraph(component))
            path = " -> ".join([u for u, _ in cycle] + [cycle[0][0]])
            first = min(component, key=index.__getitem__)
            problems.append(Problem(file, loaded.line_of(("nodes", index[first], "needs")),
                                    f"nodes[{index[first]}].needs", f"cycle: {path}"))
    return problems


def _sample(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _reference_problems(data: dict[str, Any], loaded: LoadedYaml, file: str,
                        prompts_root: Path) -> list[Problem]:
    """Agent names that have no profile, and templates missing or outside the root.

    Checked on raw data, like the graph, so these are reported together with type
    errors elsewhere in the file; values of the wrong type are left to pydantic.
    """
    agents = data.get("agents")
    # Keys of another type (`agents: {1: ...}`) are pydantic's to report; here they
    # would only break the sort.
    declared = [k for k in agents if isinstance(k, str)] if isinstance(agents, dict) else []
    profiles = sorted({*BUILTIN_PROFILES, *declared})
    known = _sample(profiles)
    problems: list[Problem] = []
    defaults = data.get("defaults")
    default_agent = defaults.get("agent") if isinstance(defaults, dict) else None
    if isinstance(default_agent, str) and default_agent not in profiles:
        problems.append(Problem(file, loaded.line_of(("defaults", "agent")), "defaults.agent",
                                f"no agent profile {default_agent!r}; known: {known}"))
    raw_nodes = data.get("nodes")
    raw = raw_nodes if isinstance(raw_nodes, list) else []
    for i, node in enumerate(raw):
        if not isinstance(node, dict):
            continue
        fallback = node.get("fallback")
        for field, names in (("agent", [node.get("agent")]),
                             ("fallback", fallback if isinstance(fallback, list) else [])):
            for name in names:
                if isinstance(name, str) and name not in profiles:
                    problems.append(Problem(file, loaded.line_of(("nodes", i, field)),
                                            f"nodes[{i}].{field}",
                                            f"no agent profile {name!r}; known: {known}"))
    return problems + _template_problems(raw, loaded, file, prompts_root)


def _template_problems(raw_nodes: list[Any], loaded: LoadedYaml, file: str,
                       prompts_root: Path) -> list[Problem]:
    """Templates missing or outside the root; a root that is not a directory, once."""
    root = prompts_root.resolve()
    if not root.is_dir() and any(isinstance(n, dict) and "prompt" in n for n in raw_nodes):
        return [Problem(file, 0, "prompts", f"the prompts root {prompts_root} is not a "
                        "directory (give the templates' directory with --prompts)")]
    problems: list[Problem] = []
    checked: dict[str, str | None] = {}
    for i, node in enumerate(raw_nodes):
        if not isinstance(node, dict):
            continue
        prompt = node.get("prompt")
        if not isinstance(prompt, str) or not _is_relative(prompt):
            continue  # pydantic reports it
        if prompt not in checked:
            checked[prompt] = _template_problem(root, prompt)
        if (msg := checked[prompt]) is not None:
            problems.append(Problem(file, loaded.line_of(("nodes", i, "prompt")),
                                    f"nodes[{i}].prompt", msg))
    return problems


def _is_relative(path: str) -> bool:
    try:
        check_relative_path(path)
    except ValueError:
        return False
    return True


def _template_problem(root: Path, rel: str) -> str | None:
    if not os.path.exists(root / rel):
        return f"template {rel!r} not found under prompts root {root}"
    real = within(root, rel)
    if real is None:
        return f"template {rel!r} resolves outside the prompts root (symlink?)"
    if not os.path.isfile(real):
        return f"template {rel!r} is not a file"
    return None


def _apply_overrides(topo: Topology, overrides: dict[str, str], file: str,
                     ) -> tuple[Topology, list[Problem]]:
    unknown = sorted(set(overrides) - set(topo.vars))
    if unknown:
        return topo, [Problem(file, 0, "vars", f"--var {name}: not a variable of this topology;"
                              f" declared: {_sample(sorted(topo.vars)) or '(none)'}")
                      for name in unknown]
    return topo.model_copy(update={"vars": {**topo.vars, **overrides}}), []
