"""Digest-contract checks for CI (DESIGN section 4).

``verify_plan_dir``: every prompt file hashes to its name, the manifest lists exactly the
files present, ``plan.json`` is canonical and hashes to the plan digest.
``verify_golden``: re-planning a topology reproduces the digests its golden file records.
Both return the list of differences; an empty list means the contract holds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from runtime.digest import (
    PLAN_DIR_PREFIX_LEN,
    blake3_hex,
    canonical_json,
    file_blake3,
    is_digest,
    is_hex,
)
from runtime.errors import PlanFormatError
from runtime.files import read_regular
from runtime.plan.manifest import (
    MANIFEST_MAX_BYTES,
    MANIFEST_NAME,
    PROMPTS_DIR,
    CompiledPlan,
    parse_manifest,
)


# C901: Each check appends its difference so all are reported at once (STYLE rule 7).
def verify_plan_dir(plan_dir: Path, expected_digest: str | None = None) -> list[str]:  # noqa: C901
    """Check a plan directory against its own manifest; return every difference found."""
    manifest_path = plan_dir / MANIFEST_NAME
    if not manifest_path.is_file():
        return [f"{manifest_path}: missing manifest"]
    try:
        raw = read_regular(manifest_path, MANIFEST_MAX_BYTES)
    except OSError as exc:
        return [f"{manifest_path}: cannot read manifest: {exc.strerror}"]
    except ValueError as exc:
        return [f"{manifest_path}: cannot read manifest: {exc}"]
    digest = blake3_hex(raw)
    problems: list[str] = []
    if expected_digest is not None and digest != expected_digest:
        problems.append(f"{manifest_path}: plan digest is {digest}, expected {expected_digest}")
    name = plan_dir.resolve().name
    if len(name) == PLAN_DIR_PREFIX_LEN and is_hex(name) and not digest.startswith(name):
        problems.append(f"{manifest_path}: hashes to {digest}, which does not match the plan "
                        f"directory name {name} (manifest edited?)")
    try:
        if canonical_json(json.loads(raw)) != raw:
            problems.append(f"{manifest_path}: not canonical JSON (edited by hand?)")
        manifest = parse_manifest(raw, manifest_path)
    except (ValueError, PlanFormatError) as exc:
        return [*problems, f"{manifest_path}: {exc}"]
    listed = {n.prompt_digest for n in manifest.nodes.values()}
    prompts_dir = plan_dir / PROMPTS_DIR
    present = {p.name: p for p in prompts_dir.iterdir()} if prompts_dir.is_dir() else {}
    for fname, path in sorted(present.items()):
        stem = fname.removesuffix(".md")
        if not fname.endswith(".md") or not is_digest(stem) or stem not in listed:
            problems.append(f"{path}: extra file not listed in the manifest")
            continue
        if not path.is_file() or path.is_symlink():
            problems.append(f"{path}: not a regular file")
            continue
        actual = file_blake3(path)
        if actual != stem:
            problems.append(f"{path}: modified: content hashes to {actual}")
    for digest_ in sorted(listed - {f.removesuffix(".md") for f in present}):
        owners = sorted(n for n, pn in manifest.nodes.items() if pn.prompt_digest == digest_)
        problems.append(f"{prompts_dir / (digest_ + '.md')}: missing (prompt of "
                        f"{', '.join(owners)})")
    return problems


class Golden(BaseModel):
    """Digests a reviewed plan must reproduce; written by ``runtime plan --golden-out``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1] = 1
    topology: str
    vars: dict[str, str]
    plan_digest: str
    constants: dict[str, str]
    nodes: dict[str, str]


def golden_of(plan: CompiledPlan, overrides: dict[str, str]) -> Golden:
    """The golden record of a compiled plan: its digests, for ``runtime verify --golden``."""
    m = plan.manifest
    return Golden(
        topology=m.topology.name,
        vars=dict(sorted(overrides.items())),
        plan_digest=plan.digest,
        constants=dict(m.constants),
        nodes={nid: n.prompt_digest for nid, n in sorted(m.nodes.items())},
    )


def golden_bytes(golden: Golden) -> bytes:
    """Golden files are reviewed in diffs: indented, sorted, one trailing newline."""
    return (json.dumps(golden.model_dump(mode="json"), indent=2, sort_keys=True) + "\n").encode()


GOLDEN_MAX_BYTES = 64 * 1024 * 1024


def read_golden(path: Path) -> Golden:
    """Read a golden file; an unreadable or malformed one is an error naming it."""
    try:
        return Golden.model_validate_json(read_regular(path, GOLDEN_MAX_BYTES))
    except OSError as exc:
        raise PlanFormatError(path, f"cannot read golden file: {exc.strerror}") from None
    except ValueError as exc:  # pydantic's ValidationError is a ValueError too
        if isinstance(exc, ValidationError):
            raise PlanFormatError(path, f"not a golden digest file: {exc.errors()[0]['msg']} "
                                  f"at {'.'.join(map(str, exc.errors()[0]['loc']))}") from None
        raise PlanFormatError(path, f"cannot read golden file: {exc}") from None


def diff_golden(expected: Golden, actual: Golden) -> list[str]:
    """Every difference between a golden file and a fresh plan, prompt by prompt."""
    out: list[str] = []
    if expected.topology != actual.topology:
        out.append(f"topology: the golden file is for {expected.topology!r}, this topology is "
                   f"{actual.topology!r} (the wrong --golden file?)")
    for nid in sorted(set(expected.nodes) | set(actual.nodes)):
        old, new = expected.nodes.get(nid), actual.nodes.get(nid)
        if old is None:
            out.append(f"node {nid}: new node (prompt {new})")
        elif new is None:
            out.append(f"node {nid}: removed (golden prompt {old})")
        elif old != new:
            out.append(f"node {nid}: prompt digest {old} -> {new}")
    for key in sorted(set(expected.constants) | set(actual.constants)):
        if expected.constants.get(key) != actual.constants.get(key):
            out.append(f"constant {key}: {expected.constants.get(key)} -> "
                       f"{actual.constants.get(key)}")
    if expected.plan_digest != actual.plan_digest:
        same = "" if out else (" (every prompt and constant is unchanged: a setting in "
                               "plan.json changed, such as an agent profile, retry settings, "
                               "artifacts or acceptance)")
        out.append(f"plan digest {expected.plan_digest} -> {actual.plan_digest}{same}")
    return out

