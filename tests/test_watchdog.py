from __future__ import annotations

import threading
import time

import pytest

from runtime.plan.watchdog import WATCHDOG, Overtime

NO_GROWTH_BOUND = 1 << 62


def _spin_until(stop: threading.Event | None = None, seconds: float = 30.0) -> None:
    """A pure-Python loop: nothing but the watchdog (or ``stop``) ends it early."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and not (stop is not None and stop.is_set()):
        pass


def test_overtime_lands_in_the_armed_thread() -> None:
    token = WATCHDOG.arm(0.1, NO_GROWTH_BOUND)
    try:
        with pytest.raises(Overtime):
            _spin_until()
    finally:
        WATCHDOG.disarm_safely(token)


def test_nothing_lands_after_disarm() -> None:
    token = WATCHDOG.arm(0.1, NO_GROWTH_BOUND)
    WATCHDOG.disarm_safely(token)
    _spin_until(seconds=0.3)  # past the old deadline: no exception


def test_only_the_late_thread_is_interrupted() -> None:
    outcomes: dict[str, str] = {}
    stop = threading.Event()

    def work(name: str, seconds: float) -> None:
        token = WATCHDOG.arm(seconds, NO_GROWTH_BOUND)
        try:
            _spin_until(stop if name == "patient" else None)
            outcomes[name] = "finished"
        except Overtime:
            outcomes[name] = "overtime"
        finally:
            WATCHDOG.disarm_safely(token)

    patient = threading.Thread(target=work, args=("patient", 60.0))
    late = threading.Thread(target=work, args=("late", 0.1))
    patient.start()
    late.start()
    late.join()
    stop.set()
    patient.join()
    assert outcomes == {"late": "overtime", "patient": "finished"}
