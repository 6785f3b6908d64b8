"""The read side of a run directory: find it, load its plan and fold its ledger.

Reports and ``findings`` import only this (and the records it returns), never the
executor.
"""

from __future__ import annotations

from pathlib import Path

from runtime.digest import blake3_hex
from runtime.errors import LedgerError, PlanIntegrityError, UsageError
from runtime.plan.manifest import MANIFEST_NAME, Manifest, read_manifest
from runtime.run.events import Event, RunStarted, read_events
from runtime.run.state import RunState, fold


def resolve_run_dir(run: str, artifacts: Path) -> Path:
    """A run directory, or a run id under ``artifacts/runs``."""
    candidate = Path(run)
    if (candidate / "ledger.jsonl").is_file():
        return candidate
    by_id = artifacts / "runs" / run
    if (by_id / "ledger.jsonl").is_file():
        return by_id
    if (artifacts / "batches" / run / "summary.json").is_file() or (
            candidate / "summary.json").is_file():
        raise UsageError(f"{run} is a batch, not a run: `runtime batch PATH... --batch-id "
                         f"{candidate.name}` resumes its unfinished runs")
    raise UsageError(f"{run}: not a run directory (no ledger.jsonl) and no run with that id "
                     f"under {artifacts / 'runs'}")


def load_run(run_dir: Path, *, events: list[Event] | None = None,
             ) -> tuple[Manifest, RunState]:
    """Load a run's manifest and its state folded from the ledger (the read side of a run).

    ``events``: the ledger as the caller already read it (``read_events``), so a reader
    that also needs the events themselves reads the ledger once.
    """
    if events is None:
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
