"""A node's retry policy, built once, and the pure decision of what to do next.

``NodePolicy`` is the one typed place where a node's retry settings meet: plan values,
``--set`` overrides, ``--agent`` and ``--no-fallback``. ``next_step`` reads a node's
attempt history and answers "run attempt k on profile P (after waiting w s)" or "stop,
because ...": no I/O, no clock, no budget, so every ceiling is testable as data.
Ceilings come only from the plan and the run settings; nothing an agent prints or
writes can raise them.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer
from tenacity import RetryCallState, Retrying, wait_random_exponential

from runtime.failures import FailureClass, Outcome
from runtime.plan.manifest import PlanNode

LOST_STREAK_LIMIT = 3
RATE_LIMIT_WAIT_S = 300.0
RATE_LIMIT_MAX_STEP_S = 60.0


class NodeOverrides(BaseModel):
    """``--set NODE.FIELD=VALUE``: per-run settings that never touch prompt digests."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_attempts: int | None = Field(default=None, ge=1, le=20)
    retry_feedback: bool | None = None
    retry_on: tuple[FailureClass, ...] | None = None
    timeout_s: float | None = Field(default=None, gt=0, le=7 * 24 * 3600)
    rate_limit_wait_s: float | None = Field(default=None, ge=0, le=24 * 3600)

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        # Unset means "the plan's value": the ledger records only what the user set.
        return {k: v for k, v in handler(self).items() if v is not None}


