"""Batches: many topologies planned and run with bounded concurrency and one summary.

Each topology gets the run id ``<batch-id>-<topology-name>``, so running the same batch
id again resumes what is unfinished and leaves finished runs alone. One topology that
fails to plan or run never stops the others: it is recorded as ``invalid`` or
``failed`` in ``artifacts/batches/<id>/summary.json``, which is rewritten atomically as
runs finish, together with ``findings.sarif`` beside it: every accepted SARIF artifact
of the batch merged (``findings.py``), with the counts per level in the summary.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from runtime.errors import DagRuntimeError, RecordError, UsageError
from runtime.failures import NodeStatus, RunStatus
from runtime.files import replace_atomically
from runtime.plan.compile import plan_topology, write_plan
from runtime.plan.manifest import CompiledPlan
from runtime.prompt.redact import Redactor
from runtime.report.findings import count_levels, merge, run_findings, write_sarif
from runtime.run.events import Event
from runtime.run.layout import check_run_id
from runtime.run.lock import hold
from runtime.run.overrides import parse_sets, split_set
from runtime.run.policy import NodeOverrides
from runtime.run.preflight import Decision, apply, preflight_batch
from runtime.run.records import RunSettings, read_attempt_context
from runtime.run.start import Hooks, RunResult, default_run_id, resume_run, start_run
from runtime.run.state import RunState
from runtime.run.summary import BatchEntry, BatchSummary, EntryStatus, NodeSummary


@dataclass(frozen=True)
class BatchOptions:
    """The settings of one ``runtime batch``, applied to every topology in it.

    Attributes:
        prompts: the prompts root templates are loaded from.
        artifacts: the artifacts root runs and the batch directory are written under.
        jobs: how many topologies run at once.
        node_jobs: how many nodes of one run execute at once.
        agent: ``--agent``: one profile for every node (None: each node's own).
        sets: ``--set`` overrides, as given on the command line.
        batch_id: the batch's id (None: generated).
        redactor: the redactor for every prompt, log and record of the batch.
        preflight: check the agent profiles before anything runs.
        no_fallback: never move a node to a fallback profile.
        max_total_attempts: each run's attempt budget (None: unbounded).
        deadline_at: Unix time after which no attempt starts (None: no deadline).
        operator_prompt: text added to every prompt of every run (None: none).
        variables: topology variables (``--var``) for every topology.
        engine: where attempts run (None: the local engine).
    """
    prompts: Path
    artifacts: Path
    jobs: int = 2
    node_jobs: int = 1
    agent: str | None = None
    sets: tuple[str, ...] = ()
    batch_id: str | None = None
    redactor: Redactor = field(default_factory=Redactor)
    preflight: bool = True  # check agent profiles first (runtime/preflight.py)
    # The same run options as `runtime run`, applied to every run of the batch.
    no_fallback: bool = False
    max_total_attempts: int | None = None
    deadline_at: float | None = None
    operator_prompt: str | None = None
    variables: dict[str, str] = field(default_factory=dict)
    engine: Any = None  # --engine: one for every run of the batch; None: local


class Progress:
    """What the batch reports while it runs; the CLI plugs a rich display in here."""

    def started(self, source: str, name: str, nodes: int) -> None:
        """A run of topology ``source`` (called ``name``, with ``nodes`` nodes) has started."""
    def event(self, source: str, event: Event) -> None:
        """A run of the batch appended ``event`` to its ledger."""
    def finished(self, entry: BatchEntry) -> None:
        """A topology of the batch is done (or was refused): its summary entry."""


def expand(paths: Sequence[Path]) -> list[Path]:
    """Directories mean their ``*.yaml`` (sorted); files are taken as given."""
    out: list[Path] = []
    for path in paths:
        if path.is_dir():
            out += sorted(path.glob("*.yaml"))
        elif path.is_file():
            out.append(path)
        else:
            raise UsageError(f"{path}: no such topology file or directory")
    if not out:
        raise UsageError(f"no topologies found in {', '.join(map(str, paths))}")
    return out


def run_batch(paths: Sequence[Path], options: BatchOptions, progress: Progress | None = None,
              cancel: threading.Event | None = None,
              on_entry: Callable[[BatchEntry], BatchEntry] | None = None) -> BatchSummary:
    """Plan and run every topology; return (and write) the summary."""
    topologies = expand(paths)
    batch_id = check_run_id(options.batch_id or default_run_id("batch"), "--batch-id")
    batch_dir = options.artifacts / "batches" / batch_id
    progress = progress or Progress()
    cancel = cancel or threading.Event()
    # Plan everything first: a bad topology is reported, and a --set naming a node that
    # no topology has is refused, before anything runs.
    planned = {str(path): _plan(path, options) for path in topologies}
    overrides = _overrides(options.sets, planned)
    decisions = _preflight(planned, options) if options.preflight else {}
    with hold(batch_dir, f"batch {batch_id}"):
        _check_same_batch(batch_dir, batch_id, planned, options.artifacts)
        return _run_locked(topologies, planned, overrides, decisions, batch_id, batch_dir,
                           options, progress, cancel, on_entry)


def _check_same_batch(batch_dir: Path, batch_id: str, planned: dict[str, CompiledPlan
                      | BatchEntry], artifacts: Path) -> None:
    """Resuming a batch takes every topology it ran, each compiling to the same plan.

    Otherwise the batch would be rewritten in silence: its summary would drop the runs
    not given again, or report an old run under a topology that now means another plan.
    Topologies are matched by name (paths are as typed, relative to wherever the batch
    was started); more topologies than before join the batch, as after a crash that
    left some not yet started.
    """
    path = batch_dir / "summary.json"
    if not path.is_file():
        return
    try:
        old = BatchSummary.model_validate_json(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise RecordError(path, f"cannot be read to resume the batch: {exc}") from None
    given = {p.manifest.topology.name for p in planned.values() if isinstance(p, CompiledPlan)}
    missing = [f"{e.topology} ({e.source})" for e in old.entries
               if e.topology is not None and e.topology not in given]
    if missing:
        raise UsageError(
            f"batch {batch_id} has runs of {', '.join(missing)} that this command does not "
            "give (or that no longer compile): give the same topologies to resume it, or "
            "another --batch-id")
    changed = []
    for source, plan in planned.items():
        if not isinstance(plan, CompiledPlan):
            continue
        ledger = artifacts / "runs" / run_id_of(batch_id, plan) / "ledger.jsonl"
        first = _first_plan_digest(ledger)
        if first is not None and first != plan.digest:
            changed.append(f"{source} (plan {first[:12]} -> {plan.digest[:12]})")
    if changed:
        raise UsageError(f"batch {batch_id}: {', '.join(changed)} changed since the batch ran "
                         "it; run the new version under another --batch-id")


def run_id_of(batch_id: str, plan: CompiledPlan) -> str:
    """The run id a batch gives a topology's run: one run per topology name."""
    return f"{batch_id}-{plan.manifest.topology.name}"


def _first_plan_digest(ledger: Path) -> str | None:
    """The plan digest a run started with (its ledger's first line), or None."""
    try:
        with open(ledger, "rb") as fh:
            return str(json.loads(fh.readline()).get("plan_digest")) or None
    except (OSError, ValueError, AttributeError):
        return None


# PLR0913: Private body of run_batch under its lock: the batch's already-built parts.
def _run_locked(topologies: list[Path], planned: dict[str, CompiledPlan | BatchEntry],  # noqa: PLR0913
                overrides: dict[str, dict[str, NodeOverrides]],
                decisions: dict[str, Decision], batch_id: str, batch_dir: Path,
                options: BatchOptions, progress: Progress, cancel: threading.Event,
                on_entry: Callable[[BatchEntry], BatchEntry] | None) -> BatchSummary:
    entries: dict[str, BatchEntry] = {}
    lock = threading.Lock()
    batch_dir.mkdir(parents=True, exist_ok=True)

    def one(path: Path) -> BatchEntry:
        entry = _run_one(path, planned[str(path)], overrides.get(str(path), {}), batch_id,
                         options, progress, cancel, decisions.get(str(path)))
        if on_entry is not None:
            entry = on_entry(entry)
        with lock:
            entries[str(path)] = entry
            _write_summary(batch_dir, batch_id, topologies, entries, cancel)
        progress.finished(entry)
        return entry

    with ThreadPoolExecutor(max_workers=options.jobs, thread_name_prefix="topology") as pool:
        futures = [pool.submit(one, path) for path in topologies]
        try:
            for fut in as_completed(futures):
                fut.result()
        except KeyboardInterrupt:
            cancel.set()
            for fut in futures:
                fut.result()
    return _write_summary(batch_dir, batch_id, topologies, entries, cancel, final=True)


def _plan(path: Path, options: BatchOptions) -> CompiledPlan | BatchEntry:
    try:
        return plan_topology(path, options.prompts, options.variables or None)
    except DagRuntimeError as exc:
        return BatchEntry(source=str(path), status="invalid", error=str(exc))


def _overrides(sets: Sequence[str], planned: dict[str, CompiledPlan | BatchEntry],
               ) -> dict[str, dict[str, NodeOverrides]]:
    """Each topology's share of ``--set``; a node no topology has is a usage error."""
    plans = {src: p for src, p in planned.items() if isinstance(p, CompiledPlan)}
    for item in sets:
        node = _node_of(item)
        if node != "*" and not any(node in p.manifest.nodes for p in plans.values()):
            raise UsageError(f"--set {item}: no topology in this batch has a node {node!r}")
    return {src: _sets_for(sets, p.manifest) for src, p in plans.items()}


def _preflight(planned: dict[str, CompiledPlan | BatchEntry], options: BatchOptions,
               ) -> dict[str, Decision]:
    plans = {src: (p.manifest, RunSettings(agent=options.agent, no_fallback=options.no_fallback))
             for src, p in planned.items() if isinstance(p, CompiledPlan)}
    return preflight_batch(plans, redactor=options.redactor)


# PLR0913: Private: one run's plan, overrides and decision, plus the batch-wide context.
def _run_one(path: Path, plan: CompiledPlan | BatchEntry, overrides: dict[str, NodeOverrides],  # noqa: PLR0913
             batch_id: str, options: BatchOptions, progress: Progress,
             cancel: threading.Event, decision: Decision | None = None) -> BatchEntry:
    if isinstance(plan, BatchEntry):
        return plan
    manifest = plan.manifest
    name = manifest.topology.name
    run_id = run_id_of(batch_id, plan)
    run_dir = options.artifacts / "runs" / run_id
    progress.started(str(path), name, len(manifest.nodes))
    hooks = Hooks(cancel=cancel, after_append=lambda ev: progress.event(str(path), ev),
                  engine=options.engine)
    try:
        if (run_dir / "ledger.jsonl").exists():
            result = resume_run(run_dir, redactor=options.redactor, hooks=hooks)
        else:
            plan_dir = write_plan(plan, options.artifacts)
            settings = RunSettings(agent=options.agent, jobs=options.node_jobs,
                                   overrides=overrides, no_fallback=options.no_fallback,
                                   max_total_attempts=options.max_total_attempts,
                                   deadline_at=options.deadline_at,
                                   operator_prompt=options.operator_prompt)
            settings = apply(settings, decision) if decision else settings
            result = start_run(plan_dir, options.artifacts, settings, run_id=run_id,
                               redactor=options.redactor, hooks=hooks, verified=True)
    except DagRuntimeError as exc:
        return BatchEntry(source=str(path), topology=name, plan_digest=plan.digest,
                          run_id=run_id, status="invalid", error=str(exc))
    return entry_of(path, result)


def _sets_for(sets: Sequence[str], manifest: Any) -> dict[str, NodeOverrides]:
    """``--set`` items for nodes this topology has (others belong to other topologies)."""
    mine = [s for s in sets if _node_of(s) in (*manifest.nodes, "*")]
    return parse_sets(mine, manifest)


def _node_of(item: str) -> str:
    """The NODE of a ``--set`` item ("" when malformed: parse_sets names the error)."""
    parts = split_set(item)
    return parts[0] if parts else ""


def entry_of(path: Path, result: RunResult) -> BatchEntry:
    """Summarise a finished run of topology ``path`` as its batch entry."""
    state: RunState = result.state
    nodes, after_feedback = {}, []
    for nid, ns in state.nodes.items():
        fed = _succeeded_after_feedback(result.run_dir, nid, ns)
        if fed:
            after_feedback.append(nid)
        last = ns.last_failure if ns.status is NodeStatus.FAILED else None
        nodes[nid] = NodeSummary(status=ns.status, attempts=len(ns.attempts),
                                 failure=ns.failure.value if ns.failure else None,
                                 summary=last.summary if last else "",
                                 succeeded_after_feedback=fed)
    status: EntryStatus = {RunStatus.SUCCEEDED: "succeeded", RunStatus.CANCELLED: "cancelled"
                           }.get(result.status, "failed")  # type: ignore[assignment]
    return BatchEntry(source=str(path), topology=state.topology, plan_digest=state.plan_digest,
                      run_id=result.run_id, run_dir=str(result.run_dir), status=status,
                      nodes=nodes, retries_after_feedback=after_feedback,
                      findings=count_levels(run_findings(result.run_dir).findings))


def _succeeded_after_feedback(run_dir: Path, nid: str, ns: Any) -> bool:
    if ns.status is not NodeStatus.SUCCEEDED or not ns.attempts:
        return False
    try:
        ctx = read_attempt_context(run_dir / "nodes" / nid / "attempts"
                                   / str(ns.attempts[-1].attempt))
    except RecordError:  # removed or replaced after the run: no claim either way
        return False
    return ctx.preamble_digest is not None


# PLR0913: Private writer of summary.json; ``final`` is keyword-only.
def _write_summary(batch_dir: Path, batch_id: str, topologies: list[Path],  # noqa: PLR0913
                   entries: dict[str, BatchEntry], cancel: threading.Event, *,
                   final: bool = False) -> BatchSummary:
    ordered = [entries[str(p)] for p in topologies if str(p) in entries]
    # Cancelled when a run was stopped or never got to run; a Ctrl-C after every run
    # had finished changes nothing.
    unfinished = len(ordered) < len(topologies)
    if any(e.status == "cancelled" for e in ordered) or (cancel.is_set() and unfinished):
        status: Literal["succeeded", "failed", "cancelled"] = "cancelled"
    elif len(ordered) == len(topologies) and all(e.status == "succeeded" for e in ordered):
        status = "succeeded"
    else:
        status = "failed"
    counts = count_levels([])
    for e in ordered:
        for level, n in e.findings.items():
            counts[level] = counts.get(level, 0) + n
    findings_file = None
    if final:  # merged once at the end: re-reading every run per finished entry is O(n^2)
        findings = merge(Path(e.run_dir) for e in ordered if e.run_dir is not None)
        findings_file = str(write_sarif(batch_dir / "findings.sarif", findings))
        counts = findings.counts()
    summary = BatchSummary(batch_id=batch_id, status=status, entries=ordered,
                           report=str(batch_dir / "report.html"),
                           findings=counts, findings_file=findings_file)
    portable = _relative_paths(summary, batch_dir.parent.parent)
    replace_atomically(batch_dir / "summary.json",
                       (portable.model_dump_json(indent=2) + "\n").encode())
    return summary


def _relative_paths(summary: BatchSummary, root: Path) -> BatchSummary:
    """summary.json names files relative to the artifacts root.

    No host path in a record, and the artifacts tree can be moved or uploaded whole (runs
    are found by run id).
    """
    def rel(path: str | None) -> str | None:
        if path is None or not os.path.isabs(path):
            return path
        inside = os.path.relpath(path, root)
        return path if inside.startswith("..") else inside

    return summary.model_copy(update={
        "report": rel(summary.report), "findings_file": rel(summary.findings_file),
        "entries": [e.model_copy(update={"run_dir": rel(e.run_dir), "report": rel(e.report)})
                    for e in summary.entries]})


def rewrite_summary(batch_dir: Path) -> BatchSummary:
    """Rebuild a batch's summary, findings.sarif and report from its runs (after ``runtime retry``).

    Re-read every run of a batch (after ``runtime retry``) and write its summary,
    findings.sarif and report again; entries without a run (invalid) stay as they were.
    """
    from runtime.report.html import render_batch_report
    from runtime.run.read import load_run

    old = BatchSummary.model_validate_json((batch_dir / "summary.json").read_bytes())
    entries: dict[str, BatchEntry] = {}
    for e in old.entries:
        if e.run_dir is None or e.run_id is None:
            entries[e.source] = e
            continue
        run_dir = batch_dir.parent.parent / "runs" / e.run_id
        _, state = load_run(run_dir)
        entry = entry_of(Path(e.source), RunResult(state.run_id, run_dir, state.status, state))
        if e.report is not None:
            entry = entry.model_copy(update={"report": str(run_dir / "report.html")})
        entries[e.source] = entry
    summary = _write_summary(batch_dir, old.batch_id, [Path(e.source) for e in old.entries],
                             entries, threading.Event(), final=True)
    render_batch_report(summary, batch_dir)
    return summary
