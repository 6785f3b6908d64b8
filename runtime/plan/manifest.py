"""The plan manifest (``plan.json``): its model, its exact bytes, and reading it back.

The manifest is the plan-time contract (DESIGN section 4): canonical JSON whose
BLAKE3 digest is the plan digest. ``verify`` and the run side read it through here;
``compile`` builds and writes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from runtime.digest import blake3_hex, canonical_json
from runtime.errors import PlanFormatError
from runtime.failures import FailureClass
from runtime.files import read_regular
from runtime.plan.dag import Dag
from runtime.plan.profiles import AgentProfile
from runtime.plan.topology import ArtifactSpec

MANIFEST_NAME = "plan.json"


# A 100k-node manifest is ~60 MB; the bound only stops a device or runaway file.
MANIFEST_MAX_BYTES = 1 << 30


PROMPTS_DIR = "prompts"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


class PlanNode(_Frozen):
    """A node as compiled: defaults resolved, prompt addressed by digest."""

    prompt_digest: str
    template: str
    needs: list[str]
    agent: str
    fallback: list[str]
    objective: str | None
    acceptance: list[str]
    max_attempts: int
    retry_feedback: bool
    retry_on: list[FailureClass]
    timeout_s: float
    backoff_s: float
    feedback_max_bytes: int
    artifacts: list[ArtifactSpec]


class PlanTopology(_Frozen):
    """The topology a plan was compiled from.

    Attributes:
        name: the topology's name.
        description: the topology's description, for reports.
        digest: blake3 of the topology's canonical JSON (vars applied).
    """
    name: str
    description: str
    digest: str = Field(description="blake3 of the topology's canonical JSON (vars applied).")


class Manifest(_Frozen):
    """``plan.json``. Its canonical JSON bytes hash to the plan digest."""

    schema_version: Literal[1] = 1
    topology: PlanTopology
    vars: dict[str, str | int | float | bool]
    agents: dict[str, AgentProfile]
    constants: dict[str, str]
    nodes: dict[str, PlanNode]

    def to_bytes(self) -> bytes:
        """The manifest's canonical JSON: the bytes written as ``plan.json`` and digested."""
        return canonical_json(self.model_dump(mode="json", by_alias=True))

    def dag(self) -> Dag:
        """The node graph (edges upstream -> downstream), for the scheduler and reports."""
        return Dag.of((nid, node.needs) for nid, node in self.nodes.items())

    def digest(self) -> str:
        """The plan digest: blake3 of the canonical ``plan.json`` bytes."""
        return blake3_hex(self.to_bytes())


@dataclass(frozen=True)
class CompiledPlan:
    """A plan in memory: the manifest, its exact bytes, and each rendered prompt."""

    manifest: Manifest
    manifest_bytes: bytes
    prompts: MappingProxyType[str, bytes]

    @property
    def digest(self) -> str:
        """The plan digest, of the exact ``plan.json`` bytes held."""
        return blake3_hex(self.manifest_bytes)


def read_manifest(plan_dir: Path) -> tuple[Manifest, bytes]:
    """Read and parse ``plan.json``; raise PlanFormatError naming what is wrong."""
    path = plan_dir / MANIFEST_NAME
    try:
        raw = read_regular(path, MANIFEST_MAX_BYTES)
    except OSError as exc:
        raise PlanFormatError(path, f"cannot read manifest: {exc.strerror}") from None
    except ValueError as exc:
        raise PlanFormatError(path, f"cannot read manifest: {exc}") from None
    return parse_manifest(raw, path), raw


def parse_manifest(raw: bytes, path: Path) -> Manifest:
    """Validate manifest bytes (read from ``path``, named in errors)."""
    try:
        return Manifest.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise PlanFormatError(path, f"not a plan manifest ({exc.error_count()} errors; first "
                              f"at {loc or 'top level'}: {first['msg']})") from None
