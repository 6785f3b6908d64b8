from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from runtime.plan.topology import ArtifactSpec
from runtime.run.contract import check_artifact, verify_artifacts


def _spec(**kw: Any) -> ArtifactSpec:
    return ArtifactSpec.model_validate({"path": "out.json", "kind": "json", **kw})


# The setup lambdas return whatever write_text/mkdir return; the value is ignored.
CASES: list[tuple[str, dict[str, Any], Callable[[Path], object], str | None]] = [
    ("valid", {}, lambda ws: (ws / "out.json").write_text('{"a": 1}'), None),
    ("missing names what exists", {}, lambda ws: (ws / "draft-out.json").write_text("{}"),
     "out.json: required artifact missing; the workspace has: draft-out.json"),
    ("missing empty", {}, lambda ws: None,
     "out.json: required artifact missing; the workspace has no files"),
    ("optional missing", {"required": False}, lambda ws: None, None),
    ("too large", {"max_bytes": 4}, lambda ws: (ws / "out.json").write_text('{"a": 1}'),
     "out.json: 8 bytes, over the limit of 4"),
    ("invalid json", {}, lambda ws: (ws / "out.json").write_text('{"a": '),
     "out.json: invalid JSON at line 1 column 7"),
    ("not utf-8", {}, lambda ws: (ws / "out.json").write_bytes(b"\xff\xfe"),
     "out.json: not UTF-8 JSON"),
    ("directory", {}, lambda ws: (ws / "out.json").mkdir(), "out.json: not a regular file"),
    ("schema", {"schema": {"type": "object", "required": ["findings"]}},
     lambda ws: (ws / "out.json").write_text('{"a": 1}'),
     "out.json: does not match its schema at (root): 'findings' is a required property"),
    ("symlink escape", {}, lambda ws: os.symlink("/etc/hostname", ws / "out.json"),
     "out.json: resolves outside the workspace (symlink escape); refused"),
    # A new user's trial: NaN passed, and the merged findings.sarif was no JSON at all;
    # 100k levels of nesting crashed the attempt (a launch_error with a traceback).
    ("NaN", {}, lambda ws: (ws / "out.json").write_text('{"rank": NaN}'),
     "out.json: invalid JSON: NaN is not a JSON value"),
    ("Infinity in sarif", {"kind": "sarif"},
     lambda ws: (ws / "out.json").write_text('{"version": "2.1.0", "runs": [], "x": -Infinity}'),
     "out.json: invalid JSON: -Infinity is not a JSON value"),
    ("deep nesting", {}, lambda ws: (ws / "out.json").write_text('{"a":' * 100_000 + "1"
                                                                 + "}" * 100_000),
     "out.json: nested too deeply to check"),
    ("deep nesting in sarif", {"kind": "sarif"},
     lambda ws: (ws / "out.json").write_text('{"a":' * 100_000 + "1" + "}" * 100_000),
     "out.json: nested too deeply to check"),
]


@pytest.mark.parametrize(("label", "spec", "setup", "expected"), CASES, ids=[c[0] for c in CASES])
def test_artifact_checks(tmp_path: Path, label: str, spec: dict[str, Any],
                         setup: Callable[[Path], object], expected: str | None) -> None:
    setup(tmp_path)
    problem = check_artifact(tmp_path, _spec(**spec))
    if expected is None:
        assert problem is None
    else:
        assert problem is not None
        assert problem.startswith(expected), problem


def test_inputs_are_not_listed_as_what_the_agent_wrote(tmp_path: Path) -> None:
    (tmp_path / "inputs" / "up").mkdir(parents=True)
    (tmp_path / "inputs" / "up" / "x.json").write_text("{}")
    assert check_artifact(tmp_path, _spec()) == \
        "out.json: required artifact missing; the workspace has no files"


def test_summary_separates_checked_from_unknown(tmp_path: Path) -> None:
    (tmp_path / "out.json").write_text("{}")
    summary = verify_artifacts(tmp_path, [_spec(), _spec(path="b.md", kind="file")],
                               ["every finding has a severity"])
    assert summary.satisfied == ["out.json: present and valid (json)"]
    assert summary.unsatisfied[0].startswith("b.md: required artifact missing")
    assert summary.unknown == ["every finding has a severity"]
