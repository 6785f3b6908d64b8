"""``--set NODE.FIELD=VALUE``: per-run retry overrides that never touch prompt digests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from runtime.errors import UsageError
from runtime.failures import FailureClass
from runtime.plan.manifest import Manifest
from runtime.run.policy import NodeOverrides
from runtime.run.records import RETRY_FIELDS

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def parse_value(field: str, raw: str, where: str) -> Any:
    """One override's value, checked; a usage error that starts with ``where`` otherwise."""
    if field == "max_attempts":
        if not raw.isdigit() or not 1 <= int(raw) <= 20:
            raise UsageError(f"{where}: max_attempts takes a whole number from 1 to 20")
        return int(raw)
    if field == "retry_feedback":
        if raw.lower() not in _TRUE | _FALSE:
            raise UsageError(f"{where}: retry_feedback takes true or false (or yes/no, "
                             "on/off, 1/0)")
        return raw.lower() in _TRUE
    if field in ("timeout_s", "rate_limit_wait_s"):
        try:
            seconds = float(raw)
        except ValueError:
            seconds = float("nan")
        # The bounds NodeOverrides enforces (a value past them was its traceback).
        low, high = (0, 24 * 3600) if field == "rate_limit_wait_s" else (0.001, 7 * 24 * 3600)
        if not low <= seconds <= high:  # NaN fails both comparisons
            raise UsageError(f"{where}: {field} takes seconds, a number from {low:g} to "
                             f"{high}")
        return seconds
    classes = [c.strip() for c in raw.split(",") if c.strip()]
    valid = {c.value for c in FailureClass}
    bad = [c for c in classes if c not in valid]
    if bad:
        raise UsageError(f"{where}: unknown failure class {bad[0]!r}; retry_on takes a "
                         f"comma-separated list of: {', '.join(sorted(valid))}")
    return classes


def split_set(item: str) -> tuple[str, str, str] | None:
    """``NODE.FIELD=VALUE`` as (node, field, value); None when it is not of that form."""
    lhs, sep, raw = item.partition("=")
    node, dot, field = lhs.rpartition(".")
    return (node, field, raw) if sep and dot else None


def parse_sets(sets: Sequence[str], manifest: Manifest) -> dict[str, NodeOverrides]:
    """Parse every ``--set``; ``*`` applies to all nodes. Errors name the flag."""
    out: dict[str, dict[str, Any]] = {}
    for item in sets:
        where = f"--set {item}"
        parts = split_set(item)
        if parts is None:
            raise UsageError(f"{where}: expected NODE.FIELD=VALUE")
        node, field, raw = parts
        if field not in RETRY_FIELDS:
            raise UsageError(f"{where}: {field!r} cannot be set per run; settable: "
                             f"{', '.join(RETRY_FIELDS)}")
        targets = sorted(manifest.nodes) if node == "*" else [node]
        if node != "*" and node not in manifest.nodes:
            raise UsageError(f"{where}: no node {node!r} in the plan; nodes: "
                             f"{', '.join(sorted(manifest.nodes))}")
        value = parse_value(field, raw, where)
        for target in targets:
            out.setdefault(target, {})[field] = value
    return {node: NodeOverrides.model_validate(values) for node, values in out.items()}
