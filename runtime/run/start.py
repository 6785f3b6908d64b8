"""Start and resume runs: the I/O edge around the scheduler.

``start_run`` verifies the plan, lays out ``artifacts/runs/<run-id>/`` (DESIGN section
5), records ``run.started`` with the run settings, and drives the DAG. ``resume_run``
folds the ledger, records every started-but-unfinished attempt as ``lost``, and drives
what is left with the settings the run started with. The run directory is
self-contained: a resume needs neither the plan directory nor the topology.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from runtime.agents.procs import AGENT_RECORD, kill_leftovers, run_key
from runtime.agents.sandbox import require_bubblewrap, sandboxed_profiles
from runtime.digest import blake3_hex
from runtime.errors import PlanIntegrityError, UsageError
from runtime.failures import NodeStatus, Outcome, RunStatus
from runtime.files import fsync_dir, read_capped, write_read_only
from runtime.plan.manifest import PROMPTS_DIR, Manifest, read_manifest
from runtime.plan.verify import verify_plan_dir
from runtime.prompt.redact import Redactor
from runtime.run.context import AttemptBudget, RunContext
from runtime.run.engine import Engine, LocalEngine
from runtime.run.events import AttemptFinished, Event, RunStarted
from runtime.run.layout import RunLayout, check_run_id, remove_tree
from runtime.run.ledger import Ledger
from runtime.run.lock import hold
from runtime.run.read import load_run
from runtime.run.records import RunSettings
from runtime.run.scheduler import Scheduler
from runtime.run.state import RunState, fold, write_final_state

OPERATOR_PROMPT_MAX = 1 << 20  # as --operator-prompt accepts


LOST_ERROR = "the runtime stopped before this attempt finished (crash, kill or power loss)"


@dataclass(frozen=True)
class RunResult:
    """What a run came to: its id, directory, final status and folded state."""
    run_id: str
    run_dir: Path
    status: RunStatus
    state: RunState
    resumed: bool = True  # False: `resume` found the run already finished, nothing ran


@dataclass(frozen=True)
class Hooks:
    """Test and CLI seams: a cancel event, a clock, and a callback after each append."""

    cancel: threading.Event | None = None
    after_append: Callable[[Event], None] | None = None
    clock: Callable[[], float] = time.time
    engine: Engine | None = None  # --engine; None: the local engine


def default_run_id(topology: str) -> str:
    """A new run id: the topology, a UTC timestamp and random hex (sortable and unique)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return f"{topology}-{stamp}-{secrets.token_hex(3)}"


def check_settings(manifest: Manifest, settings: RunSettings) -> None:
    """Refuse settings that name a profile, node or field the plan does not have."""
    known = ", ".join(sorted(manifest.agents))
    if settings.agent is not None and settings.agent not in manifest.agents:
        raise UsageError(f"--agent {settings.agent}: topology {manifest.topology.name!r} has "
                         f"no such profile; its profiles (and the built-in ones): {known}")
    for node in settings.overrides:
        if node not in manifest.nodes:
            raise UsageError(f"--set {node}.*: no node {node!r} in the plan; nodes: "
                             f"{', '.join(sorted(manifest.nodes))}")
    _require_sandbox(manifest, settings)


def _require_sandbox(manifest: Manifest, settings: RunSettings) -> None:
    """Refuse a run that needs bubblewrap when bubblewrap is missing.

    Issue 8: with bubblewrap missing, a profile that did not opt out of the sandbox refuses
    to start (exit 2) before any node runs, rather than failing every attempt.
    """
    used = {settings.agent} if settings.agent else {
        name for node in manifest.nodes.values()
        for name in [node.agent, *([] if settings.no_fallback else node.fallback)]}
    require_bubblewrap(sandboxed_profiles(manifest.agents, used))


