"""Python agents for tests: each is a ``python`` profile target ``tests.agent_scripts:NAME``."""

from __future__ import annotations

import json
import os
import time

from runtime.agents.base import AgentExit, Invocation
from runtime.agents.simulated import example_for


def write_all(inv: Invocation) -> int:
    for spec in inv.artifacts:
        path = inv.workspace / spec.path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(example_for(spec.json_schema)) if spec.kind == "json"
                        else f"{inv.node}\n")
    return 0


def fail_first(inv: Invocation) -> int:
    if inv.attempt == 1:
        inv.stderr.write(f"boom in {inv.node}: deterministic failure\n")
        return 3
    return write_all(inv)


def always_exit_2(inv: Invocation) -> int:
    inv.stderr.write("fatal: could not parse contract\n")
    return 2


def nothing(inv: Invocation) -> int:
    return 0


def report_error(inv: Invocation) -> AgentExit:
    write_all(inv)
    return AgentExit(exit_code=0, reported_error="agent says: gave up")


def leak_secret(inv: Invocation) -> int:
    inv.stderr.write("connecting with token=ghp_" + "a1B2" * 9 + " and AWS AKIAABCDEFGHIJKLMNOP\n")
    inv.stderr.write("env SECRET_VALUE=" + os.environ.get("TEST_API_KEY", "") + "\n")
    return 1


def slow(inv: Invocation) -> int:
    inv.cancel.wait(0.5)
    return write_all(inv)


def raises(inv: Invocation) -> int:
    raise RuntimeError("agent bug")


def record_inputs(inv: Invocation) -> int:
    write_all(inv)
    found = sorted(str(p.relative_to(inv.workspace)) for p in (inv.workspace / "inputs").rglob("*")
                   if p.is_file()) if (inv.workspace / "inputs").exists() else []
    (inv.workspace / "seen.txt").write_text("\n".join(found))
    (inv.workspace / "ts.txt").write_text(f"{time.monotonic()}")
    return 0


HOSTILE_MARKUP = '<script>alert(1)</script><img src="http://evil.example/x.png">'


def markup_finding(inv: Invocation) -> int:
    """A valid SARIF log whose finding message is markup: reports must keep it text."""
    log = {"version": "2.1.0", "runs": [{
        "tool": {"driver": {"name": "hostile", "rules": [{"id": "X1"}]}},
        "results": [{"ruleId": "X1", "level": "error", "message": {"text": HOSTILE_MARKUP},
                     "locations": [{"physicalLocation": {
                         "artifactLocation": {"uri": "src/app.py"},
                         "region": {"startLine": 3}}}]}]}]}
    for spec in inv.artifacts:
        (inv.workspace / spec.path).write_text(json.dumps(log))
    return 0
