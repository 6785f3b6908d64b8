"""One node's attempts under its retry policy.

The retry loop is one ``tenacity.Retrying`` per node, built in ``_retrying``, iterated
so each attempt writes its own ledger events (``attempt.py`` runs one attempt). Ceilings
come only from the plan and the run settings (``max_attempts``, fallbacks, the run
budget, the deadline); nothing an agent prints or writes can raise them.
"""

from __future__ import annotations

from tenacity import Retrying, retry_if_result, wait_fixed, wait_none

from .attempt import Attempt
from .context import AttemptResult, NodeOutcome, RunContext, node_policy
from .failures import FailureClass, NodeStatus
from .ledger import AttemptRecord, NodeState, charged_attempts, consecutive_lost
from .records import PriorFailure, read_attempt_context

LOST_STREAK_LIMIT = 3


class NodeExecutor:
    """Runs the remaining attempts of one node, continuing from its ledger history."""

    def __init__(self, ctx: RunContext, node_id: str, prior: NodeState) -> None:
        self.ctx = ctx
        self.node_id = node_id
        self.node = ctx.manifest.nodes[node_id]
        self.policy = node_policy(node_id, self.node, ctx.settings)
        self.history: list[AttemptRecord] = list(prior.attempts)
        self.stop_reason = ""

    # -- bookkeeping ---------------------------------------------------------------
    def charged(self) -> int:
        return charged_attempts(self.history)

    def _exhausted(self) -> str | None:
        charged = self.charged()
        if charged >= self.policy.ceiling:
            return f"attempts exhausted ({charged} of {self.policy.ceiling})"
        return None

    def _blocked(self) -> str | None:
        if self.ctx.cancel.is_set():
            return "cancelled"
        if (exhausted := self._exhausted()) is not None:
            return exhausted
        if consecutive_lost(self.history) >= LOST_STREAK_LIMIT:
            return f"lost {LOST_STREAK_LIMIT} times in a row"
        deadline = self.ctx.settings.deadline_at
        if deadline is not None and self.ctx.clock() >= deadline:
            return "run deadline passed"
        if not self.ctx.budget.take():
            return f"run attempt budget exhausted ({self.ctx.budget.limit} attempts)"
        return None

    def _should_retry(self, result: AttemptResult) -> bool:
        if result.blocked is not None or result.outcome is None:
            return False
        cls = result.outcome
        if not cls.is_retryable() or cls is FailureClass.CANCELLED:
            self.stop_reason = f"{cls.value} is never retried"
            return False
        if cls.is_charged() and cls not in self.policy.retry_on:
            self.stop_reason = f"{cls.value} is not in retry_on"
            return False
        if self._same_failure_despite_feedback(result):
            self.stop_reason = ("the same failure repeated despite retry feedback; "
                                "stopped so it does not burn the remaining attempts")
            return False
        if (exhausted := self._exhausted()) is not None:
            self.stop_reason = exhausted
            return False
        return True

    def _same_failure_despite_feedback(self, result: AttemptResult) -> bool:
        """Attempt k got feedback about attempt k-1 and failed the same way anyway."""
        charged = [a for a in self.history if a.outcome not in (None, "succeeded")
                   and FailureClass(a.outcome).is_charged()]
        if not self.policy.retry_feedback or len(charged) < 2:
            return False
        current, previous = charged[-1], charged[-2]
        return current.attempt == result.number and current.fingerprint is not None \
            and current.trigger == "retry" and current.fingerprint == previous.fingerprint

    def _retrying(self) -> Retrying:
        backoff = self.policy.backoff_s
        return Retrying(
            stop=lambda _state: False,  # _should_retry owns every ceiling
            retry=retry_if_result(self._should_retry),
            wait=wait_fixed(backoff) if backoff > 0 else wait_none(),
            sleep=self._sleep,
            reraise=True,
        )

    def _sleep(self, seconds: float) -> None:
        self.ctx.cancel.wait(seconds)  # a backoff wait ends early on Ctrl-C

    # -- the loop ------------------------------------------------------------------
    def run(self) -> NodeOutcome:
        result = AttemptResult(outcome=None, blocked="no attempt made")
        for attempt in self._retrying():
            with attempt:
                result = self.attempt_once()
            if not attempt.retry_state.outcome or not attempt.retry_state.outcome.failed:
                attempt.retry_state.set_result(result)
        return self._outcome(result)

    def _outcome(self, result: AttemptResult) -> NodeOutcome:
        count = len(self.history)
        if result.succeeded:
            return NodeOutcome(NodeStatus.SUCCEEDED, attempts=count)
        if result.blocked == "cancelled" or result.outcome is FailureClass.CANCELLED:
            return NodeOutcome(NodeStatus.PENDING, FailureClass.CANCELLED, "cancelled", count)
        last = next((a for a in reversed(self.history) if a.outcome not in (None, "succeeded")),
                    None)
        failure = FailureClass(last.outcome) if last and last.outcome else None
        reason = result.blocked or self.stop_reason or "failed"
        return NodeOutcome(NodeStatus.FAILED, failure, reason, count)

    def attempt_once(self) -> AttemptResult:
        if (blocked := self._blocked()) is not None:
            return AttemptResult(outcome=None, blocked=blocked)
        return Attempt(self, self._next_number()).run()

    def _next_number(self) -> int:
        """Attempt numbers never repeat: a crash can leave an attempt directory whose
        ``attempt.started`` never reached the ledger, so existing directories count too."""
        root = self.ctx.layout.node_dir(self.node_id) / "attempts"
        on_disk = [int(p.name) for p in root.iterdir() if p.name.isdigit()] \
            if root.is_dir() else []
        return max([a.attempt for a in self.history] + on_disk, default=0) + 1

    def prior_failures(self) -> list[PriorFailure]:
        """Distinct prior failures, newest first, deduplicated by fingerprint."""
        seen: set[str] = set()
        out = []
        for rec in reversed(self.history):
            if rec.outcome in (None, "succeeded") or rec.fingerprint is None:
                continue
            if FailureClass(rec.outcome) in (FailureClass.LOST, FailureClass.CANCELLED):
                continue
            if rec.fingerprint in seen:
                continue
            seen.add(rec.fingerprint)
            ctx = read_attempt_context(self.ctx.layout.attempt_dir(self.node_id, rec.attempt))
            out.append(PriorFailure(
                attempt=rec.attempt, failure_class=FailureClass(rec.outcome),
                exit_code=rec.exit_code,
                unsatisfied=list(ctx.acceptance.unsatisfied) if ctx else [],
                error=rec.error, fingerprint=rec.fingerprint))
        return out