# PLR0913: Public entry point; everything after ``settings`` is keyword-only and optional.
def start_run(plan_dir: Path, artifacts: Path, settings: RunSettings, *,  # noqa: PLR0913
              run_id: str | None = None, redactor: Redactor | None = None,
              hooks: Hooks | None = None, verified: bool = False) -> RunResult:
    """Run a plan directory.

    ``verified``: the caller has just written or verified it (``runtime run TOPOLOGY``);
    each attempt still checks its prompt's digest.
    """
    problems = [] if verified else verify_plan_dir(plan_dir)
    if problems:
        raise PlanIntegrityError(plan_dir, problems)
    manifest, raw = read_manifest(plan_dir)
    check_settings(manifest, settings)
    run_id = check_run_id(run_id) if run_id else default_run_id(manifest.topology.name)
    layout = RunLayout(artifacts / "runs" / run_id)
    hooks = hooks or Hooks()
    with hold(layout.root, f"run {run_id}"):
        if layout.root.exists():
            raise UsageError(f"run {run_id} already exists at {layout.root}; continue it with "
                             f"`runtime resume {layout.root}` or choose another --run-id")
        head = RunStarted(run_id=run_id, plan_digest=blake3_hex(raw),
                          topology=manifest.topology.name,
                          settings=settings.model_dump(mode="json"), seq=1, ts=hooks.clock())
        _lay_out(layout, plan_dir, manifest, raw, head, settings.operator_prompt)
        ledger = Ledger(layout.ledger, after_append=hooks.after_append, clock=hooks.clock)
        if hooks.after_append is not None:  # run.started was written by _lay_out
            hooks.after_append(ledger.events[0])
        return _drive(layout, manifest, settings, ledger, redactor, hooks)


