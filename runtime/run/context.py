"""Run-wide shared state, the per-attempt spec, and a node's final outcome.

What every attempt of a run shares (RunContext, the attempt budget), what one attempt is
handed (AttemptSpec), and what a node's attempts come to (NodeOutcome).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from runtime.agents.procs import run_key
from runtime.digest import blake3_hex, canonical_json
from runtime.failures import FailureClass, NodeStatus
from runtime.plan.manifest import Manifest
from runtime.prompt.feedback import PriorFailure
from runtime.prompt.redact import Redactor
from runtime.run.engine import Engine, LocalEngine
from runtime.run.layout import RunLayout
from runtime.run.ledger import Ledger
from runtime.run.policy import NodePolicy
from runtime.run.records import RunSettings


class AttemptBudget:
    """The run's total attempt budget, shared by every node (thread-safe)."""

    def __init__(self, limit: int | None, used: int = 0) -> None:
        self.limit, self.used = limit, used
        self._lock = threading.Lock()

    def take(self) -> bool:
        """Spend one attempt of the budget; False when it is exhausted."""
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
    # Where attempts' agents run (--engine); not a run setting: a run may be resumed on
    # another engine.
    engine: Engine = field(default_factory=LocalEngine)
    # node -> {artifact path: blake3} of its accepted artifacts, from node.succeeded.
    # Written by the scheduler before any dependent starts; read by the dependents.
    accepted: dict[str, dict[str, str] | None] = field(default_factory=dict)

    def accepted_inputs(self, node_id: str) -> dict[str, dict[str, str]]:
        """Give each upstream's accepted artifacts and digests, as recorded when it succeeded.

        A run recorded before digests existed gives its declared paths, with no digest.
        """
        out = {}
        for up in self.manifest.nodes[node_id].needs:
            recorded = self.accepted.get(up)
            out[up] = recorded if recorded is not None else {
                a.path: "" for a in self.manifest.nodes[up].artifacts}
        return out

    def profile_digest(self, name: str) -> str:
        """The digest of profile ``name`` as this run resolved it (recorded in ``attempt.json``)."""
        return self._profile_digests[name]

    @functools.cached_property
    def run_key(self) -> str:
        """``RUNTIME_RUN_KEY`` of this run's agents (a realpath per attempt otherwise)."""
        return run_key(self.layout.root)

    @functools.cached_property
    def _profile_digests(self) -> dict[str, str]:
        return {name: blake3_hex(canonical_json(p.model_dump(mode="json")))
                for name, p in self.manifest.agents.items()}


@dataclass(frozen=True)
class AttemptSpec:
    """Everything one attempt needs from its node's history, decided before it starts.

    The attempt gets this and hands back an ``AttemptRecord``: it holds no reference to
    the node's executor and never reads or changes the node's history.
    """

    node_id: str
    number: int
    profile: str
    trigger: Literal["initial", "retry"]
    prior_attempt: int | None
    policy: NodePolicy
    last_number: int  # the highest attempt number this attempt's try can reach
    prior_failures: tuple[PriorFailure, ...] = ()
    waited_s: float = 0.0


@dataclass(frozen=True)
class NodeOutcome:
    """How a node's attempts ended, for the scheduler to record."""

    status: NodeStatus  # SUCCEEDED, FAILED, or PENDING when the run was cancelled
    failure: FailureClass | None = None
    reason: str = ""
    attempts: int = 0
    artifacts: dict[str, str] = field(default_factory=dict)  # path -> blake3, on success
