"""The pure retry decision: ceilings as data, no I/O, no clock."""

from __future__ import annotations

from runtime.failures import Outcome
from runtime.run.policy import NodePolicy, Past, Stop, StopReason, next_step


def _policy(**kw: object) -> NodePolicy:
    base: dict[str, object] = {
        "max_attempts": 2, "retry_on": (), "retry_feedback": False, "backoff_s": 0.0,
        "timeout_s": 60.0, "feedback_max_bytes": 8192, "profiles": ("p",), "primary": "p"}
    return NodePolicy.model_validate({**base, **kw})


def test_a_retry_after_past_the_wait_budget_is_named() -> None:
    """A new user's trial: a 429 asking for 3600 s ended the node 'after waiting 0 s',
    with nothing about the 3600."""
    history = [Past(attempt=1, profile="p", outcome=Outcome.RATE_LIMITED, retry_after_s=3600)]
    step = next_step(_policy(), history, next_number=2)
    assert isinstance(step, Stop)
    assert step.reason is StopReason.PROFILES_EXHAUSTED
    assert step.detail == ("rate_limited on profile p after waiting 0 s (rate_limit_wait_s "
                           "300); the provider asked for 3600 s more")