# PLR0913: Private step of start_run: the parts it has already read and checked.
def _lay_out(layout: RunLayout, plan_dir: Path, manifest: Manifest, raw: bytes,  # noqa: PLR0913
            head: RunStarted, operator_prompt: str | None) -> None:
    """Stage the run directory with ``run.started`` recorded, then rename it into place.

    A crash at any point leaves either a whole run that ``resume`` continues or no run at
    all (a stale staging directory is removed by the next start).
    """
    tmp = layout.root.with_name(f".{layout.root.name}.tmp")
    if tmp.exists():  # a start that crashed; we hold the run's lock, so it is dead
        remove_tree(tmp)
    tmp.mkdir(parents=True)
    staged = RunLayout(tmp)
    write_read_only(staged.plan_json, raw)
    (tmp / "nodes").mkdir()
    prompts: dict[str, bytes] = {}
    for nid, node in manifest.nodes.items():
        # Explicit mkdirs, no parents=True probing: metadata operations are the cost.
        staged.node_dir(nid).mkdir()
        staged.workspace(nid).mkdir()
        (staged.node_dir(nid) / "attempts").mkdir()
        if node.prompt_digest not in prompts:  # identical prompts share one plan file
            prompts[node.prompt_digest] = (
                plan_dir / PROMPTS_DIR / f"{node.prompt_digest}.md").read_bytes()
        # Created read-only in one call: a copy and a chmod cost two metadata updates.
        write_read_only(staged.prompt_rendered(nid), prompts[node.prompt_digest])
    if operator_prompt is not None:
        write_read_only(staged.operator_prompt, operator_prompt.encode())
    fd = os.open(staged.ledger, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, head.model_dump_json().encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(tmp)
    os.rename(tmp, layout.root)  # the run appears whole or not at all
    fsync_dir(layout.root.parent)


def resume_run(run_dir: Path, *, redactor: Redactor | None = None,
               hooks: Hooks | None = None, deadline_at: float | None = None) -> RunResult:
    """Continue an interrupted run from its ledger.

    ``deadline_at`` replaces the run's deadline from here on (the new value is recorded in
    the resumed ``run.started``).
    """
    with hold(run_dir, f"run {run_dir.name}"):
        return _continue(run_dir, redactor, hooks, deadline_at, None)


@dataclass(frozen=True)
class RetryRequest:
    """``runtime retry``: what changes for the new try; unset keeps the run's choice."""

    agent: str | None = None
    no_fallback: bool = False
    sets: tuple[str, ...] = ()


def retry_run(run_dir: Path, request: RetryRequest, *, redactor: Redactor | None = None,
              hooks: Hooks | None = None, deadline_at: float | None = None) -> RunResult:
    """Re-run the failed and skipped nodes of a run in place.

    Cancelled nodes are pending and run anyway. Succeeded nodes and their artifacts are
    untouched; attempt numbers continue; each retried node gets a fresh ``max_attempts`` and
    the run a fresh budget. The retried nodes and the new settings are recorded in the
    ledger's ``run.started``.
    """
    with hold(run_dir, f"run {run_dir.name}"):
        return _continue(run_dir, redactor, hooks, deadline_at, request)


def _continue(run_dir: Path, redactor: Redactor | None, hooks: Hooks | None,
              deadline_at: float | None, retry: RetryRequest | None) -> RunResult:
    manifest, state = load_run(run_dir)
    layout = RunLayout(run_dir)
    # A crashed runtime's agents may still be running (unsandboxed ones survive it):
    # nothing may write the workspaces once the next attempts start.
    kill_leftovers([layout.leaders, *(layout.attempt_dir(nid, a.attempt) / AGENT_RECORD
                                      for nid, ns in state.nodes.items()
                                      for a in ns.attempts)], run_key(run_dir))
    retried = [nid for nid, ns in state.nodes.items()
               if ns.status in (NodeStatus.FAILED, NodeStatus.SKIPPED)] if retry else []
    finished = state.status in (RunStatus.SUCCEEDED, RunStatus.FAILED)
    if finished and not retried:
        # A kill after run.finished but before the snapshot left state.json stale.
        write_final_state(layout.state, state)
        return RunResult(state.run_id, run_dir, state.status, state, resumed=False)
    settings = _with_operator_prompt(layout, RunSettings.model_validate(state.settings))
    if retry is not None:
        settings = _retry_settings(manifest, settings, retry)
    check_settings(manifest, settings)
    if deadline_at is not None or retry is not None:  # a retry starts without the old one
        settings = settings.model_copy(update={"deadline_at": deadline_at})
    hooks = hooks or Hooks()
    ledger = Ledger(layout.ledger, after_append=hooks.after_append, clock=hooks.clock)
    ledger.append(RunStarted(run_id=state.run_id, plan_digest=state.plan_digest,
                             topology=state.topology, resumed=True, retried=retried,
                             settings=settings.model_dump(mode="json")))
    for nid, node_state in state.nodes.items():
        for rec in node_state.unfinished():
            ledger.append(AttemptFinished(node=nid, attempt=rec.attempt,
                                          outcome=Outcome.LOST, error=LOST_ERROR))
    return _drive(layout, manifest, settings, ledger, redactor, hooks)


def _retry_settings(manifest: Manifest, settings: RunSettings, retry: RetryRequest,
                    ) -> RunSettings:
    from runtime.run.overrides import parse_sets

    overrides = dict(settings.overrides)
    for nid, new in parse_sets(list(retry.sets), manifest).items():
        old = overrides.get(nid)
        merged = old.model_dump() if old is not None else {}
        overrides[nid] = type(new).model_validate({**merged, **new.model_dump()})
    return settings.model_copy(update={
        "agent": retry.agent or settings.agent,
        "no_fallback": settings.no_fallback or retry.no_fallback,
        "overrides": overrides, "skip_profiles": {}})


def _with_operator_prompt(layout: RunLayout, settings: RunSettings) -> RunSettings:
    """Restore the operator prompt into the recorded settings, checked against its digest.

    The recorded settings with the operator prompt read back from the run directory, checked
    against the digest run.started recorded.
    """
    digest = settings.operator_prompt_digest
    if digest is None:
        return settings
    try:
        text = read_capped(layout.operator_prompt, OPERATOR_PROMPT_MAX).decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanIntegrityError(layout.root, [f"{layout.operator_prompt}: cannot be read "
                                               f"({exc}); the run needs its operator prompt"]
                                 ) from None
    if blake3_hex(text.encode()) != digest:
        raise PlanIntegrityError(layout.root, [f"{layout.operator_prompt} hashes to "
                                               f"{blake3_hex(text.encode())}, the run "
                                               f"started with {digest}"])
    return settings.model_copy(update={"operator_prompt": text})


# PLR0913: Private step shared by start, resume and retry: the run's opened parts.
def _drive(layout: RunLayout, manifest: Manifest, settings: RunSettings, ledger: Ledger,  # noqa: PLR0913
           redactor: Redactor | None, hooks: Hooks) -> RunResult:
    state = fold(ledger.events, manifest.nodes)
    limit = settings.max_total_attempts
    ctx = RunContext(
        run_id=state.run_id, layout=layout, manifest=manifest, settings=settings,
        ledger=ledger, budget=AttemptBudget(limit, used=state.attempts_used),
        redactor=redactor or Redactor.from_environment(os.environ),
        cancel=hooks.cancel or threading.Event(), clock=hooks.clock,
        engine=hooks.engine or LocalEngine())
    scheduler = Scheduler(ctx, state)
    try:
        status = scheduler.run()
    finally:
        ledger.close()
    return RunResult(state.run_id, layout.root, status, scheduler.snapshot())
