"""Records written to disk by a run, besides ledger events.

Run settings and ``attempt.json``. Frozen, versioned, ``extra="forbid"`` like every on-disk
record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from runtime.digest import blake3_hex
from runtime.errors import RecordError
from runtime.failures import FailureClass, Outcome
from runtime.files import read_capped
from runtime.prompt.feedback import PriorFailure
from runtime.run.contract import AcceptanceSummary
from runtime.run.policy import NodeOverrides

ATTEMPT_JSON_MAX = 4 * 1024 * 1024


RETRY_FIELDS = ("max_attempts", "retry_feedback", "retry_on", "timeout_s", "rate_limit_wait_s")


class RunSettings(BaseModel):
    """Run-level choices, recorded in ``run.started`` so a resume behaves the same.

    Attributes:
        agent: ``--agent``: one profile for all nodes (None: each node's own).
        no_fallback: never move a node to a fallback profile.
        jobs: how many nodes execute at once.
        max_total_attempts: the run's attempt budget across all nodes (None: unbounded).
        deadline_at: Unix time after which no attempt starts (None: no limit).
        overrides: ``--set NODE.field=value`` retry overrides, by node.
        skip_profiles: profiles that failed pre-flight, with why: their nodes start on
            their next fallback.
        operator_prompt: trusted text added to every prompt; never serialised (it may
            hold anything), kept in ``operator-prompt.md``.
        operator_prompt_digest: blake3 of the operator prompt, recorded in its place.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    agent: str | None = Field(default=None, description="--agent: one profile for all nodes.")
    no_fallback: bool = False
    jobs: int = Field(default=1, ge=1, le=256)
    max_total_attempts: int | None = Field(default=None, ge=1)
    deadline_at: float | None = Field(default=None, description="Unix time; none: no limit.")
    overrides: dict[str, NodeOverrides] = Field(
        default_factory=dict, description="--set NODE.field=value retry overrides.")
    skip_profiles: dict[str, str] = Field(
        default_factory=dict, description="Profiles that failed pre-flight, with why: "
        "their nodes start on their next fallback.")
    # The operator prompt is trusted text but may hold anything (a token, a host name):
    # the ledger and state.json record its digest; the text lives in operator-prompt.md.
    operator_prompt: str | None = Field(default=None, exclude=True)
    operator_prompt_digest: str | None = None

    @model_validator(mode="after")
    def _digest_of_the_operator_prompt(self) -> RunSettings:
        if self.operator_prompt is not None:
            digest = blake3_hex(self.operator_prompt.encode())
            if self.operator_prompt_digest not in (None, digest):
                raise ValueError("operator_prompt_digest does not match operator_prompt")
            object.__setattr__(self, "operator_prompt_digest", digest)
        return self


class SandboxRecord(BaseModel):
    """How a ``command`` agent's attempt was contained (issue 8).

    Attributes:
        enabled: false: the profile opted out with ``sandbox: false``.
        bubblewrap: bubblewrap's version (None when not sandboxed).
        network: whether the network was allowed in the sandbox.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(description="false: the profile opted out with sandbox: false.")
    bubblewrap: str | None = Field(default=None, description="bubblewrap's version.")
    network: bool | None = Field(default=None, description="network allowed in the sandbox")


class AttemptContext(BaseModel):
    """``attempts/<n>/attempt.json``: the attempt's context, then its outcome.

    Written once before the agent starts (outcome null) and replaced when it ends.
    ``RUNTIME_ATTEMPT_CONTEXT`` points agents at this file. The ledger, not this file, is
    the record of truth: an agent can write this file, never the ledger.

    Attributes:
        schema_version: the format version of ``attempt.json``.
        run_id: the run's id.
        node: the node's id.
        attempt: this attempt's number.
        max_attempts: the highest attempt number this attempt's try can reach: the
            node's ceiling on charged attempts, counted on from the attempts before
            it that do not count (an earlier try's, before ``runtime retry``; lost
            or cancelled ones).
        trigger: ``initial`` or ``retry``.
        prior_attempt: the attempt this one retries (None for an initial attempt).
        profile: the agent profile the attempt runs on.
        profile_digest: blake3 of that profile as resolved for the run.
        plan_prompt_digest: blake3 of the node's prompt as planned.
        prompt_digest: blake3 of the prompt the agent was given (preamble included).
        preamble_digest: blake3 of the retry preamble (None: none was inserted).
        prior_failures: the earlier failures the preamble reports, newest first.
        sandbox: command agents only: the containment the attempt ran in.
        engine: the ``--engine`` the attempt ran on.
        worker_host: the host name the agent ran on.
        worker: the engine's worker id (a Ray node id).
        outcome: ``succeeded``, the failure class, or None while the attempt runs.
        failure_classes: the attempt's failure class as a list (empty on success).
        exit_code: the agent's exit status (None: stopped or never started).
        error: redacted, bounded error text.
        summary: one redacted line in the agent's own words, else the error's first line.
        acceptance: the artifact checks that held and failed.
        stdout_bytes: how many bytes the agent wrote to stdout.
        stderr_bytes: how many bytes the agent wrote to stderr.
        started_at: Unix time the attempt started.
        finished_at: Unix time it finished (None while it runs).
        duration_s: wall-clock seconds (None while it runs).
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
    engine: str = Field(default="local", description="--engine the attempt ran on")
    worker_host: str | None = Field(default=None, description="host name the agent ran on")
    worker: str | None = Field(default=None, description="engine's worker id (Ray node id)")
    outcome: Outcome | None = None
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


def read_attempt_context(attempt_dir: Path) -> AttemptContext:
    """Read ``attempts/<n>/attempt.json``, refusing links and oversized files.

    A missing or unreadable file is an error naming it (read without following links,
    size-capped: an agent may have planted either).
    """
    path = attempt_dir / "attempt.json"
    try:
        data = read_capped(path, ATTEMPT_JSON_MAX)
        return AttemptContext.model_validate_json(data)
    except (OSError, ValueError) as exc:
        raise RecordError(path, f"unreadable attempt record: {exc}") from None
