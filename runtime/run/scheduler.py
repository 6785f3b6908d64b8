"""The DAG: readiness, bounded concurrency, skip propagation, cancellation.

One loop runs the run: ready nodes (every upstream succeeded) become active, up to
``jobs`` at a time, in a deterministic order; each active node is a ``NodeExecutor`` asked
for its next action (an attempt, a wait, its outcome). That step (reading and recording
the finished attempt, preparing the next, making the ledger durable and starting a local
agent's process) runs on a step thread, one at a time per node, so neither a slow record
(a large SARIF artifact to validate) nor a slow start holds up another agent's timeout. The
agents' processes are supervised by one ``Supervisor`` selector loop (pidfds and pipes)
on the loop's thread, not by a thread each. Agents that only run blocking (http, python,
simulated) or on a remote engine (Ray) run on a pool of ``jobs`` threads. Steps that
start agents together share one ledger sync (group commit): every event appended before
a step, its attempt.started and the node.succeeded of each need included, is durable
before its agent starts.

A failed node's descendants are skipped at once, naming the failed ancestor; independent
branches keep running. Ctrl-C (or SIGTERM, via the cancel event) stops launching,
terminates running agents, records their attempts ``cancelled`` and leaves the run
resumable.
"""

from __future__ import annotations

import bisect
import functools
import logging
import queue
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from runtime.agents.command import Started
from runtime.agents.supervise import POLL_S, Running, Supervisor
from runtime.errors import FatalRunError
from runtime.failures import FailureClass, NodeStatus, RunStatus
from runtime.run.attempt import Attempt, Launch
from runtime.run.context import AttemptSpec, NodeOutcome, RunContext
from runtime.run.engine import AgentOutcome, LocalEngine
from runtime.run.events import NodeFailed, NodeSkipped, NodeSucceeded, RunFinished
from runtime.run.node import NodeExecutor, Wait
from runtime.run.state import AttemptRecord, Folder, RunState, write_final_state
from runtime.run.state import write_state as _write_state

log = logging.getLogger(__name__)

STATE_INTERVAL_S = 1.0  # state.json is a derived view, refreshed incrementally


@dataclass
class _Active:
    """A node between its start and its outcome: waiting, or with an attempt in flight."""

    executor: NodeExecutor
    flight: _Flight | None = None  # the attempt whose agent is running
    wake_at: float | None = None  # time.monotonic() at which its wait ends


# What an engine observed of an attempt, or the exception it raised; for a supervised
# process, how to read it (on the step's thread: parsing a large JSON result or stderr
# must not hold up the loop).
_Observed = AgentOutcome | Exception | Callable[[], AgentOutcome | Exception]
# A finished attempt to record: the attempt, its launch, what its engine observed.
_Finished = tuple[Attempt, Launch, _Observed]


@dataclass(frozen=True)
class _Flight:
    """An attempt whose agent is out: a started local process, or one for the thread pool."""

    attempt: Attempt
    launch: Launch
    # None: run it blocking on the thread pool (an http, python or simulated agent, or a
    # remote engine).
    started: Started | None = None


# What a node's step comes to: its outcome, a wait, an agent in flight, or a fatal error.
_Step = NodeOutcome | Wait | _Flight | FatalRunError


def _local_outcome(started: Started, launch: Launch) -> AgentOutcome | Exception:
    """A supervised agent's outcome, or the exception reading it raised (its launch_error)."""
    try:
        return LocalEngine.outcome(started, launch.site)
    except Exception as exc:  # noqa: BLE001 - recorded as the attempt's launch_error
        return exc


def _thread_result(fut: Future[AgentOutcome]) -> AgentOutcome | Exception:
    """An engine thread's outcome, or the exception it raised (the attempt's launch_error).

    A ``FatalRunError`` is raised: the run cannot go on.
    """
    exc = fut.exception()
    if exc is None:
        return fut.result()
    if isinstance(exc, FatalRunError) or not isinstance(exc, Exception):
        raise exc
    return exc


