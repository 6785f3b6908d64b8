"""The ``python`` agent: an in-process callable, for tests and in-process agents.

A callable ``module:function`` taking an Invocation, for tests and in-process agents. It
returns an ``AgentExit``, an exit code, or None (exit 0); an exception is an agent exit with
status 1 and the exception text on stderr. It runs in a thread of its own; past
``inv.timeout_s`` the attempt is recorded as timed out and the runtime moves on (a thread
cannot be killed: the callable should honour ``inv.cancel``).
"""

from __future__ import annotations

import importlib
import threading
import traceback
from collections.abc import Callable
from typing import Any

from runtime.agents.base import AgentExit, Invocation
from runtime.plan.profiles import PythonProfile


def load_target(target: str) -> Callable[[Invocation], Any]:
    """Import ``module:function`` and return the callable; TypeError when it is not callable."""
    module_name, _, attr = target.partition(":")
    func = getattr(importlib.import_module(module_name), attr)
    if not callable(func):
        raise TypeError(f"{target} is not callable")
    return func  # type: ignore[no-any-return]


class PythonAgent:
    """The ``python`` agent: calls the profile's ``module:function`` in a thread of its own.

    Args:
        profile: the profile naming the ``target`` callable.
    """
    def __init__(self, profile: PythonProfile) -> None:
        self.profile = profile

    def run(self, inv: Invocation) -> AgentExit:
        """Call the target with ``inv``; an import failure is a launch error, a raise exit 1."""
        try:
            func = load_target(self.profile.target)
        except (ImportError, AttributeError, TypeError) as exc:
            return AgentExit(launch_error=f"{self.profile.target}: {exc}")
        box: list[AgentExit] = []
        worker = threading.Thread(target=_call, args=(func, inv, box), daemon=True,
                                  name=f"agent-{inv.node}-{inv.attempt}")
        worker.start()
        worker.join(inv.timeout_s)
        if worker.is_alive():
            return AgentExit(timed_out=True)
        return box[0] if box else AgentExit(exit_code=1)


def _call(func: Callable[[Invocation], Any], inv: Invocation, box: list[AgentExit]) -> None:
    try:
        result = func(inv)
    except Exception as exc:  # noqa: BLE001 - the agent's bug is the agent's failure, not ours
        inv.stderr.write("".join(traceback.format_exception_only(type(exc), exc)))
        box.append(AgentExit(exit_code=1))
        return
    if isinstance(result, AgentExit):
        box.append(result)
    else:
        box.append(AgentExit(exit_code=0 if result is None else int(result)))
