"""What every attempt of a run shares (RunContext, the attempt budget) and what one
node's attempts are governed by (NodePolicy), plus the small result types passed back."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .digest import blake3_hex, canonical_json
from .failures import FailureClass, NodeStatus
from .ledger import Ledger
from .plan import Manifest, PlanNode
from .records import RunSettings
from .redact import Redactor
from .rundir import RunLayout


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
