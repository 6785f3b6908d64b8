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
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .agents.procs import kill_leftovers
from .agents.sandbox import require_bubblewrap, sandboxed_profiles
from .context import AttemptBudget, RunContext
from .digest import blake3_hex
from .engine import Engine, LocalEngine
from .errors import LedgerError, PlanIntegrityError, UsageError
from .failures import FailureClass, RunStatus
from .files import READ_ONLY, write_read_only
from .ledger import AttemptFinished, Event, Ledger, RunStarted, RunState, fold, read_events
from .plan import MANIFEST_NAME, PROMPTS_DIR, Manifest, read_manifest
from .records import RunSettings
from .redact import Redactor
from .rundir import RunLayout, check_run_id
from .scheduler import Scheduler
from .verify import verify_plan_dir

LOST_ERROR = "the runtime stopped before this attempt finished (crash, kill or power loss)"


@dataclass(frozen=True)
class RunResult:
    run_id: str
    run_dir: Path
    status: RunStatus
    state: RunState


@dataclass(frozen=True)
class Hooks:
    """Test and CLI seams: a cancel event, a clock, and a callback after each append."""

    cancel: threading.Event | None = None
    after_append: Callable[[Event], None] | None = None
    clock: Callable[[], float] = time.time
    engine: Engine | None = None  # --engine; None: the local engine


def default_run_id(topology: str) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return f"{topology}-{stamp}-{secrets.token_hex(3)}"


def check_settings(manifest: Manifest, settings: RunSettings) -> None:
    """Refuse settings that name a profile, node or field the plan does not have."""
    known = ", ".join(sorted(manifest.agents))
    if settings.agent is not None and settings.agent not in manifest.agents:
        raise UsageError(f"--agent {settings.agent}: no such profile in the plan; known: "
                         f"{known}")
    for node in settings.overrides:
        if node not in manifest.nodes:
            raise UsageError(f"--set {node}.*: no node {node!r} in the plan; nodes: "
                             f"{', '.join(sorted(manifest.nodes))}")
    _require_sandbox(manifest, settings)


def _require_sandbox(manifest: Manifest, settings: RunSettings) -> None:
    """Issue 8: with bubblewrap missing, a profile that did not opt out of the sandbox
    refuses to start (exit 2) before any node runs, rather than failing every attempt."""
    used = {settings.agent} if settings.agent else {
        name for node in manifest.nodes.values()
        for name in [node.agent, *([] if settings.no_fallback else node.fallback)]}
    require_bubblewrap(sandboxed_profiles(manifest.agents, used))


def start_run(plan_dir: Path, artifacts: Path, settings: RunSettings, *,
              run_id: str | None = None, redactor: Redactor | None = None,
              hooks: Hooks | None = None, verified: bool = False) -> RunResult:
    """Run a plan directory. ``verified``: the caller has just written or verified it
    (``runtime run TOPOLOGY``); each attempt still checks its prompt's digest."""
    problems = [] if verified else verify_plan_dir(plan_dir)
    if problems:
        raise PlanIntegrityError(plan_dir, problems)
    manifest, raw = read_manifest(plan_dir)
    check_settings(manifest, settings)
    run_id = check_run_id(run_id) if run_id else default_run_id(manifest.topology.name)
    layout = RunLayout(artifacts / "runs" / run_id)
    if layout.root.exists():
        raise UsageError(f"run {run_id} already exists at {layout.root}; continue it with "
                         f"`runtime resume {layout.root}` or choose another --run-id")
    _lay_out(layout, plan_dir, manifest, raw)
    hooks = hooks or Hooks()
    ledger = Ledger(layout.ledger, after_append=hooks.after_append, clock=hooks.clock)
    ledger.append(RunStarted(run_id=run_id, plan_digest=blake3_hex(raw),
                             topology=manifest.topology.name,
                             settings=settings.model_dump(mode="json")))
    return _drive(layout, manifest, settings, ledger, redactor, hooks)


