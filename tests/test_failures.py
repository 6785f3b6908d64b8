"""Outcomes and failure classes stay one vocabulary (issue 12: one Outcome enum)."""

from __future__ import annotations

import pytest

from runtime.failures import FailureClass, Outcome


def test_an_outcome_is_succeeded_or_exactly_one_failure_class() -> None:
    assert {o.value for o in Outcome} == {"succeeded"} | {f.value for f in FailureClass}


@pytest.mark.parametrize("failure", list(FailureClass))
def test_a_failure_round_trips_through_its_outcome(failure: FailureClass) -> None:
    outcome = Outcome.of(failure)
    assert outcome.failure is failure
    assert outcome.value == failure.value  # the ledger reads as it always did
    assert outcome.is_charged() is failure.is_charged()


def test_success_is_charged_and_has_no_failure_class() -> None:
    assert Outcome.of(None) is Outcome.SUCCEEDED
    assert Outcome.SUCCEEDED.failure is None
    assert Outcome.SUCCEEDED.is_charged()
