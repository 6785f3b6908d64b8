"""``summary.json`` of a batch.

One entry per topology, written by ``batch`` and read by the batch report.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from runtime.failures import NodeStatus

EntryStatus = Literal["succeeded", "failed", "cancelled", "invalid"]


class NodeSummary(BaseModel):
    """One node of one run, as a batch's ``summary.json`` reports it.

    Attributes:
        status: the node's terminal (or, for a cancelled run, last) status.
        attempts: how many attempts the node made.
        failure: the failure class that ended the node, when it failed.
        summary: the last failed attempt's one-line summary: the agent's own reason when
            recognised.
        succeeded_after_feedback: the node succeeded on an attempt that received the retry
            preamble (the measure of whether feedback helps).
    """
    model_config = ConfigDict(frozen=True, extra="forbid")

    status: NodeStatus
    attempts: int
    failure: str | None = None
    summary: str = Field(default="", description="The last failed attempt's one-line "
                         "summary: the agent's own reason when recognised.")
    succeeded_after_feedback: bool = False


class BatchEntry(BaseModel):
    """One topology of a batch, as ``summary.json`` reports it.

    Attributes:
        source: the topology file or plan directory the entry came from, as given.
        topology: the topology's name (None when it could not be planned).
        plan_digest: the plan's digest (None when it could not be planned).
        run_id: the run's id (None when no run started).
        run_dir: the run directory, relative to the artifacts root (None without a run).
        status: succeeded, failed, cancelled, or invalid (refused before running).
        error: why the entry is invalid, or why its run stopped.
        nodes: each node's summary, by node id.
        retries_after_feedback: nodes that succeeded on an attempt that received the retry
            preamble.
        report: the run's HTML report, relative to the artifacts root.
        findings: findings of this run per SARIF level.
    """
    model_config = ConfigDict(frozen=True, extra="forbid")

    source: str
    topology: str | None = None
    plan_digest: str | None = None
    run_id: str | None = None
    run_dir: str | None = None
    status: EntryStatus
    error: str | None = None
    nodes: dict[str, NodeSummary] = Field(default_factory=dict)
    retries_after_feedback: list[str] = Field(
        default_factory=list, description="Nodes that succeeded on an attempt that received "
        "the retry preamble.")
    report: str | None = None
    findings: dict[str, int] = Field(
        default_factory=dict, description="Findings of this run per SARIF level.")


class BatchSummary(BaseModel):
    """``artifacts/batches/<id>/summary.json``: what a batch came to, one entry per topology.

    Attributes:
        schema_version: the format version of ``summary.json``.
        batch_id: the batch's id (its directory name under ``batches/``).
        status: how the batch ended: succeeded, failed, or cancelled.
        entries: one entry per topology, in the order given.
        report: the batch's HTML report, relative to the artifacts root.
        findings: findings of the batch per SARIF level (error, warning, note, none), as
            merged into findings.sarif.
        findings_file: findings.sarif, beside this summary.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1] = 1
    batch_id: str
    status: Literal["succeeded", "failed", "cancelled"]
    entries: list[BatchEntry]
    report: str | None = None
    findings: dict[str, int] = Field(
        default_factory=dict, description="Findings of the batch per SARIF level "
        "(error, warning, note, none), as merged into findings.sarif.")
    findings_file: str | None = Field(
        default=None, description="findings.sarif, beside this summary.")
