"""One node's attempts under its policy: a plain loop over ``policy.next_step``.

Each turn asks the pure policy what comes next (an attempt on some profile after some
wait, or a stop), checks the run-level ceilings the policy does not own (cancellation,
deadline, the run's attempt budget), hands the attempt a frozen ``AttemptSpec`` and
appends the ``AttemptRecord`` it returns. Ceilings come only from the plan and the run
settings; nothing an agent prints or writes can raise them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from runtime.errors import FatalRunError
from runtime.failures import FailureClass, NodeStatus, Outcome
from runtime.prompt.feedback import PriorFailure
from runtime.run.attempt import FATAL_ERRNOS, Attempt
from runtime.run.context import AttemptSpec, NodeOutcome, RunContext
from runtime.run.policy import NodePolicy, Past, Run, Stop, StopReason, build_policy, next_step
from runtime.run.state import AttemptRecord, NodeState


@dataclass(frozen=True)
class Wait:
    """Wait this long (a backoff, a provider's Retry-After) before asking for the next step."""

    seconds: float


STOP_STATUS = {StopReason.SUCCEEDED: NodeStatus.SUCCEEDED,
               StopReason.CANCELLED: NodeStatus.PENDING}


def policy_for(ctx: RunContext, node_id: str) -> NodePolicy:
    """The node's policy under the run's settings."""
    s = ctx.settings
    return build_policy(ctx.manifest.nodes[node_id], s.overrides.get(node_id), agent=s.agent,
                        no_fallback=s.no_fallback, skip_profiles=s.skip_profiles)


class NodeExecutor:
    """Runs the remaining attempts of one node, continuing from its ledger history."""

    def __init__(self, ctx: RunContext, node_id: str, prior: NodeState) -> None:
        self.ctx = ctx
        self.node_id = node_id
        self.policy = policy_for(ctx, node_id)
        # Attempts of an earlier try (before `runtime retry`) keep their numbers but no
        # longer count: the node starts with a fresh max_attempts.
        self.history: list[AttemptRecord] = [a for a in prior.attempts if a.outcome is not None
                                             and a.attempt >= prior.retry_from]
        # ... but what they failed with is what the first retried attempt's preamble names.
        self.earlier: list[AttemptRecord] = [a for a in prior.attempts if a.outcome is not None
                                             and a.attempt < prior.retry_from]
        self._last_number = max((a.attempt for a in prior.attempts), default=0)
        self._waited_for: int | None = None  # the attempt number whose wait was served

    def run(self) -> NodeOutcome:
        """Run attempts until the node's policy says stop, and return the node's outcome.

        The blocking form of ``next_action``/``record``: waits sleep on the cancel event,
        attempts run on the run's engine in this thread.
        """
        while True:
            action = self.next_action()
            if isinstance(action, NodeOutcome):
                return action
            if isinstance(action, Wait):
                self.ctx.cancel.wait(action.seconds)  # a wait ends early on Ctrl-C
                continue
            self.record(Attempt(self.ctx, action).run())

    def next_action(self) -> AttemptSpec | Wait | NodeOutcome:
        """What comes next: an attempt to run, a wait before one, or the node's outcome.

        Never blocks. After a ``Wait`` (served in full, or cut short by a cancellation)
        ask again; after an attempt, ``record`` its record and ask again.
        """
        step = next_step(self.policy, [_past(r) for r in self.history],
                         next_number=self._last_number + 1)
        if isinstance(step, Stop):
            return self._outcome(step)
        blocked = self._blocked(step)
        if isinstance(blocked, Wait):
            return blocked
        if blocked is not None:
            return self._outcome(blocked)
        try:
            number = self.ctx.layout.claim_attempt(self.node_id, step.number)
        except OSError as exc:
            if exc.errno in FATAL_ERRNOS:
                raise FatalRunError(self.ctx.layout.node_dir(self.node_id),
                                    f"cannot create an attempt directory: {exc.strerror}"
                                    ) from None
            return NodeOutcome(NodeStatus.FAILED, FailureClass.LAUNCH_ERROR,
                               f"cannot create an attempt directory: {exc}", len(self.history))
        return self._spec(replace(step, number=number))

    def record(self, record: AttemptRecord) -> None:
        """Add a finished attempt to the node's history."""
        self._last_number = record.attempt
        self.history.append(record)

    def _blocked(self, step: Run) -> Stop | Wait | None:
        """The run-level ceilings: cancellation, the deadline, the attempt budget.

        A step with a wait gives a ``Wait`` the first time it is asked for; the budget is
        spent only when the attempt is about to start.
        """
        if self.ctx.cancel.is_set():
            return Stop(StopReason.CANCELLED, "cancelled")
        deadline = self.ctx.settings.deadline_at
        if step.wait_s > 0 and self._waited_for != step.number:
            if deadline is not None and self.ctx.clock() + step.wait_s >= deadline:
                return Stop(StopReason.DEADLINE, "run deadline passed", self._last_failure())
            self._waited_for = step.number
            return Wait(step.wait_s)
        if deadline is not None and self.ctx.clock() >= deadline:
            return Stop(StopReason.DEADLINE, "run deadline passed", self._last_failure())
        if not self.ctx.budget.take():
            return Stop(StopReason.BUDGET, f"run attempt budget exhausted "
                        f"({self.ctx.budget.limit} attempts)", self._last_failure())
        return None

    def _spec(self, step: Run) -> AttemptSpec:
        tried = self.earlier + self.history
        last = tried[-1] if tried else None
        charged = sum(1 for r in self.history if r.outcome is not None and r.outcome.is_charged())
        return AttemptSpec(
            node_id=self.node_id, number=step.number, profile=step.profile,
            trigger="retry" if last is not None else "initial",
            prior_attempt=last.attempt if last is not None else None, policy=self.policy,
            # Attempt numbers go on across `runtime retry` and uncharged (lost, cancelled)
            # attempts: the last number this try can reach, so "attempt k of N" has k <= N.
            last_number=step.number + self.policy.ceiling - charged - 1,
            prior_failures=tuple(self._prior_failures(tried)) if last is not None else (),
            waited_s=step.wait_s if last is not None
            and last.outcome is Outcome.RATE_LIMITED else 0.0)

    def _last_failure(self) -> FailureClass | None:
        for rec in reversed(self.history):
            if rec.outcome is not None and rec.outcome is not Outcome.LOST \
                    and rec.outcome.failure is not None:
                return rec.outcome.failure
        return None

    def _outcome(self, stop: Stop) -> NodeOutcome:
        count = len(self.history)
        status = STOP_STATUS.get(stop.reason, NodeStatus.FAILED)
        if stop.reason in (StopReason.DEADLINE, StopReason.BUDGET) and not self.history:
            return NodeOutcome(NodeStatus.SKIPPED, None, stop.detail, 0)  # never started
        if status is NodeStatus.PENDING:
            return NodeOutcome(status, FailureClass.CANCELLED, stop.detail, count)
        if status is NodeStatus.SUCCEEDED:
            return NodeOutcome(status, attempts=count,
                               artifacts=dict(self.history[-1].artifacts))
        return NodeOutcome(status, stop.failure, stop.detail, count)

    @staticmethod
    def _prior_failures(tried: list[AttemptRecord]) -> list[PriorFailure]:
        """Distinct prior failures, newest first, deduplicated by fingerprint.

        Those of earlier tries too: a retried node's first attempt must not replay the
        prompt that just failed. All from the ledger (an agent can write attempt.json,
        never the ledger).
        """
        seen: set[str] = set()
        out = []
        for rec in reversed(tried):
            failure = rec.outcome.failure if rec.outcome is not None else None
            if failure is None or rec.fingerprint is None:
                continue
            if failure in (FailureClass.LOST, FailureClass.CANCELLED):
                continue
            if rec.fingerprint in seen:
                continue
            seen.add(rec.fingerprint)
            out.append(PriorFailure(
                attempt=rec.attempt, failure_class=failure,
                exit_code=rec.exit_code, unsatisfied=list(rec.unsatisfied), error=rec.error,
                fingerprint=rec.fingerprint))
        return out


def _past(rec: AttemptRecord) -> Past:
    if rec.outcome is None:  # the history holds finished attempts only
        raise ValueError(f"attempt {rec.attempt} has not finished")
    return Past(attempt=rec.attempt, profile=rec.profile, outcome=rec.outcome,
                fingerprint=rec.fingerprint, retry_after_s=rec.retry_after_s,
                waited_s=rec.waited_s)
