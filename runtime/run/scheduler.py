"""The DAG: readiness, bounded concurrency, skip propagation, cancellation.

Ready nodes (every upstream succeeded) go to up to ``jobs`` worker threads, in a
deterministic order. A failed node's descendants are skipped at once, naming the failed
ancestor; independent branches keep running. Ctrl-C (or SIGTERM, via the cancel event)
stops launching, terminates running agents, records their attempts ``cancelled`` and
leaves the run resumable.
"""

from __future__ import annotations

import bisect
import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import networkx as nx

from runtime.errors import FatalRunError
from runtime.failures import FailureClass, NodeStatus, RunStatus
from runtime.run.context import NodeOutcome, RunContext
from runtime.run.events import NodeFailed, NodeSkipped, NodeSucceeded, RunFinished
from runtime.run.node import NodeExecutor
from runtime.run.state import Folder, RunState
from runtime.run.state import write_state as _write_state

log = logging.getLogger(__name__)

STATE_INTERVAL_S = 1.0  # state.json is a derived view, refreshed incrementally


class Scheduler:
    """Runs a DAG's nodes as their needs succeed, up to ``jobs`` at a time.

    Args:
        ctx: what every attempt of the run shares.
        state: the run's state so far (a resume starts from it).
    """
    def __init__(self, ctx: RunContext, state: RunState) -> None:
        self.ctx = ctx
        self.graph = ctx.manifest.dag()
        self.order = list(nx.lexicographical_topological_sort(self.graph))
        self.status = {n: s.status for n, s in state.nodes.items()}
        self.history = dict(state.nodes)
        self._state_written = 0.0
        self._folder, self._folded = Folder(self.order), 0
        rank = {n: i for i, n in enumerate(self.order)}
        # Readiness by counting unfinished upstreams: O(edges) over the run, not O(n) a tick.
        self.waiting_on = {n: sum(1 for u in self.graph.pred[n]
                                  if self.status[u] is not NodeStatus.SUCCEEDED)
                           for n in self.order}
        self.ready = sorted((n for n in self.order if self.waiting_on[n] == 0
                             and self.status[n] is NodeStatus.PENDING), key=rank.__getitem__)
        self._rank = rank
        ctx.accepted.update({n: s.artifacts for n, s in state.nodes.items()
                             if s.status is NodeStatus.SUCCEEDED})
        self._fatal: FatalRunError | None = None

    def _ready(self) -> list[str]:
        return [n for n in self.ready if self.status[n] is NodeStatus.PENDING]

    def _release(self, done: str) -> None:
        for child in self.graph.succ[done]:
            self.waiting_on[child] -= 1
            if self.waiting_on[child] == 0 and self.status[child] is NodeStatus.PENDING:
                bisect.insort(self.ready, child, key=self._rank.__getitem__)

    def _skip_descendants(self, failed: str, reason: str = "") -> None:
        below = nx.descendants(self.graph, failed)
        for nid in self.order:
            if nid in below and not self.status[nid].is_terminal():
                self.status[nid] = NodeStatus.SKIPPED
                self.ctx.ledger.append(NodeSkipped(node=nid, failed_ancestor=failed,
                                                   reason=reason))

    def _skip_blocked_at_start(self) -> None:
        """On resume, pending nodes below an already failed or skipped node are skipped."""
        for nid in self.order:
            if self.status[nid] in (NodeStatus.FAILED, NodeStatus.SKIPPED):
                self._skip_descendants(nid)

    def run(self) -> RunStatus:
        """Run every node that can run, skip those that cannot, and return the run's status."""
        self._skip_blocked_at_start()
        running: dict[Future[NodeOutcome], str] = {}
        with ThreadPoolExecutor(max_workers=self.ctx.settings.jobs,
                                thread_name_prefix="node") as pool:
            while True:
                self._launch(pool, running)
                if not running:
                    break
                try:
                    done, _ = wait(running, timeout=0.5, return_when=FIRST_COMPLETED)
                except KeyboardInterrupt:
                    log.warning("interrupted: stopping agents; the run stays resumable")
                    self.ctx.cancel.set()
                    continue
                finished = [(running.pop(fut), self._result(fut)) for fut in done]
                # Free workers take nodes that were already ready before the finished ones
                # are settled: node.succeeded must be durable before a *dependent* starts,
                # not before unrelated work does, and its fsync need not idle a worker.
                self._launch(pool, running)
                for nid, outcome in finished:
                    if outcome is not None:
                        self._settle(nid, outcome)
                self._maybe_write_state()
        if self._fatal is not None:
            self._finish_after_fatal()
            raise self._fatal
        return self._finish()

    def _result(self, fut: Future[NodeOutcome]) -> NodeOutcome | None:
        """A node's outcome, or None after a fatal error stopped the run.

        A fatal error (the run cannot record anything) stops the run: every agent is
        cancelled, and the node stays resumable. Any other exception is a bug that stays at
        its node: recorded as a launch_error, the rest goes on.
        """
        try:
            return fut.result()
        except FatalRunError as exc:
            log.error("%s", exc)
            self._fatal = self._fatal or exc
            self.ctx.cancel.set()
            return None
        except Exception as exc:
            log.exception("node executor failed")
            return NodeOutcome(NodeStatus.FAILED, FailureClass.LAUNCH_ERROR,
                               f"runtime error: {type(exc).__name__}: {exc}")

    def _finish_after_fatal(self) -> None:
        """Best effort: the ledger may not accept writes any more; it stays resumable."""
        try:
            self.ctx.ledger.append(RunFinished(status=RunStatus.CANCELLED, counts={}))
            self.write_state()
        except Exception:  # noqa: BLE001 - already failing for a reason the user sees
            log.warning("could not record run.finished after the fatal error")

    def _launch(self, pool: ThreadPoolExecutor, running: dict[Future[NodeOutcome], str],
                ) -> None:
        if self.ctx.cancel.is_set():
            return
        for nid in self._ready():
            if len(running) >= self.ctx.settings.jobs:
                break
            self.ready.remove(nid)
            self.status[nid] = NodeStatus.RUNNING
            executor = NodeExecutor(self.ctx, nid, self.history[nid])
            running[pool.submit(executor.run)] = nid

    def _settle(self, nid: str, outcome: NodeOutcome) -> None:
        self.status[nid] = outcome.status
        if outcome.status is NodeStatus.SUCCEEDED:
            self.ctx.ledger.append(NodeSucceeded(node=nid, attempts=outcome.attempts,
                                                 artifacts=outcome.artifacts))
            self.ctx.accepted[nid] = outcome.artifacts
            self._release(nid)
        elif outcome.status is NodeStatus.SKIPPED:  # never started: the deadline passed
            self.ctx.ledger.append(NodeSkipped(node=nid, reason=outcome.reason))
            self._skip_descendants(nid, outcome.reason)
        elif outcome.status is NodeStatus.FAILED:
            self.ctx.ledger.append(NodeFailed(node=nid, failure=outcome.failure,
                                              reason=outcome.reason))
            self._skip_descendants(nid)
        else:  # cancelled: back to pending, resumable
            bisect.insort(self.ready, nid, key=self._rank.__getitem__)

    def _finish(self) -> RunStatus:
        if self.ctx.cancel.is_set() and any(not s.is_terminal() for s in self.status.values()):
            status = RunStatus.CANCELLED
        elif all(s is NodeStatus.SUCCEEDED for s in self.status.values()):
            status = RunStatus.SUCCEEDED
        else:
            status = RunStatus.FAILED
        counts: dict[str, int] = {}
        for s in self.status.values():
            counts[s.value] = counts.get(s.value, 0) + 1
        self.ctx.ledger.append(RunFinished(status=status, counts=dict(sorted(counts.items()))))
        self.write_state()
        return status

    def _maybe_write_state(self) -> None:
        if time.monotonic() - self._state_written >= STATE_INTERVAL_S:
            self.write_state()

    def write_state(self) -> None:
        """Fold the events appended since the last write and rewrite ``state.json``."""
        events = self.ctx.ledger.events  # appended to by workers; read up to a fixed length
        upto = len(events)
        for ev in events[self._folded:upto]:
            self._folder.apply(ev)
        self._folded = upto
        _write_state(self.ctx.layout.state, self._folder.state())
        self._state_written = time.monotonic()
