"""One node's attempts: check, prepare, assemble, invoke, classify, record; retry.

The retry loop is one ``tenacity.Retrying`` per node, built in ``_retrying``, iterated
so each attempt writes its own ledger events. Ceilings come only from the plan and the
run settings (``max_attempts``, fallbacks, the run budget, the deadline); nothing an
agent prints or writes can raise them.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tenacity import Retrying, retry_if_result, wait_fixed, wait_none

from .agents import AgentExit, Invocation, make_agent
from .assemble import RuntimeContext, assemble_prompt
from .capture import BoundedCapture
from .contract import AcceptanceSummary, verify_artifacts
from .digest import blake3_hex, canonical_json
from .failures import FailureClass, NodeStatus
from .feedback import fingerprint, render_preamble
from .files import replace_atomically, write_read_only
from .ledger import (
    AttemptFinished,
    AttemptRecord,
    AttemptStarted,
    Ledger,
    NodeState,
    charged_attempts,
    consecutive_lost,
)
from .plan import Manifest, PlanNode
from .records import AttemptContext, PriorFailure, RunSettings, read_attempt_context
from .redact import Redactor
from .rundir import RunLayout

ERROR_LIMIT = 4096
LOST_STREAK_LIMIT = 3


class AttemptBudget:
    """The run's total attempt budget, shared by every node (thread-safe)."""

    def __init__(self, limit: int | None, used: int = 0) -> None:
        self.limit, self.used = limit, used
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self.limit is not None and self.used >= self.limit:
                return False
            self.used += 1
            return True


@dataclass(frozen=True)
class RunContext:
    """Everything the attempts of every node share. One per run (or resume)."""

    run_id: str
    layout: RunLayout
    manifest: Manifest
    settings: RunSettings
    ledger: Ledger
    budget: AttemptBudget
    redactor: Redactor
    cancel: threading.Event = field(default_factory=threading.Event)
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.time

    def profile_digest(self, name: str) -> str:
        return self._profile_digests[name]

    @functools.cached_property
    def _profile_digests(self) -> dict[str, str]:
        return {name: blake3_hex(canonical_json(p.model_dump(mode="json")))
                for name, p in self.manifest.agents.items()}


@dataclass(frozen=True)
class NodePolicy:
    """A node's retry settings after ``--set`` overrides and ``--agent``/``--no-fallback``."""

    max_attempts: int
    retry_on: frozenset[FailureClass]
    retry_feedback: bool
    backoff_s: float
    timeout_s: float
    feedback_max_bytes: int
    primary: str
    fallback: tuple[str, ...]

    @property
    def ceiling(self) -> int:
        return self.max_attempts + len(self.fallback)

    def profile_for(self, charged: int) -> str:
        if charged < self.max_attempts:
            return self.primary
        return self.fallback[min(charged - self.max_attempts, len(self.fallback) - 1)]


def node_policy(node_id: str, node: PlanNode, settings: RunSettings) -> NodePolicy:
    o = settings.overrides.get(node_id, {})
    primary = settings.agent or node.agent
    fallback = () if settings.no_fallback or settings.agent else tuple(node.fallback)
    return NodePolicy(
        max_attempts=int(o.get("max_attempts", node.max_attempts)),
        retry_on=frozenset(FailureClass(c) for c in o.get("retry_on", node.retry_on)),
        retry_feedback=bool(o.get("retry_feedback", node.retry_feedback)),
        backoff_s=node.backoff_s,
        timeout_s=node.timeout_s,
        feedback_max_bytes=node.feedback_max_bytes,
        primary=primary,
        fallback=fallback,
    )


@dataclass(frozen=True)
class AttemptResult:
    outcome: FailureClass | None  # None: succeeded
    number: int = 0
    fingerprint: str | None = None
    blocked: str | None = None  # why no attempt could start (budget, deadline, cancel)

    @property
    def succeeded(self) -> bool:
        return self.outcome is None and self.blocked is None


@dataclass(frozen=True)
class NodeOutcome:
    status: NodeStatus  # SUCCEEDED, FAILED, or PENDING when the run was cancelled
    failure: FailureClass | None = None
    reason: str = ""
    attempts: int = 0


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

    def _blocked(self) -> str | None:
        if self.ctx.cancel.is_set():
            return "cancelled"
        if self.charged() >= self.policy.ceiling:
            return f"attempts exhausted ({self.charged()} of {self.policy.ceiling})"
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
        if self.charged() >= self.policy.ceiling:
            self.stop_reason = f"attempts exhausted ({self.charged()} of {self.policy.ceiling})"
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
        return _Attempt(self, self._next_number()).run()

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


