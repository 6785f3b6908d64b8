"""Live batch progress on the terminal (rich).

Overall and per topology, with attempts and retries visible. Only the CLI uses it; the batch
itself reports through ``batch.Progress``.
"""

from __future__ import annotations

import threading
from typing import TextIO

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.progress import Progress as RichBar
from rich.table import Table

from runtime.batch import Progress
from runtime.eventlines import event_line
from runtime.run.events import AttemptStarted, Event, NodeFailed, NodeSkipped, NodeSucceeded
from runtime.run.summary import BatchEntry, BatchSummary


class LiveProgress(Progress):
    """Live rich progress bars: one for the whole batch, one per running topology.

    Args:
        console: the rich console drawn on (stderr).
        total: how many topologies the batch holds.
    """
    def __init__(self, console: Console, total: int) -> None:
        self.bar = RichBar(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                           MofNCompleteColumn(), TimeElapsedColumn(), console=console)
        self.overall = self.bar.add_task("[bold]batch", total=total)
        self.tasks: dict[str, TaskID] = {}
        self.names: dict[str, str] = {}
        self.counts: dict[str, list[int]] = {}  # attempts, retries
        self.lock = threading.Lock()

    def __enter__(self) -> LiveProgress:
        """Start drawing the bars."""
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop drawing and leave the final bars on the terminal."""
        self.bar.__exit__(None, None, None)

    def _label(self, source: str, suffix: str = "") -> str:
        attempts, retries = self.counts[source]
        return (f"{self.names[source]:<22} attempts {attempts:>3}  retries {retries:>2}"
                f"{suffix}")

    def started(self, source: str, name: str, nodes: int) -> None:
        """Add a bar for the topology's run, one step per node."""
        with self.lock:
            self.names[source], self.counts[source] = name, [0, 0]
            self.tasks[source] = self.bar.add_task(self._label(source), total=nodes)

    def event(self, source: str, event: Event) -> None:
        """Advance the topology's bar on a terminal node event; count attempts and retries."""
        with self.lock:
            if source not in self.tasks:
                return
            if isinstance(event, AttemptStarted):
                self.counts[source][0] += 1
                self.counts[source][1] += event.trigger == "retry"
                self.bar.update(self.tasks[source], description=self._label(source))
            elif isinstance(event, NodeSucceeded | NodeFailed | NodeSkipped):
                self.bar.advance(self.tasks[source])

    def finished(self, entry: BatchEntry) -> None:
        """Close the topology's bar with its status and advance the batch's."""
        with self.lock:
            task = self.tasks.get(entry.source)
            if task is not None:
                done = sum(1 for n in entry.nodes.values() if n.status.is_terminal())
                self.bar.update(task, completed=done,
                                description=self._label(entry.source, f"  {entry.status}"))
            self.bar.advance(self.overall)


def summary_table(summary: BatchSummary) -> Table:
    """The end-of-batch table: one row per topology, with node counts and attempts.

    Seven columns fit an 80-column terminal: the topology and its status never shrink
    to an ellipsis, the node counts share one column, and the prose columns wrap (a node
    id folds rather than losing its end).
    """
    table = Table(title=f"batch {summary.batch_id}: {summary.status}", box=box.SIMPLE_HEAD,
                  pad_edge=False, collapse_padding=True)
    longest = max((len(e.topology or e.source) for e in summary.entries), default=8)
    # A long name (an invalid entry shows its source path) folds instead of squeezing
    # every other column away.
    table.add_column("topology", overflow="fold", min_width=min(longest, 16))
    table.add_column("status", no_wrap=True, min_width=len("cancelled"))
    table.add_column("nodes", overflow="fold")
    table.add_column("attempts", justify="right", overflow="fold")
    for col in ("succeeded after feedback", "findings", "first failure"):
        table.add_column(col, overflow="fold")
    style = {"succeeded": "green", "failed": "red", "invalid": "red", "cancelled": "yellow"}
    for e in summary.entries:
        counts = {s: sum(1 for n in e.nodes.values() if n.status.value == s)
                  for s in ("succeeded", "failed", "skipped")}
        nodes = " ".join(f"{n} {'ok' if s == 'succeeded' else s}" for s, n in counts.items()
                         if n) or "-"
        table.add_row(e.topology or e.source, f"[{style[e.status]}]{e.status}", nodes,
                      str(sum(n.attempts for n in e.nodes.values())),
                      ", ".join(e.retries_after_feedback) or "-",
                      ", ".join(f"{n} {lv}" for lv, n in e.findings.items() if n) or "-",
                      _first_failure(e))
    return table


def _first_failure(entry: BatchEntry) -> str:
    """The first failed node, its class and the agent's own reason: what to fix first."""
    for nid, n in entry.nodes.items():
        if n.status.value == "failed":
            return escape(f"{nid}: {n.failure}" + (f": {n.summary}" if n.summary else ""))
    return "-"


class LineProgress(Progress):
    """One line per node event, for logs (CI) where a live display cannot work."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.names: dict[str, str] = {}
        self.lock = threading.Lock()

    def started(self, source: str, name: str, nodes: int) -> None:
        """Remember the topology's name for the lines that follow."""
        self.names[source] = name

    def event(self, source: str, event: Event) -> None:
        """Write one line for a node event worth a line."""
        line = event_line(event)
        if line:
            with self.lock:
                self.out.write(f"{self.names.get(source, source)}: {line}\n")
                self.out.flush()

    def finished(self, entry: BatchEntry) -> None:
        """Write the topology's final status."""
        with self.lock:
            self.out.write(f"{entry.topology or entry.source}: {entry.status}\n")
            self.out.flush()
