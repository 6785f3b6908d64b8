"""``simulated`` agent: deterministic and offline, for demos and tests.

It writes every artifact the node declares (JSON that satisfies the declared schema,
Markdown otherwise), with content derived from the prompt it received. A profile can
script a mistake per node (``mistakes``): write the first artifact under a wrong name,
exit non-zero, write invalid JSON, report an error with exit 0, or hang past the
timeout. With ``unless_feedback`` the mistake is not made when the prompt's retry
preamble names it: the model of an agent that reads why its last attempt failed, and
repeats its mistake when nobody tells it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..assemble import PRIOR_FAILURE_CLOSE, PRIOR_FAILURE_OPEN
from ..digest import blake3_hex
from ..profiles import SimulatedMistake, SimulatedProfile
from ..topology import ArtifactSpec
from . import AgentExit, Invocation


def example_for(schema: dict[str, Any] | None) -> Any:
    """A small value that satisfies simple JSON Schemas (type, required, enum, const)."""
    if not schema:
        return {"simulated": True}
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    kind = schema.get("type", "object")
    kind = kind[0] if isinstance(kind, list) else kind
    if kind == "object":
        props = schema.get("properties", {})
        return {key: example_for(props.get(key, {"type": "string"}))
                for key in schema.get("required", [])}
    if kind == "array":
        return [example_for(schema["items"])] * schema.get("minItems", 0) \
            if isinstance(schema.get("items"), dict) else []
    return {"string": "simulated", "integer": 0, "number": 0, "boolean": False,
            "null": None}.get(kind, "simulated")


class SimulatedAgent:
    def __init__(self, profile: SimulatedProfile) -> None:
        self.profile = profile

    def _mistake(self, inv: Invocation) -> SimulatedMistake | None:
        mistake = self.profile.mistakes.get(inv.node)
        if mistake is None:
            return None
        if mistake.attempts is not None and inv.attempt not in mistake.attempts:
            return None
        if mistake.unless_feedback and self._feedback_names(inv, mistake):
            return None
        return mistake

    @staticmethod
    def _feedback_names(inv: Invocation, mistake: SimulatedMistake) -> bool:
        """True when the prompt's prior-failure block names this very mistake: an agent
        cannot fix what the feedback does not tell it."""
        # The runtime writes the open tag, a newline, then the JSON object; the boundary
        # rules merely mention the tag.
        start = inv.prompt.find(PRIOR_FAILURE_OPEN + "\n{")
        end = inv.prompt.find(PRIOR_FAILURE_CLOSE, start + 1)
        if start < 0 or end < 0:
            return False
        block = inv.prompt[start:end]
        first = inv.artifacts[0].path if inv.artifacts else ""
        evidence = {
            "wrong_name": f"{first}: required artifact missing",
            "exit_nonzero": "agent_exit",
            "invalid_json": "invalid JSON",
            "report_error": "contradictory_completion",
            "hang": "agent_timeout",
        }[mistake.kind]
        return evidence in block

    def run(self, inv: Invocation) -> AgentExit:
        mistake = self._mistake(inv)
        kind = mistake.kind if mistake else None
        if kind == "hang":
            cancelled = inv.cancel.wait(inv.timeout_s)
            return AgentExit(cancelled=cancelled, timed_out=not cancelled)
        if kind == "exit_nonzero":
            inv.stderr.write(f"simulated agent: analysis of {inv.node} crashed: "
                             "tool exited with status 1\n")
            return AgentExit(exit_code=1)
        digest = blake3_hex(inv.prompt.encode())[:16]
        for i, spec in enumerate(inv.artifacts):
            name = spec.path
            if kind == "wrong_name" and i == 0:
                name = str(Path(spec.path).with_name("draft-" + Path(spec.path).name))
            self._write(inv, spec, name, digest, broken=(kind == "invalid_json"))
        inv.stdout.write(f"simulated agent: {inv.node} attempt {inv.attempt} wrote "
                         f"{len(inv.artifacts)} artifact(s)\n")
        if kind == "report_error":
            return AgentExit(exit_code=0, reported_error=f"simulated agent reports it could "
                             f"not complete {inv.node}")
        return AgentExit(exit_code=0)

    @staticmethod
    def _write(inv: Invocation, spec: ArtifactSpec, name: str, digest: str, *,
               broken: bool) -> None:
        path = inv.workspace / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if spec.kind == "json":
            text = json.dumps(example_for(spec.json_schema), indent=2)
            path.write_text(text[: len(text) // 2] if broken else text + "\n")
        else:
            path.write_text(f"# {inv.node}\n\nSimulated output for node `{inv.node}` "
                            f"(prompt {digest}).\n")