class _Attempt:
    """One attempt, start to finish. Split out so each step stays small."""

    def __init__(self, owner: NodeExecutor, number: int) -> None:
        self.o = owner
        self.ctx = owner.ctx
        self.node_id, self.node, self.policy = owner.node_id, owner.node, owner.policy
        self.number = number
        self.dir = self.ctx.layout.attempt_dir(self.node_id, number)
        finished = [a for a in owner.history if a.outcome is not None]
        self.trigger: str = "retry" if finished else "initial"
        self.prior_attempt = finished[-1].attempt if finished else None
        self.profile_name = self.policy.profile_for(owner.charged())
        self.started = self.ctx.clock()

    def run(self) -> AttemptResult:
        self.dir.mkdir()
        layout = self.ctx.layout
        plan_prompt_path = layout.prompt_rendered(self.node_id)
        plan_bytes = plan_prompt_path.read_bytes()  # hashed and used: one read, no race
        actual = blake3_hex(plan_bytes)
        if actual != self.node.prompt_digest:
            error = (f"{plan_prompt_path.name} hashes to {actual}, the plan says "
                     f"{self.node.prompt_digest}: the plan was tampered with")
            self._start(prompt_digest=actual, preamble=None, prior=[])
            return self._finish(FailureClass.DIGEST_MISMATCH, None, error,
                                AcceptanceSummary(), 0, 0)
        plan_prompt = plan_bytes.decode("utf-8")
        layout.reset_workspace(self.node_id)
        inputs = layout.place_inputs(self.node_id, {
            up: [a.path for a in self.ctx.manifest.nodes[up].artifacts]
            for up in self.node.needs})
        prior = self.o.prior_failures() if self.trigger == "retry" else []
        preamble = None
        if self.policy.retry_feedback and self.trigger == "retry" and prior:
            preamble = render_preamble(self.number, self.policy.ceiling, prior,
                                       self.policy.feedback_max_bytes)
        prompt = assemble_prompt(
            RuntimeContext(
                topology=self.ctx.manifest.topology.name, node=self.node_id,
                artifacts=[(a.path, a.kind, a.required) for a in self.node.artifacts],
                inputs=inputs),
            plan_prompt, operator_prompt=self.ctx.settings.operator_prompt, preamble=preamble)
        write_read_only(self.dir / "prompt.md", prompt.encode())
        self._start(prompt_digest=blake3_hex(prompt.encode()), preamble=preamble, prior=prior)
        return self._invoke(prompt)

    def _context(self, **outcome: object) -> AttemptContext:
        return AttemptContext(
            run_id=self.ctx.run_id, node=self.node_id, attempt=self.number,
            max_attempts=self.policy.ceiling, trigger=self.trigger,  # type: ignore[arg-type]
            prior_attempt=self.prior_attempt, profile=self.profile_name,
            profile_digest=self.ctx.profile_digest(self.profile_name),
            plan_prompt_digest=self.node.prompt_digest, prompt_digest=self._prompt_digest,
            preamble_digest=self._preamble_digest, prior_failures=self._prior,
            started_at=self.started, **outcome)  # type: ignore[arg-type]

    def _write_context(self, ctx: AttemptContext) -> None:
        data = (ctx.model_dump_json(indent=2) + "\n").encode()
        target = self.dir / "attempt.json"
        if ctx.outcome is None:  # the first write creates the file: nothing to replace
            target.write_bytes(data)
            return
        replace_atomically(target, data)

    def _start(self, *, prompt_digest: str, preamble: str | None,
               prior: list[PriorFailure]) -> None:
        self._prompt_digest = prompt_digest
        self._preamble_digest = blake3_hex(preamble.encode()) if preamble else None
        self._prior = prior
        self._write_context(self._context())
        self.ctx.ledger.append(AttemptStarted(
            node=self.node_id, attempt=self.number, profile=self.profile_name,
            trigger=self.trigger,  # type: ignore[arg-type]
            prior_attempt=self.prior_attempt, prompt_digest=prompt_digest,
            preamble_digest=self._preamble_digest))
        self.o.history.append(AttemptRecord(attempt=self.number, profile=self.profile_name,
                                            trigger=self.trigger))  # type: ignore[arg-type]

    def _invoke(self, prompt: str) -> AttemptResult:
        stdout = BoundedCapture(self.dir / "stdout.log")
        stderr = BoundedCapture(self.dir / "stderr.log")
        ws = self.ctx.layout.workspace(self.node_id)
        timeout = self.policy.timeout_s
        if self.ctx.settings.deadline_at is not None:
            timeout = max(0.001, min(timeout, self.ctx.settings.deadline_at - self.ctx.clock()))
        inv = Invocation(
            run_id=self.ctx.run_id, node=self.node_id, attempt=self.number,
            max_attempts=self.policy.ceiling, prompt=prompt,
            prompt_file=self.dir / "prompt.md", workspace=ws, timeout_s=timeout,
            env=self._env(ws), artifacts=tuple(self.node.artifacts), stdout=stdout,
            stderr=stderr, cancel=self.ctx.cancel)
        try:
            agent = make_agent(self.ctx.manifest.agents[self.profile_name])
            exit_ = agent.run(inv)
        finally:
            stdout.close()
            stderr.close()
        failure, error = self._classify(exit_, stderr, timeout)
        acceptance = AcceptanceSummary()
        if failure not in (FailureClass.LAUNCH_ERROR, FailureClass.CANCELLED):
            acceptance = verify_artifacts(ws, list(self.node.artifacts),
                                          list(self.node.acceptance))
            if failure is None and acceptance.unsatisfied:
                failure, error = FailureClass.ARTIFACT_CONTRACT, "\n".join(acceptance.unsatisfied)
        return self._finish(failure, exit_.exit_code, error, acceptance, stdout.total,
                            stderr.total)

    def _env(self, ws: Path) -> Mapping[str, str]:
        return {
            "RUNTIME_RUN_ID": self.ctx.run_id, "RUNTIME_NODE": self.node_id,
            "RUNTIME_ATTEMPT": str(self.number),
            "RUNTIME_MAX_ATTEMPTS": str(self.policy.ceiling),
            "RUNTIME_WORKSPACE": str(ws), "RUNTIME_PROMPT_FILE": str(self.dir / "prompt.md"),
            "RUNTIME_ATTEMPT_CONTEXT": str(self.dir / "attempt.json"),
        }

    def _classify(self, exit_: AgentExit, stderr: BoundedCapture, timeout: float,
                  ) -> tuple[FailureClass | None, str]:
        tail = stderr.tail_text(ERROR_LIMIT)
        if exit_.launch_error is not None:
            return FailureClass.LAUNCH_ERROR, exit_.launch_error
        if exit_.cancelled:
            return FailureClass.CANCELLED, "cancelled by the operator"
        if exit_.timed_out:
            return FailureClass.AGENT_TIMEOUT, f"timed out after {timeout:g} s\n{tail}".strip()
        if exit_.exit_code != 0:
            return FailureClass.AGENT_EXIT, f"exit status {exit_.exit_code}\n{tail}".strip()
        if exit_.reported_error is not None:
            return FailureClass.CONTRADICTORY_COMPLETION, exit_.reported_error
        return None, ""

    def _finish(self, failure: FailureClass | None, exit_code: int | None, error: str,
                acceptance: AcceptanceSummary, out_bytes: int, err_bytes: int,
                ) -> AttemptResult:
        finished = self.ctx.clock()
        clean = self.ctx.redactor.clean(error, ERROR_LIMIT) if error else ""
        clean_acc = AcceptanceSummary(
            satisfied=acceptance.satisfied, unknown=acceptance.unknown,
            unsatisfied=[self.ctx.redactor.clean(u, 1024) for u in acceptance.unsatisfied])
        fp = fingerprint(failure, clean) if failure is not None else None
        outcome: Literal["succeeded"] | FailureClass = "succeeded" if failure is None else failure
        self._write_context(self._context(
            outcome=outcome, failure_classes=[failure] if failure else [],
            exit_code=exit_code, error=clean, acceptance=clean_acc, stdout_bytes=out_bytes,
            stderr_bytes=err_bytes, finished_at=finished,
            duration_s=round(finished - self.started, 6)))
        self.ctx.ledger.append(AttemptFinished(
            node=self.node_id, attempt=self.number, outcome=outcome, exit_code=exit_code,
            error=clean, fingerprint=fp, duration_s=round(finished - self.started, 6)),
            sync=False)  # the next event, synced before anything acts on this one, covers it
        self.o.history[-1] = self.o.history[-1].model_copy(update={
            "outcome": outcome, "exit_code": exit_code, "error": clean, "fingerprint": fp,
            "duration_s": round(finished - self.started, 6)})
        return AttemptResult(outcome=failure, number=self.number, fingerprint=fp)
