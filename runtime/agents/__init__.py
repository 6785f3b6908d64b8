"""Agent adapters behind one Protocol: ``command``, ``python``, ``simulated`` (and ``http``).

An adapter receives one ``Invocation`` (the assembled prompt, a workspace, a timeout, a
cancel event, bounded output sinks) and returns an ``AgentExit``: evidence only. The
executor turns evidence into a failure class; nothing an agent returns can change how
many attempts it gets.
"""

from __future__ import annotations

from collections.abc import Mapping

from runtime.agents.base import Agent
from runtime.plan.profiles import CommandProfile, HttpProfile, PythonProfile, SimulatedProfile

AnyProfile = CommandProfile | HttpProfile | PythonProfile | SimulatedProfile


def make_agent(profile: AnyProfile, *, secrets_env: Mapping[str, str] | None = None) -> Agent:
    """Build the adapter for a profile frozen in the plan."""
    match profile:
        case CommandProfile():
            from runtime.agents.command import CommandAgent

            return CommandAgent(profile)
        case PythonProfile():
            from runtime.agents.python import PythonAgent

            return PythonAgent(profile)
        case SimulatedProfile():
            from runtime.agents.simulated import SimulatedAgent

            return SimulatedAgent(profile)
        case HttpProfile():
            from runtime.agents.http import HttpAgent

            return HttpAgent(profile)
    raise TypeError(f"no adapter for profile {profile!r}")  # pragma: no cover
