"""The retry preamble contract (DESIGN section 6; issue: the retry-replay incident)."""

from __future__ import annotations

import json
import re
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.digest import blake3_hex, file_blake3
from runtime.failures import FailureClass, NodeStatus, Outcome, RunStatus
from runtime.plan.compile import plan_topology
from runtime.prompt.assemble import PRIOR_FAILURE_CLOSE, PRIOR_FAILURE_OPEN, SECTION_SEPARATOR
from runtime.prompt.feedback import PriorFailure, encode_block, fingerprint, render_preamble
from runtime.prompt.redact import Redactor
from runtime.run.start import RunResult, start_run
from tests.conftest import REPO, Project

INCIDENT = REPO / "topologies" / "incident-replay.yaml"


def _failure(error: str, attempt: int = 1, unsatisfied: list[str] | None = None,
             cls: FailureClass = FailureClass.AGENT_EXIT) -> PriorFailure:
    return PriorFailure(attempt=attempt, failure_class=cls, exit_code=1,
                        unsatisfied=unsatisfied or [], error=error,
                        fingerprint=fingerprint(cls, error))


def _block_json(preamble: str) -> dict[str, Any]:
    body = preamble.split(PRIOR_FAILURE_OPEN + "\n", 1)[1].rsplit("\n" + PRIOR_FAILURE_CLOSE, 1)
    data: dict[str, Any] = json.loads(body[0])
    return data


def _run_incident(tmp_path: Path, feedback: bool) -> tuple[RunResult, Path]:
    from runtime.plan.compile import write_plan
    from runtime.run.policy import NodeOverrides
    from runtime.run.records import RunSettings

    plan_dir = write_plan(plan_topology(INCIDENT, REPO / "prompts"), tmp_path / "artifacts")
    overrides = {} if feedback else {"durable-handler": NodeOverrides(retry_feedback=False)}
    result = start_run(plan_dir, tmp_path / "artifacts", RunSettings(overrides=overrides),
                       run_id="incident", redactor=Redactor())
    return result, plan_dir


# (a) a deterministic failure on attempt 1 is named to attempt 2; (5) the incident
def test_incident_succeeds_on_attempt_2_with_feedback(tmp_path: Path) -> None:
    result, _ = _run_incident(tmp_path, feedback=True)
    assert result.status is RunStatus.SUCCEEDED
    node = result.state.nodes["durable-handler"]
    assert [a.outcome for a in node.attempts] == [FailureClass.ARTIFACT_CONTRACT, "succeeded"]
    prompt2 = (result.run_dir / "nodes/durable-handler/attempts/2/prompt.md").read_text()
    failures = _block_json(prompt2)["failures"]
    assert isinstance(failures, list)
    assert failures[0]["failure_class"] == "artifact_contract"
    assert "handler.md: required artifact missing; the workspace has: draft-handler.md" in \
        failures[0]["error"]
    assert "# Retry: attempt 2 of 4" in prompt2


def test_incident_without_feedback_burns_the_budget_and_skips_descendants(
        tmp_path: Path) -> None:
    result, _ = _run_incident(tmp_path, feedback=False)
    assert result.status is RunStatus.FAILED
    node = result.state.nodes["durable-handler"]
    assert [a.outcome for a in node.attempts] == [Outcome.ARTIFACT_CONTRACT] * 4
    skipped = [n for n, s in result.state.nodes.items() if s.status is NodeStatus.SKIPPED]
    assert len(skipped) == 8
    # the override is recorded in the ledger
    first = json.loads((result.run_dir / "ledger.jsonl").read_text().splitlines()[0])
    assert first["settings"]["overrides"] == {"durable-handler": {"retry_feedback": False}}
    # replay semantics: every attempt's prompt is byte-identical to attempt 1's
    prompts = {(result.run_dir / f"nodes/durable-handler/attempts/{n}/prompt.md").read_bytes()
               for n in range(1, 5)}
    assert len(prompts) == 1