def _lay_out(layout: RunLayout, plan_dir: Path, manifest: Manifest, raw: bytes) -> None:
    tmp = layout.root.with_name(f".{layout.root.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    staged = RunLayout(tmp)
    write_read_only(staged.plan_json, raw)
    (tmp / "nodes").mkdir()
    for nid, node in manifest.nodes.items():
        # Explicit mkdirs, no parents=True probing: metadata operations are the cost.
        staged.node_dir(nid).mkdir()
        staged.workspace(nid).mkdir()
        (staged.node_dir(nid) / "attempts").mkdir()
        dst = staged.prompt_rendered(nid)
        shutil.copyfile(plan_dir / PROMPTS_DIR / f"{node.prompt_digest}.md", dst)
        os.chmod(dst, READ_ONLY)
    os.rename(tmp, layout.root)  # the run appears whole or not at all


def resolve_run_dir(run: str, artifacts: Path) -> Path:
    """A run directory, or a run id under ``artifacts/runs``."""
    candidate = Path(run)
    if (candidate / "ledger.jsonl").is_file():
        return candidate
    by_id = artifacts / "runs" / run
    if (by_id / "ledger.jsonl").is_file():
        return by_id
    raise UsageError(f"{run}: not a run directory (no ledger.jsonl) and no run with that id "
                     f"under {artifacts / 'runs'}")


def load_run(run_dir: Path) -> tuple[Manifest, RunState]:
    events = read_events(run_dir / "ledger.jsonl")
    manifest, raw = read_manifest(run_dir)
    starts = [e for e in events if isinstance(e, RunStarted)]
    if not starts:
        raise LedgerError(run_dir / "ledger.jsonl", "no run.started event; not a run ledger")
    if blake3_hex(raw) != starts[0].plan_digest:
        raise PlanIntegrityError(run_dir, [f"{run_dir / MANIFEST_NAME} hashes to "
                                           f"{blake3_hex(raw)}, the run started with "
                                           f"{starts[0].plan_digest}"])
    return manifest, fold(events, manifest.nodes)


def resume_run(run_dir: Path, *, redactor: Redactor | None = None,
               hooks: Hooks | None = None, deadline_at: float | None = None) -> RunResult:
    """Continue a run. ``deadline_at`` replaces the run's deadline from here on (the new
    value is recorded in the resumed ``run.started``)."""
    manifest, state = load_run(run_dir)
    layout = RunLayout(run_dir)
    # A crashed runtime's agents may still be running (unsandboxed ones survive it):
    # nothing may write the workspaces once the next attempts start.
    kill_leftovers([layout.attempt_dir(nid, a.attempt) for nid, ns in state.nodes.items()
                    for a in ns.attempts], state.run_id)
    if state.status in (RunStatus.SUCCEEDED, RunStatus.FAILED):
        return RunResult(state.run_id, run_dir, state.status, state)
    settings = RunSettings.model_validate(state.settings)
    _require_sandbox(manifest, settings)
    if deadline_at is not None:
        settings = settings.model_copy(update={"deadline_at": deadline_at})
    hooks = hooks or Hooks()
    ledger = Ledger(layout.ledger, after_append=hooks.after_append, clock=hooks.clock)
    ledger.append(RunStarted(run_id=state.run_id, plan_digest=state.plan_digest,
                             topology=state.topology, resumed=True,
                             settings=settings.model_dump(mode="json")))
    for nid, node_state in state.nodes.items():
        for rec in node_state.unfinished():
            ledger.append(AttemptFinished(node=nid, attempt=rec.attempt,
                                          outcome=FailureClass.LOST, error=LOST_ERROR))
    return _drive(layout, manifest, settings, ledger, redactor, hooks)


def _drive(layout: RunLayout, manifest: Manifest, settings: RunSettings, ledger: Ledger,
           redactor: Redactor | None, hooks: Hooks) -> RunResult:
    state = fold(ledger.events, manifest.nodes)
    limit = settings.max_total_attempts
    ctx = RunContext(
        run_id=state.run_id, layout=layout, manifest=manifest, settings=settings,
        ledger=ledger, budget=AttemptBudget(limit, used=state.attempts_used),
        redactor=redactor or Redactor.from_environment(os.environ),
        cancel=hooks.cancel or threading.Event(), clock=hooks.clock,
        engine=hooks.engine or LocalEngine())
    try:
        status = Scheduler(ctx, state).run()
    finally:
        ledger.close()
    final = fold(ledger.events, manifest.nodes)
    return RunResult(state.run_id, layout.root, status, final)
