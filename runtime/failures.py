"""Closed sets: failure classes and outcomes of an attempt, and statuses of a node or run.

Failure classes are deterministic labels of evidence, not diagnoses (DESIGN section 7).
"""

from __future__ import annotations

from enum import StrEnum


class FailureClass(StrEnum):
    """Why an attempt failed, from evidence the runtime observed itself."""

    AGENT_EXIT = "agent_exit"
    AGENT_TIMEOUT = "agent_timeout"
    ARTIFACT_CONTRACT = "artifact_contract"
    CONTRADICTORY_COMPLETION = "contradictory_completion"
    LAUNCH_ERROR = "launch_error"
    LOST = "lost"
    CANCELLED = "cancelled"
    DIGEST_MISMATCH = "digest_mismatch"
    # Agent availability (DESIGN section 10): no retry on the same profile fixes these,
    # except rate_limited, which waits uncharged within the node's rate_limit_wait_s.
    AGENT_AUTH = "agent_auth"
    AGENT_UNREACHABLE = "agent_unreachable"
    AGENT_REJECTED = "agent_rejected"
    RATE_LIMITED = "rate_limited"

    def is_retryable(self) -> bool:
        """A tampered plan is never retried, whatever ``retry_on`` says."""
        return self is not FailureClass.DIGEST_MISMATCH

    def is_charged(self) -> bool:
        """Whether an attempt of this class counts against the node's ``max_attempts``.

        Lost and cancelled attempts say nothing about the work, and a rate-limited one waits
        within its own allowance: none counts against the node's ``max_attempts`` (each
        counts against the run budget).
        """
        return self not in (FailureClass.LOST, FailureClass.CANCELLED, FailureClass.RATE_LIMITED)

    def ends_profile(self) -> bool:
        """Never retried on the same profile.

        The node moves to its next fallback at once (a missing binary or a rejected key
        fails identically every time).
        """
        return self in (FailureClass.LAUNCH_ERROR, FailureClass.AGENT_AUTH,
                        FailureClass.AGENT_UNREACHABLE, FailureClass.AGENT_REJECTED)


class Outcome(StrEnum):
    """How a finished attempt ended: ``succeeded``, or the failure class that says why not.

    Its values are ``succeeded`` and the failure classes' own values (a test keeps the two
    enums in step), so the ledger's ``outcome`` field reads as it always did. An attempt
    that has not finished has no outcome (``None``), never a stand-in value.
    """

    SUCCEEDED = "succeeded"
    AGENT_EXIT = "agent_exit"
    AGENT_TIMEOUT = "agent_timeout"
    ARTIFACT_CONTRACT = "artifact_contract"
    CONTRADICTORY_COMPLETION = "contradictory_completion"
    LAUNCH_ERROR = "launch_error"
    LOST = "lost"
    CANCELLED = "cancelled"
    DIGEST_MISMATCH = "digest_mismatch"
    AGENT_AUTH = "agent_auth"
    AGENT_UNREACHABLE = "agent_unreachable"
    AGENT_REJECTED = "agent_rejected"
    RATE_LIMITED = "rate_limited"

    @classmethod
    def of(cls, failure: FailureClass | None) -> Outcome:
        """The outcome of an attempt that failed with ``failure`` (None: it succeeded)."""
        return cls.SUCCEEDED if failure is None else cls(failure.value)

    @property
    def failure(self) -> FailureClass | None:
        """The failure class, or None for ``succeeded``."""
        return None if self is Outcome.SUCCEEDED else FailureClass(self.value)

    def is_charged(self) -> bool:
        """Whether the attempt counts against the node's ``max_attempts`` (a success does)."""
        failure = self.failure
        return failure is None or failure.is_charged()


DEFAULT_RETRY_ON = (
    FailureClass.AGENT_EXIT,
    FailureClass.ARTIFACT_CONTRACT,
    FailureClass.CONTRADICTORY_COMPLETION,
)


class NodeStatus(StrEnum):
    """Where a node is in a run; succeeded, failed and skipped are terminal."""
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SKIPPED = "skipped"

    def is_terminal(self) -> bool:
        """Whether the node is done for this run (a retry can still make it pending again)."""
        return self in (NodeStatus.SUCCEEDED, NodeStatus.FAILED, NodeStatus.SKIPPED)


class RunStatus(StrEnum):
    """How a run stands: running, or how it ended."""
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
