"""Records written to disk by a run, besides ledger events: run settings and
``attempt.json``. Frozen, versioned, ``extra="forbid"`` like every on-disk record."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .contract import AcceptanceSummary
from .failures import FailureClass

RETRY_FIELDS = ("max_attempts", "retry_feedback", "retry_on")


class RunSettings(BaseModel):
    """Run-level choices, recorded in ``run.started`` so a resume behaves the same."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    agent: str | None = Field(default=None, description="--agent: one profile for all nodes.")
    no_fallback: bool = False
    jobs: int = Field(default=1, ge=1, le=256)
    max_total_attempts: int | None = Field(default=None, ge=1)
    deadline_at: float | None = Field(default=None, description="Unix time; none: no limit.")
    overrides: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="--set NODE.field=value retry overrides.")
    operator_prompt: str | None = None


class PriorFailure(BaseModel):
    """One earlier failed attempt, as the retry preamble reports it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    attempt: int
    failure_class: FailureClass
    exit_code: int | None
    unsatisfied: list[str]
    error: str
    fingerprint: str


class SandboxRecord(BaseModel):
    """How a ``command`` agent's attempt was contained (issue 8)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(description="false: the profile opted out with sandbox: false.")
    bubblewrap: str | None = Field(default=None, description="bubblewrap's version.")
    network: bool | None = Field(default=None, description="network allowed in the sandbox")


class AttemptContext(BaseModel):
    """``attempts/<n>/attempt.json``: the attempt's context, then its outcome.

    Written once before the agent starts (outcome null) and replaced when it ends.
    ``RUNTIME_ATTEMPT_CONTEXT`` points agents at this file.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1] = 1
    run_id: str
    node: str
    attempt: int
    max_attempts: int
    trigger: Literal["initial", "retry"]
    prior_attempt: int | None
    profile: str
    profile_digest: str
    plan_prompt_digest: str
    prompt_digest: str
    preamble_digest: str | None
    prior_failures: list[PriorFailure] = Field(default_factory=list)
    sandbox: SandboxRecord | None = Field(
        default=None, description="command agents only: the containment the attempt ran in")
    outcome: Literal["succeeded"] | FailureClass | None = None
    failure_classes: list[FailureClass] = Field(default_factory=list)
    exit_code: int | None = None
    error: str = ""
    summary: str = ""
    acceptance: AcceptanceSummary = Field(default_factory=AcceptanceSummary)
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    started_at: float
    finished_at: float | None = None
    duration_s: float | None = None


def read_attempt_context(attempt_dir: Path) -> AttemptContext | None:
    """``attempts/<n>/attempt.json``, or None when missing or unreadable (a crash can
    leave an attempt directory without one)."""
    try:
        return AttemptContext.model_validate_json((attempt_dir / "attempt.json").read_bytes())
    except (OSError, ValueError):
        return None