class Scheduler:
    """Runs a DAG's nodes as their needs succeed, up to ``jobs`` at a time.

    Args:
        ctx: what every attempt of the run shares.
        state: the run's state so far (a resume starts from it).
    """
    def __init__(self, ctx: RunContext, state: RunState) -> None:
        self.ctx = ctx
        self.graph = ctx.manifest.dag()
        self.order = self.graph.order()
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
        self._active: dict[str, _Active] = {}
        # The run's engine when it starts local processes (None: a remote engine).
        self._local = ctx.engine if isinstance(ctx.engine, LocalEngine) else None
        self._processes: dict[Running, tuple[str, Started, Launch]] = {}
        self._threads_done: queue.SimpleQueue[tuple[str, Future[AgentOutcome]]] = \
            queue.SimpleQueue()
        self._steps_done: queue.SimpleQueue[tuple[str, Future[_Step]]] = queue.SimpleQueue()

    def _ready(self) -> list[str]:
        return [n for n in self.ready if self.status[n] is NodeStatus.PENDING]

    def _release(self, done: str) -> None:
        for child in self.graph.succ[done]:
            self.waiting_on[child] -= 1
            if self.waiting_on[child] == 0 and self.status[child] is NodeStatus.PENDING:
                bisect.insort(self.ready, child, key=self._rank.__getitem__)

    def _skip_descendants(self, failed: str, reason: str = "") -> None:
        below = self.graph.descendants(failed)
        for nid in self.order:
            if nid in below and not self.status[nid].is_terminal():
                self.status[nid] = NodeStatus.SKIPPED
                self.ctx.ledger.append(NodeSkipped(node=nid, failed_ancestor=failed,
                                                   reason=reason), sync=False)

    def _skip_blocked_at_start(self) -> None:
        """On resume, pending nodes below an already failed or skipped node are skipped."""
        for nid in self.order:
            if self.status[nid] in (NodeStatus.FAILED, NodeStatus.SKIPPED):
                self._skip_descendants(nid)

    def run(self) -> RunStatus:
        """Run every node that can run, skip those that cannot, and return the run's status."""
        self._skip_blocked_at_start()
        jobs = self.ctx.settings.jobs
        with Supervisor() as self._sup, \
                ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="agent") as self._pool:
            try:
                with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="step") as self._steps:
                    try:
                        self._loop()
                    except BaseException:
                        # Leaving with agents on the pool's threads: cancel them, or the
                        # pool's exit waits for each to time out (an http agent: 1800 s).
                        self.ctx.cancel.set()
                        raise
            finally:
                self._adopt_unapplied()
        if self._fatal is not None:
            self._finish_after_fatal()
            raise self._fatal
        return self._finish()

    def _adopt_unapplied(self) -> None:
        """Hand the supervisor every agent a step started that the loop never took in.

        Only when the loop left early (a second Ctrl-C, a bug): the steps have all ended by
        now, and the supervisor's exit kills what it holds, so no agent runs on unwatched.
        """
        while not self._steps_done.empty():
            _, fut = self._steps_done.get()
            step = fut.result() if fut.exception() is None else None
            if isinstance(step, _Flight) and step.started is not None:
                self._sup.add(step.started.process)

    def _loop(self) -> None:
        """Until no node is active: start ready nodes, start agents, act on what happened."""
        while True:
            self._fill()
            if not self._active:
                if self._ready() and not self.ctx.cancel.is_set():
                    continue  # nodes settled without an agent released others
                break
            try:
                done = self._sup.poll(self._next_wake())
            except KeyboardInterrupt:
                if self.ctx.cancel.is_set():
                    # A second Ctrl-C (the CLI turns the first into the cancel event):
                    # stop now; every agent is killed on the way out, and the unfinished
                    # attempts fold as lost on resume.
                    raise
                log.warning("interrupted: stopping agents; the run stays resumable")
                self.ctx.cancel.set()
                continue
            for process in done:
                nid, started, launch = self._processes.pop(process)
                self._complete(nid, functools.partial(_local_outcome, started, launch))
            while not self._threads_done.empty():
                nid, fut = self._threads_done.get()
                self._complete(nid, _thread_result(fut))
            while not self._steps_done.empty():
                nid, step = self._steps_done.get()
                self._apply_step(nid, step.result())  # re-raises what _step let through
            self._end_waits()
            self._maybe_write_state()

    def _fill(self) -> None:
        """Start ready nodes while fewer than ``jobs`` are active (none after a cancel)."""
        while not self.ctx.cancel.is_set() and len(self._active) < self.ctx.settings.jobs:
            ready = self._ready()
            if not ready:
                return
            nid = ready[0]
            self.ready.remove(nid)
            self.status[nid] = NodeStatus.RUNNING
            self._active[nid] = _Active(NodeExecutor(self.ctx, nid, self.history[nid]))
            self._advance(nid)

    def _advance(self, nid: str, finished: _Finished | None = None) -> None:
        """Move a node on, on a step thread: record its finished attempt, find its next action.

        Recording an attempt can take seconds (validating a large SARIF artifact, emptying
        a workspace of 200,000 files); on the loop's thread it would hold up every other
        agent's timeout and cancellation. One step at a time per node.
        """
        fut = self._steps.submit(self._step, self._active[nid], finished)
        fut.add_done_callback(functools.partial(self._stepped, nid))

    def _stepped(self, nid: str, fut: Future[_Step]) -> None:
        """Called on the step's thread: hand it to the loop and wake it (whatever it raised)."""
        self._steps_done.put((nid, fut))
        self._sup.wake()

    def _step(self, act: _Active, finished: _Finished | None) -> _Step:
        """Record ``finished``, then ask the node until it waits, has an agent to start or ends.

        Touches only the node's executor and attempts (the ledger is thread-safe). A
        ``FatalRunError`` is returned for the loop to stop the run; any other exception is
        the node's bug and fails the node.
        """
        try:
            if finished is not None:
                done, launched, observed = finished
                outcome = observed() if callable(observed) else observed
                act.executor.record(done.complete(launched, outcome))
            while True:
                action = act.executor.next_action()
                if not isinstance(action, AttemptSpec):
                    return action
                attempt = Attempt(self.ctx, action)
                prepared = attempt.prepare(sync=False)  # synced just below, with others
                if isinstance(prepared, AttemptRecord):  # ended before its agent started
                    act.executor.record(prepared)
                    continue
                flight = self._launch(attempt, prepared)
                if isinstance(flight, AttemptRecord):  # its agent could not be started
                    act.executor.record(flight)
                    continue
                return flight
        except FatalRunError as exc:
            return exc
        except Exception as exc:  # a bug (or a record an agent broke) stays at its node
            log.exception("node %s failed in the runtime", act.executor.node_id)
            return NodeOutcome(NodeStatus.FAILED, FailureClass.LAUNCH_ERROR,
                               f"runtime error: {type(exc).__name__}: {exc}")

    def _launch(self, attempt: Attempt, launch: Launch) -> _Flight | AttemptRecord:
        """On the step's thread: make the ledger durable, then start a local agent's process.

        The sync covers this attempt's attempt.started and every node.succeeded the loop
        appended before this step (the needs it relies on); steps syncing together share
        one ``fdatasync``. A process that cannot be started ends the attempt here.

        bubblewrap's ``--die-with-parent`` ties a sandboxed agent to the thread that
        started it: step threads live until the run's agents are all done (a pool's
        workers never retire before its shutdown), so it fires only when the run ends.
        """
        self.ctx.ledger.sync()
        if self._local is None:
            return _Flight(attempt, launch)
        try:
            started = self._local.start(launch.request, launch.site)
        except FatalRunError:
            raise
        except Exception as exc:  # noqa: BLE001 - recorded (a full disk stops the run)
            return attempt.complete(launch, exc)
        if isinstance(started, AgentOutcome):  # it could not be launched
            return attempt.complete(launch, started)
        return _Flight(attempt, launch, started)

    def _apply_step(self, nid: str, step: _Step) -> None:
        """On the loop: act on what a node's step came to."""
        if isinstance(step, FatalRunError):
            self._stop_fatal(nid, step)
        elif isinstance(step, NodeOutcome):
            del self._active[nid]
            self._settle(nid, step)
        elif isinstance(step, Wait):
            self._active[nid].wake_at = time.monotonic() + step.seconds
        else:
            self._active[nid].flight = step
            if step.started is None:  # an agent that blocks, or a remote engine
                fut = self._pool.submit(self.ctx.engine.run, step.launch.request,
                                        step.launch.site)
                fut.add_done_callback(functools.partial(self._thread_done, nid))
            else:
                self._processes[step.started.process] = (nid, step.started, step.launch)
                self._sup.add(step.started.process)

    def _thread_done(self, nid: str, fut: Future[AgentOutcome]) -> None:
        """Called on the engine's thread: hand the outcome to the loop and wake it."""
        self._threads_done.put((nid, fut))
        self._sup.wake()

    def _complete(self, nid: str, outcome: _Observed) -> None:
        """Record a finished agent's attempt and move its node on."""
        act = self._active[nid]
        if act.flight is None:
            return  # not in flight (cannot happen: every outcome belongs to a flight)
        flight, act.flight = act.flight, None
        self._advance(nid, (flight.attempt, flight.launch, outcome))

    def _end_waits(self) -> None:
        now, cancelled = time.monotonic(), self.ctx.cancel.is_set()
        for nid in [n for n, a in self._active.items()
                    if a.wake_at is not None and (cancelled or now >= a.wake_at)]:
            self._active[nid].wake_at = None
            self._advance(nid)

    def _next_wake(self) -> float:
        """How long the loop may sleep: until the first wait ends, at most ``POLL_S``."""
        now = time.monotonic()
        wakes = [a.wake_at - now for a in self._active.values() if a.wake_at is not None]
        return max(0.0, min([POLL_S, *wakes]))

    def _stop_fatal(self, nid: str, exc: FatalRunError) -> None:
        """The run cannot record anything: stop it, cancelling every agent; it stays resumable."""
        log.error("%s", exc)
        self._fatal = self._fatal or exc
        self.ctx.cancel.set()
        self._active.pop(nid, None)

    def _finish_after_fatal(self) -> None:
        """Best effort: the ledger may not accept writes any more; it stays resumable."""
        try:
            self.ctx.ledger.append(RunFinished(status=RunStatus.CANCELLED, counts={}))
            self.write_state()
        except Exception:  # noqa: BLE001 - already failing for a reason the user sees
            log.warning("could not record run.finished after the fatal error")

    def _settle(self, nid: str, outcome: NodeOutcome) -> None:
        self.status[nid] = outcome.status
        if outcome.status is NodeStatus.SUCCEEDED:
            self.ctx.ledger.append(NodeSucceeded(node=nid, attempts=outcome.attempts,
                                                 artifacts=outcome.artifacts), sync=False)
            self.ctx.accepted[nid] = outcome.artifacts
            self._release(nid)
        elif outcome.status is NodeStatus.SKIPPED:  # never started: the deadline passed
            self.ctx.ledger.append(NodeSkipped(node=nid, reason=outcome.reason), sync=False)
            self._skip_descendants(nid, outcome.reason)
        elif outcome.status is NodeStatus.FAILED:
            self.ctx.ledger.append(NodeFailed(node=nid, failure=outcome.failure,
                                              reason=outcome.reason), sync=False)
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
        write_final_state(self.ctx.layout.state, self.snapshot())
        return status

    def _maybe_write_state(self) -> None:
        """Refresh ``state.json`` now and then; a failure waits for the next refresh.

        It is a view derived from the ledger: a full disk or a lack of descriptors must
        not stop the run over it (the final write, after the run, still reports them).
        """
        if time.monotonic() - self._state_written >= STATE_INTERVAL_S:
            try:
                self.write_state()
            except OSError as exc:
                self._state_written = time.monotonic()
                log.warning("state.json not refreshed: %s", exc)

    def snapshot(self) -> RunState:
        """The run's state: the events appended since the last call folded in."""
        events = self.ctx.ledger.events  # appended to by workers; read up to a fixed length
        upto = len(events)
        for ev in events[self._folded:upto]:
            self._folder.apply(ev)
        self._folded = upto
        return self._folder.state()

    def write_state(self) -> None:
        """Rewrite ``state.json`` from a fresh ``snapshot``."""
        _write_state(self.ctx.layout.state, self.snapshot())
        self._state_written = time.monotonic()
