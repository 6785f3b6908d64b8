"""Artifact contract: what a node must leave in its workspace, checked after each attempt.

Each declared artifact must exist inside the workspace (no symlink escape), be a
regular file within ``max_bytes``, and for ``kind: json`` parse as JSON and match its
JSON Schema when one is given. The acceptance summary separates what was checked
(satisfied, unsatisfied) from what cannot be checked by machine (unknown).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from .files import within
from .topology import ArtifactSpec


class AcceptanceSummary(BaseModel):
    """Per attempt: artifact checks that held, that failed, and free-text acceptance
    items no machine check covers."""

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
    if spec.kind == "json":
        return _check_json(real, spec)
    return None


def _check_json(path: str, spec: ArtifactSpec) -> str | None:
    try:
        with open(path, "rb") as fh:
            value: Any = json.loads(fh.read().decode("utf-8"))
    except UnicodeDecodeError:
        return f"{spec.path}: not UTF-8 JSON"
    except json.JSONDecodeError as exc:
        return f"{spec.path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
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