class NodePolicy(BaseModel):
    """Everything that governs one node's attempts, resolved once per run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_attempts: int = Field(description="Charged attempts on the primary profile.")
    retry_on: tuple[FailureClass, ...] = Field(description="Classes retried on a profile.")
    retry_feedback: bool = Field(description="Attempt k >= 2 gets the retry preamble.")
    backoff_s: float = Field(description="Wait before a retry on the same profile.")
    timeout_s: float = Field(description="Per-attempt timeout.")
    feedback_max_bytes: int = Field(description="Bound of the retry preamble.")
    rate_limit_wait_s: float = Field(
        default=RATE_LIMIT_WAIT_S,
        description="Total wait for rate_limited replies, uncharged, before they count.")
    profiles: tuple[str, ...] = Field(
        description="The profiles in the order tried: the primary, then each fallback.")
    primary: str = Field(
        description="The profile that gets max_attempts (the node's agent, or --agent); "
                    "every other one gets one attempt, also when pre-flight left the "
                    "primary out.")

    @property
    def ceiling(self) -> int:
        """The most charged attempts the node can ever make."""
        return sum(self.allowance(i) for i in range(len(self.profiles)))

    def allowance(self, index: int) -> int:
        """Charged attempts allowed on ``profiles[index]``.

        The primary's first place gets ``max_attempts``; a fallback that names the primary
        again is one more attempt, like any fallback.
        """
        first = self.profiles.index(self.primary) if self.primary in self.profiles else -1
        return self.max_attempts if index == first else 1


class StopReason(StrEnum):
    """Why a node makes no further attempt."""

    SUCCEEDED = "succeeded"
    CANCELLED = "cancelled"
    NEVER_RETRIED = "never_retried"
    PROFILES_EXHAUSTED = "profiles_exhausted"
    LOST_STREAK = "lost_streak"
    BUDGET = "budget"
    DEADLINE = "deadline"


@dataclass(frozen=True)
class Past:
    """What ``next_step`` needs of one finished attempt (a ledger record projected)."""

    attempt: int
    profile: str
    outcome: Outcome
    fingerprint: str | None = None
    retry_after_s: float | None = None
    waited_s: float = 0.0


@dataclass(frozen=True)
class Run:
    """Make attempt ``number`` on ``profile`` after ``wait_s`` seconds."""

    number: int
    profile: str
    wait_s: float
    reason: str  # why this profile: "initial", "retry", "fallback after ..."


@dataclass(frozen=True)
class Stop:
    """No further attempt."""

    reason: StopReason
    detail: str
    failure: FailureClass | None = None


def _charged(p: Past) -> bool:
    return p.outcome.is_charged()


# C901: The ceilings in the order they apply; split apart, their precedence would hide.
def next_step(policy: NodePolicy, history: Sequence[Past], *, next_number: int,  # noqa: C901
              ) -> Run | Stop:
    """Decide the node's next attempt from its finished attempts. Pure.

    A profile ends (the node moves to the next fallback) when its charged attempts
    are spent; at once on a class no retry on the same profile fixes (``launch_error``,
    ``agent_auth``, ``agent_unreachable``, ``agent_rejected``), on a class not in
    ``retry_on`` (``agent_timeout`` by default), when the same failure fingerprint
    repeats on one profile despite retry feedback, and on ``rate_limited`` past the
    node's wait. ``digest_mismatch`` stops the node.
    """
    last = history[-1] if history else None
    if last is not None and last.outcome is Outcome.SUCCEEDED:
        return Stop(StopReason.SUCCEEDED, "succeeded")
    if last is not None and last.outcome is Outcome.DIGEST_MISMATCH:
        return Stop(StopReason.NEVER_RETRIED, "digest_mismatch is never retried",
                    FailureClass.DIGEST_MISMATCH)
    lost = 0
    for p in reversed(history):
        if p.outcome is not Outcome.LOST:
            break
        lost += 1
    if lost >= LOST_STREAK_LIMIT:
        return Stop(StopReason.LOST_STREAK, f"lost {LOST_STREAK_LIMIT} times in a row",
                    FailureClass.LOST)
    index, why = _current_profile(policy, history)
    if index >= len(policy.profiles):
        failure = next((p.outcome.failure for p in reversed(history)
                        if p.outcome not in (Outcome.SUCCEEDED, Outcome.LOST)), None)
        if len(policy.profiles) > 1:
            why = f"{why}; no fallback profile left"
        return Stop(StopReason.PROFILES_EXHAUSTED, why, failure)
    profile = policy.profiles[index]
    wait = 0.0
    if last is not None and last.profile == profile and last.outcome is not Outcome.SUCCEEDED:
        if last.outcome is Outcome.RATE_LIMITED:
            wait = _rate_limit_wait(policy, history, last)
        elif last.outcome.is_charged():
            wait = policy.backoff_s
    trigger = "initial" if not history else "retry"
    return Run(next_number, profile, wait, why or trigger)


def _current_profile(policy: NodePolicy, history: Sequence[Past]) -> tuple[int, str]:
    """The profile index the next attempt uses, and why the previous profile ended."""
    index, why = 0, ""
    on_profile: list[Past] = []
    for p in history:
        if index >= len(policy.profiles) or p.profile != policy.profiles[index]:
            continue  # made under other settings (--agent on an earlier resume): ignore
        on_profile.append(p)
        ended = _profile_ended(policy, index, on_profile)
        if ended:
            index, why, on_profile = index + 1, ended, []
            if index < len(policy.profiles):
                why = f"fallback to {policy.profiles[index]}: {ended}"
    return index, why


def _profile_ended(policy: NodePolicy, index: int, on_profile: list[Past]) -> str:
    """Why ``profiles[index]`` takes no further attempt, or "" while it still does."""
    last = on_profile[-1]
    cls = last.outcome.failure
    name = policy.profiles[index]
    if cls is None or cls in (FailureClass.LOST, FailureClass.CANCELLED):
        return ""
    if cls.ends_profile():
        return f"{cls.value} on profile {name}: not retried on the same profile"
    if cls is FailureClass.RATE_LIMITED:
        waited = sum(p.waited_s for p in on_profile)
        if waited + _min_wait(last) > policy.rate_limit_wait_s:
            asked = (f"; the provider asked for {last.retry_after_s:g} s more"
                     if last.retry_after_s else "")
            return (f"rate_limited on profile {name} after waiting {waited:g} s "
                    f"(rate_limit_wait_s {policy.rate_limit_wait_s:g}){asked}")
        return ""
    if cls not in policy.retry_on:
        return f"{cls.value} is not in retry_on"
    charged = [p for p in on_profile if _charged(p) and p.outcome is not Outcome.RATE_LIMITED]
    # Only with feedback on: a repeat then means the preamble did not help. Without it
    # a byte-identical replay is expected to repeat, and the budget is the user's call.
    if policy.retry_feedback and len(charged) >= 2 and charged[-1] is last \
            and last.fingerprint is not None and charged[-2].fingerprint == last.fingerprint:
        return (f"the same failure repeated despite retry feedback on profile {name}; "
                "stopped so it does not burn the remaining attempts")
    if len(charged) >= policy.allowance(index):
        return f"attempts exhausted ({len(charged)} of {policy.allowance(index)} on {name})"
    return ""


def _min_wait(last: Past) -> float:
    return last.retry_after_s or 1.0


def _rate_limit_wait(policy: NodePolicy, history: Sequence[Past], last: Past) -> float:
    """The wait before retrying a rate-limited attempt: jittered, Retry-After honoured, bounded.

    Exponential wait with full jitter (tenacity's strategy), never below the provider's
    Retry-After, never past what is left of the node's wait.
    """
    streak = 0
    for p in reversed(history):
        if p.profile != last.profile or p.outcome is not Outcome.RATE_LIMITED:
            break
        streak += 1
    state = RetryCallState(retry_object=Retrying(), fn=None, args=(), kwargs={})
    state.attempt_number = streak
    jittered = wait_random_exponential(multiplier=1, max=RATE_LIMIT_MAX_STEP_S)(state)
    left = policy.rate_limit_wait_s - sum(p.waited_s for p in history if p.profile == last.profile)
    return max(min(jittered, left), last.retry_after_s or 0.0)


def build_policy(node: PlanNode, overrides: NodeOverrides | None, *, agent: str | None,
                 no_fallback: bool, skip_profiles: Collection[str] = ()) -> NodePolicy:
    """Build the node's policy from plan values, overrides and pre-flight results.

    Plan values, then ``--set`` overrides; ``--agent`` replaces every profile,
    ``--no-fallback`` drops the fallbacks, and profiles that failed pre-flight are left out
    while another remains.
    """
    o = overrides or NodeOverrides()
    profiles = (agent,) if agent else (node.agent, *(() if no_fallback else node.fallback))
    usable = tuple(p for p in profiles if p not in skip_profiles)
    return NodePolicy(
        max_attempts=o.max_attempts if o.max_attempts is not None else node.max_attempts,
        retry_on=o.retry_on if o.retry_on is not None else tuple(node.retry_on),
        retry_feedback=o.retry_feedback if o.retry_feedback is not None
        else node.retry_feedback,
        backoff_s=node.backoff_s,
        timeout_s=o.timeout_s if o.timeout_s is not None else node.timeout_s,
        feedback_max_bytes=node.feedback_max_bytes,
        rate_limit_wait_s=o.rate_limit_wait_s if o.rate_limit_wait_s is not None
        else RATE_LIMIT_WAIT_S,
        profiles=usable or profiles,
        primary=profiles[0],
    )