# (c) plan prompt file and plan digest unchanged by any number of retries;
# (d) attempt 2's prompt is attempt 1's with exactly the preamble inserted
def test_retries_change_no_plan_digest_and_insert_only_the_preamble(tmp_path: Path) -> None:
    before = plan_topology(INCIDENT, REPO / "prompts")
    result, plan_dir = _run_incident(tmp_path, feedback=True)
    assert blake3_hex((plan_dir / "plan.json").read_bytes()) == before.digest
    node_dir = result.run_dir / "nodes" / "durable-handler"
    digest = before.manifest.nodes["durable-handler"].prompt_digest
    assert file_blake3(node_dir / "prompt.rendered.md") == digest
    assert file_blake3(plan_dir / "prompts" / f"{digest}.md") == digest
    p1 = (node_dir / "attempts/1/prompt.md").read_text()
    p2 = (node_dir / "attempts/2/prompt.md").read_text()
    ctx2 = json.loads((node_dir / "attempts/2/attempt.json").read_text())
    plan_prompt = (node_dir / "prompt.rendered.md").read_text()
    head = p1[: len(p1) - len(plan_prompt)]
    assert p1 == head + plan_prompt
    preamble = p2[len(head): len(p2) - len(plan_prompt) - len(SECTION_SEPARATOR)]
    assert p2 == head + preamble + SECTION_SEPARATOR + plan_prompt
    assert blake3_hex(preamble.encode()) == ctx2["preamble_digest"]
    assert ctx2["prior_failures"][0]["attempt"] == 1


# (b) inside the boundary, bounded
@pytest.mark.parametrize("bound", [1024, 8192, 32768])
def test_preamble_is_bounded_after_encoding(bound: int) -> None:
    huge = "<>&" * 50_000 + "é" * 10_000
    failures = [_failure(huge + str(i), attempt=i) for i in (3, 2, 1)]
    text = render_preamble(4, 4, failures, bound)
    assert len(text.encode()) <= bound
    assert text.count(PRIOR_FAILURE_CLOSE) == 1
    assert text.count(PRIOR_FAILURE_OPEN) == 1
    assert "characters dropped" in json.dumps(_block_json(text))


def test_distinct_failures_newest_first() -> None:
    failures = [_failure("second error", 2), _failure("first error", 1)]
    data = _block_json(render_preamble(3, 4, failures, 8192))
    assert [f["attempt"] for f in data["failures"]] == [2, 1]


def test_fingerprint_ignores_numbers_and_hex() -> None:
    a = fingerprint(FailureClass.AGENT_EXIT, "timeout after 31.2 s at 0x7ffde3a1 (pid 4411)")
    b = fingerprint(FailureClass.AGENT_EXIT, "timeout after 30.9 s at 0x7ffd0001 (pid 512)")
    c = fingerprint(FailureClass.AGENT_TIMEOUT, "timeout after 30.9 s at 0x7ffd0001 (pid 512)")
    assert a == b != c


def test_same_failure_despite_feedback_stops_early(tmp_path: Path) -> None:
    project = Project(tmp_path / "proj")
    project.root.mkdir()
    project.template("task.md.j2", "Task.\n")
    from tests.conftest import make_topology, python_agents, run_topology

    topo = make_topology({"a": [], "b": ["a"]}, a={"retry_feedback": True, "max_attempts": 5})
    topo["agents"] = python_agents("always_exit_2", "write_all")
    topo["defaults"] = {"agent": "write_all"}
    topo["nodes"][0]["agent"] = "always_exit_2"
    node = run_topology(project, topo).state.nodes["a"]
    assert len(node.attempts) == 2
    assert "the same failure repeated despite retry feedback" in (node.reason or "")


# (e) properties over arbitrary failure text
CLOSE_RE = re.compile(r"<\s*/\s*prior-failure-v1\s*>", re.IGNORECASE)


@settings(max_examples=300, deadline=None)
@given(error=st.text(max_size=3000), extra=st.lists(st.text(max_size=200), max_size=3),
       bound=st.integers(min_value=1024, max_value=32768))
def test_block_properties(error: str, extra: list[str], bound: int) -> None:
    redactor = Redactor()
    clean = redactor.clean(error, 4096)
    failure = _failure(clean, unsatisfied=[redactor.clean(u, 1024) for u in extra])
    text = render_preamble(2, 3, [failure], bound)
    assert len(text.encode()) <= bound
    block = text.split(PRIOR_FAILURE_OPEN + "\n", 1)[1]
    assert len(CLOSE_RE.findall(block)) == 1
    assert block.endswith(PRIOR_FAILURE_CLOSE)
    body = block[: -len(PRIOR_FAILURE_CLOSE) - 1]
    assert all(32 <= ord(ch) < 127 for ch in body), "block must be printable ASCII"
    assert "<" not in body
    assert ">" not in body
    assert "&" not in body
    assert unicodedata.normalize("NFKC", body) == body
    decoded = json.loads(body)["failures"][0]
    if len(text.encode()) < bound - 200 and "characters dropped" not in decoded["error"]:
        assert decoded["error"] == clean  # the JSON decodes to the redacted bounded text


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=500))
def test_encoding_is_ascii_and_round_trips(value: str) -> None:
    encoded = encode_block({"error": value})
    assert encoded.isascii()
    assert not set(encoded) & set("<>&\x7f")
    assert all(ch.isprintable() for ch in encoded)
    assert json.loads(encoded) == {"error": value}
