"""``simulated`` agent: deterministic and offline, for demos and tests.

It writes every artifact the node declares (JSON that satisfies the declared schema,
Markdown otherwise), with content derived from the prompt it received. A profile can
script a mistake per node (``mistakes``): write the first artifact under a wrong name,
exit non-zero, write invalid JSON, write SARIF the SARIF 2.1.0 schema refuses, report an
error with exit 0, or hang past the timeout. A ``sarif`` artifact gets a small valid
SARIF 2.1.0 log with one finding, so a demo shows findings end to end. With
``unless_feedback`` the mistake is not made when the prompt's retry
preamble names it: the model of an agent that reads why its last attempt failed, and
repeats its mistake when nobody tells it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runtime.agents.base import AgentExit, Invocation
from runtime.digest import blake3_hex
from runtime.plan.profiles import SimulatedMistake, SimulatedProfile
from runtime.plan.topology import ArtifactSpec
from runtime.prompt.assemble import PRIOR_FAILURE_CLOSE, PRIOR_FAILURE_OPEN


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


SIMULATED_LEVELS = ("warning", "error", "note")
SARIF_SCHEMA_URI = ("https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/"
                    "sarif-schema-2.1.0.json")


def sarif_example(node: str, *, bad: bool = False) -> dict[str, Any]:
    """One deterministic finding for ``node`` as a SARIF 2.1.0 log.

    ``bad`` makes the mistake language models make most with SARIF: a ``severity`` the
    format does not have, and a level outside its four. It parses; the schema refuses it.
    """
    # The level depends on the node only, so a batch shows more than one level and two
    # runs of the same plan produce the same findings.
    level = SIMULATED_LEVELS[int(blake3_hex(node.encode())[:8], 16) % len(SIMULATED_LEVELS)]
    rule = f"SIM-{node.upper()}"
    result: dict[str, Any] = {
        "ruleId": rule,
        "level": level,
        "message": {"text": f"Simulated finding from node {node}: demonstration output, "
                            "not a real vulnerability."},
        "locations": [{"physicalLocation": {
            "artifactLocation": {"uri": f"src/{node}.py"},
            "region": {"startLine": 1 + len(node), "startColumn": 1}}}],
    }
    if bad:
        result["level"] = "critical"
        result["severity"] = "high"
    return {
        "$schema": SARIF_SCHEMA_URI,
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {
                "name": "simulated-agent", "version": "1",
                "rules": [{"id": rule, "name": f"Simulated{node.title().replace('-', '')}",
                           "shortDescription": {"text": f"Simulated check of {node}"}}]}},
            "results": [result],
        }],
    }


class SimulatedAgent:
    """The deterministic ``simulated`` agent, for tests and demos without a real provider.

    It writes the node's declared artifacts, or makes the profile's scripted mistake (a
    missing artifact, a crash, a hang) on the attempts the profile names.

    Args:
        profile: the profile scripting which attempts fail, and how.
    """
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
        """True when the prompt's prior-failure block names this very mistake.

        An agent cannot fix what the feedback does not tell it.
        """
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
            "invalid_sarif": "not valid SARIF 2.1.0",
            "report_error": "contradictory_completion",
            "hang": "agent_timeout",
        }[mistake.kind]
        return evidence in block

    def run(self, inv: Invocation) -> AgentExit:
        """Play this attempt: write the artifacts, or make the scripted mistake."""
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
            self._write(inv, spec, name, digest, broken=(kind == "invalid_json"),
                        bad_sarif=(kind == "invalid_sarif"))
        inv.stdout.write(f"simulated agent: {inv.node} attempt {inv.attempt} wrote "
                         f"{len(inv.artifacts)} artifact(s)\n")
        if kind == "report_error":
            return AgentExit(exit_code=0, reported_error=f"simulated agent reports it could "
                             f"not complete {inv.node}")
        return AgentExit(exit_code=0)

    @staticmethod
    # PLR0913: Test-agent helper: the two mistake switches are keyword-only flags.
    def _write(inv: Invocation, spec: ArtifactSpec, name: str, digest: str, *,  # noqa: PLR0913
               broken: bool, bad_sarif: bool = False) -> None:
        path = inv.workspace / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if spec.kind == "sarif":
            text = json.dumps(sarif_example(inv.node, bad=bad_sarif), indent=2)
            path.write_text(text[: len(text) // 2] if broken else text + "\n")
        elif spec.kind == "json":
            text = json.dumps(example_for(spec.json_schema), indent=2)
            path.write_text(text[: len(text) // 2] if broken else text + "\n")
        else:
            path.write_text(f"# {inv.node}\n\nSimulated output for node `{inv.node}` "
                            f"(prompt {digest}).\n")
