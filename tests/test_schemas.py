"""Schema golden files: an accidental change of an on-disk format fails here (issue 12.4).

Each record the runtime writes into a run directory (every ledger event, ``attempt.json``
and ``state.json``) has its JSON Schema pinned under ``tests/golden/schemas/``. A change
of the format needs a ``schema_version`` bump (and an upgrade of the old version where it
is read), then ``UPDATE_GOLDEN=1 pytest tests/test_schemas.py`` to rewrite the goldens.
A change of documentation only (a field's description, a docstring) is told apart: it
needs the regeneration, not the bump.
"""

from __future__ import annotations

import json
import os
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from runtime.plan.manifest import Manifest
from runtime.plan.verify import Golden
from runtime.run.events import Event
from runtime.run.records import AttemptContext
from runtime.run.state import RunState
from runtime.run.summary import BatchSummary

GOLDEN_DIR = Path(__file__).resolve().parent / "golden" / "schemas"
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"
REGENERATE = "UPDATE_GOLDEN=1 pytest tests/test_schemas.py"
DOC_KEYS = ("description", "title")  # documentation, not format


def _event_models() -> list[type[BaseModel]]:
    """The members of the ledger's discriminated union: a new event gets a golden too."""
    union = typing.get_args(Event)[0]
    return list(typing.get_args(union))


def pinned_models() -> dict[str, type[BaseModel]]:
    """Golden file name (without .json) -> the model whose schema it pins."""
    models: dict[str, type[BaseModel]] = {
        f"ledger.{m.model_fields['event'].default}": m for m in _event_models()}
    models["attempt"] = AttemptContext  # attempts/<n>/attempt.json
    models["state"] = RunState  # state.json
    return models


# Every record written to disk: the pinned ones, plus plan.json, golden digest files and
# a batch's summary.json (their bytes are pinned elsewhere: plan and golden digests).
ON_DISK: dict[str, type[BaseModel]] = {**pinned_models(), "plan": Manifest,
                                       "golden": Golden, "batch-summary": BatchSummary}


def schema_text(model: type[BaseModel]) -> str:
    """Deterministic: keys sorted, indent 2, one trailing newline."""
    return json.dumps(model.model_json_schema(), indent=2, sort_keys=True,
                      ensure_ascii=False) + "\n"


def _without_docs(node: Any) -> Any:
    """The schema with its documentation keywords removed. A keyword is only dropped
    with a string value: a *property* named ``description`` maps to a schema object."""
    if isinstance(node, dict):
        return {k: _without_docs(v) for k, v in node.items()
                if not (k in DOC_KEYS and isinstance(v, str))}
    if isinstance(node, list):
        return [_without_docs(v) for v in node]
    return node


def mismatch_message(name: str, model: type[BaseModel], golden: str, actual: str) -> str:
    path = GOLDEN_DIR / f"{name}.json"
    if _without_docs(json.loads(golden)) == _without_docs(json.loads(actual)):
        return (f"{path.name}: only the documentation of {model.__name__} changed "
                f"(descriptions or titles); the on-disk format is the same. Regenerate "
                f"with `{REGENERATE}` (no schema_version bump needed).")
    return (f"{path.name}: the JSON Schema of {model.__name__} changed, so the on-disk "
            f"format changed. If that is intended: bump its schema_version (and upgrade "
            f"the old version where it is read), then regenerate with `{REGENERATE}` and "
            f"review the diff. If it is not: undo the change. (A pydantic upgrade can "
            f"also change the generated schema with the same JSON on disk: regenerate.)")


@pytest.mark.parametrize("name", sorted(pinned_models()))
def test_schema_matches_its_golden_file(name: str) -> None:
    model = pinned_models()[name]
    path = GOLDEN_DIR / f"{name}.json"
    actual = schema_text(model)
    if UPDATE:
        GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
        path.write_text(actual, encoding="utf-8")
        return
    assert path.is_file(), (f"{path} is missing: a new on-disk record. Create it with "
                            f"`{REGENERATE}`.")
    golden = path.read_text(encoding="utf-8")
    assert golden == actual, mismatch_message(name, model, golden, actual)


def test_no_stale_golden_schema() -> None:
    """One golden file per pinned model, no more: a removed or renamed record's old
    schema would otherwise stay behind and pin nothing."""
    expected = {f"{name}.json" for name in pinned_models()}
    present = {p.name for p in GOLDEN_DIR.iterdir()} if GOLDEN_DIR.is_dir() else set()
    stale = sorted(present - expected)
    if UPDATE:
        for name in stale:
            (GOLDEN_DIR / name).unlink()
        return
    assert not stale, (f"stale golden schemas in {GOLDEN_DIR}: {', '.join(stale)} pin no "
                       f"model; remove them with `{REGENERATE}`")
    assert present == expected, f"missing golden schemas: {sorted(expected - present)}"


@pytest.mark.parametrize("name", sorted(ON_DISK))
def test_every_record_on_disk_starts_with_schema_version(name: str) -> None:
    """STYLE 3: frozen, extra="forbid", ``schema_version`` first, with a default so the
    writer always records it, and a Literal so a reader refuses a version it does not know."""
    model = ON_DISK[name]
    fields = list(model.model_fields)
    assert fields, f"{model.__name__}: first field is {fields[:1]}, expected schema_version"
    assert fields[0] == "schema_version", (
        f"{model.__name__}: first field is {fields[:1]}, expected schema_version")
    info = model.model_fields["schema_version"]
    assert typing.get_origin(info.annotation) is typing.Literal, (
        f"{model.__name__}.schema_version is {info.annotation}, expected a Literal")
    assert isinstance(info.default, int)
    assert info.default in typing.get_args(info.annotation)
    assert model.model_config.get("frozen") is True
    assert model.model_config.get("extra") == "forbid"
    assert "schema_version" in model.model_json_schema()["properties"]


def test_a_documentation_change_is_told_apart_from_a_format_change() -> None:
    """The failure message says whether a bump is needed."""
    model = pinned_models()["state"]
    golden = schema_text(model)
    data = json.loads(golden)
    data["properties"]["run_id"]["description"] = "Reworded."
    docs_only = json.dumps(data, indent=2, sort_keys=True) + "\n"
    assert "no schema_version bump needed" in mismatch_message("state", model, golden,
                                                               docs_only)
    data["properties"]["run_id"]["type"] = "integer"
    changed = json.dumps(data, indent=2, sort_keys=True) + "\n"
    message = mismatch_message("state", model, golden, changed)
    assert "bump its schema_version" in message
    assert REGENERATE in message


def test_a_property_named_description_is_format_not_documentation() -> None:
    schema = {"properties": {"description": {"type": "string"}}, "description": "doc"}
    assert _without_docs(schema) == {"properties": {"description": {"type": "string"}}}
