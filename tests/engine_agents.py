"""Python agents for the engine tests (``tests.engine_agents:NAME``): importable on Ray
workers, which get the repository root on PYTHONPATH from the test fixture."""

from __future__ import annotations

import os

from runtime.agents.base import Invocation
from tests.agent_scripts import write_all


def crash_first(inv: Invocation) -> int:
    """Attempt 1 takes its whole process down, as a dying worker would."""
    if inv.attempt == 1:
        os._exit(17)
    return write_all(inv)
