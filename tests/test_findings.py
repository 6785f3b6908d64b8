"""SARIF: the artifact kind, the retry preamble it feeds, merging and the `findings` verb."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft4Validator

from runtime.agents.simulated import sarif_example
from runtime.batch import BatchOptions, run_batch
from runtime.cli import main
from runtime.plan.compile import plan_topology
from runtime.plan.topology import ArtifactSpec
from runtime.prompt.redact import Redactor
from runtime.report.findings import (
    FINGERPRINT_KEY,
    Findings,
    Source,
    _node_run,
    collect,
    run_findings,
)
from runtime.run.contract import check_artifact, sarif_errors, sarif_schema
from runtime.run.summary import BatchSummary
from tests.conftest import REPO, Project, make_topology, run_topology

OASIS_ID = ("https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/"
            "sarif-schema-2.1.0.json")


def _assert_official_sarif(log: Any) -> None:
    """Validated with jsonschema directly against the official schema, not our wrapper."""
    errors = list(Draft4Validator(sarif_schema()).iter_errors(log))
    assert not errors, [e.message for e in errors[:3]]


def test_the_schema_is_the_official_oasis_one() -> None:
    schema = sarif_schema()
    assert schema["id"] == OASIS_ID
    assert schema["$schema"] == "http://json-schema.org/draft-04/schema#"
    assert schema["properties"]["version"]["enum"] == ["2.1.0"]
    Draft4Validator.check_schema(schema)


def _sarif_spec(**kw: Any) -> ArtifactSpec:
    return ArtifactSpec.model_validate({"path": "f.sarif", "kind": "sarif", **kw})


def _too_many_errors() -> dict[str, Any]:
    log = sarif_example("n")
    log["runs"][0]["results"] = [{"level": "critical"}] * 2
    return log


SARIF_CASES: list[tuple[str, Any, str | None]] = [
    ("valid", sarif_example("n"), None),
    ("empty runs", {"version": "2.1.0", "runs": []}, None),
    ("severity and level", sarif_example("n", bad=True),
     "f.sarif: not valid SARIF 2.1.0 (2 schema errors): at /runs/0/results/0: Additional "
     "properties are not allowed ('severity' was unexpected) (schema "
     "#/definitions/result/additionalProperties); at /runs/0/results/0/level: 'critical' is "
     "not one of ['none', 'note', 'warning', 'error'] (schema "
     "#/definitions/result/properties/level/enum)"),
    ("no driver", {"version": "2.1.0", "runs": [{"tool": {}}]},
     "f.sarif: not valid SARIF 2.1.0 (1 schema error): at /runs/0/tool: 'driver' is a "
     "required property (schema #/definitions/tool/required)"),
    ("wrong version", {"version": "2.1", "runs": []},
     "f.sarif: not valid SARIF 2.1.0 (1 schema error): at /version: '2.1' is not one of "
     "['2.1.0'] (schema #/properties/version/enum)"),
    ("not an object", [], "f.sarif: not valid SARIF 2.1.0 (1 schema error): at /: [] is not "
     "of type 'object' (schema #/type)"),
    ("more than three", _too_many_errors(), "; and 1 more"),
]


@pytest.mark.parametrize(("label", "log", "expected"), SARIF_CASES,
                         ids=[c[0] for c in SARIF_CASES])
def test_sarif_artifact_check(tmp_path: Path, label: str, log: Any, expected: str | None,
                              ) -> None:
    (tmp_path / "f.sarif").write_text(json.dumps(log))
    problem = check_artifact(tmp_path, _sarif_spec())
    if expected is None:
        assert problem is None
    else:
        assert problem is not None
        assert expected in problem, problem


def test_sarif_that_is_not_json_names_the_position(tmp_path: Path) -> None:
    (tmp_path / "f.sarif").write_text('{"version": ')
    assert check_artifact(tmp_path, _sarif_spec()) == \
        "f.sarif: invalid JSON at line 1 column 13: Expecting value"


def test_simulated_sarif_is_valid_and_its_mistake_is_not() -> None:
    _assert_official_sarif(sarif_example("authz"))
    assert sarif_errors(sarif_example("authz", bad=True))


# -- the retry preamble names what to fix -----------------------------------------------

def _sarif_topology(*, feedback: bool) -> dict[str, Any]:
    topo = make_topology({"scan": [], "report": ["scan"]}, name="sarif-demo",
                         scan={"retry_feedback": feedback, "max_attempts": 2})
    topo["nodes"][0]["artifacts"].append({"path": "scan.sarif", "kind": "sarif"})
    topo["agents"]["sim"] = {"kind": "simulated", "mistakes": {
        "scan": {"kind": "invalid_sarif", "unless_feedback": True}}}
    return topo


def test_schema_failure_reaches_the_retry_preamble_and_is_fixed(project: Project) -> None:
    result = run_topology(project, _sarif_topology(feedback=True))
    assert result.status == "succeeded"
    scan = result.state.nodes["scan"]
    assert [a.outcome for a in scan.attempts] == ["artifact_contract", "succeeded"]
    assert scan.attempts[0].summary.startswith("scan.sarif: not valid SARIF 2.1.0")
    prompt = (Path(result.run_dir) / "nodes/scan/attempts/2/prompt.md").read_text()
    block = prompt[prompt.index("<prior-failure-v1>\n{"):]
    # The schema paths of the first errors, JSON-encoded inside the untrusted block.
    assert "at /runs/0/results/0/level" in block
    assert "(schema #/definitions/result/properties/level/enum)" in block
    assert "#/definitions/result/additionalProperties" in block
    found = run_findings(Path(result.run_dir))
    assert [(f.node, f.attempt) for f in found.findings] == [("scan", 2)]


def test_without_feedback_the_same_schema_failure_repeats(project: Project) -> None:
    result = run_topology(project, _sarif_topology(feedback=False))
    scan = result.state.nodes["scan"]
    assert result.status == "failed"
    assert scan.status == "failed"
    assert [a.outcome for a in scan.attempts] == ["artifact_contract"] * 2
    assert result.state.nodes["report"].status == "skipped"
    assert run_findings(Path(result.run_dir)).findings == []


# -- merging across a batch -------------------------------------------------------------

@pytest.fixture
def sarif_batch(project: Project) -> Project:
    folder = project.root / "topologies"
    folder.mkdir()
    for name, mistake in (("alpha", None), ("beta", "invalid_sarif")):
        topo = make_topology({"recon": [], "scan": ["recon"], "review": ["recon"]}, name=name,
                             scan={"retry_feedback": True})
        for node in topo["nodes"][1:]:
            node["artifacts"].append({"path": f"{node['id']}.sarif", "kind": "sarif"})
        if mistake:
            topo["agents"]["sim"]["mistakes"] = {"scan": {"kind": mistake,
                                                          "unless_feedback": True}}
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(topo, sort_keys=False))
    return project


def _batch(project: Project, batch_id: str) -> BatchSummary:
    return run_batch([project.root / "topologies"], BatchOptions(
        prompts=project.prompts, artifacts=project.artifacts, batch_id=batch_id,
        redactor=Redactor()))


def _results(path: Path) -> list[dict[str, Any]]:
    log = json.loads(path.read_text())
    _assert_official_sarif(log)
    return [r for run in log["runs"] for r in run["results"]]


def test_batch_writes_findings_sarif_and_counts(sarif_batch: Project) -> None:
    summary = _batch(sarif_batch, "b1")
    batch_dir = sarif_batch.artifacts / "batches" / "b1"
    log = json.loads((batch_dir / "findings.sarif").read_text())
    _assert_official_sarif(log)
    assert [r["automationDetails"]["id"] for r in log["runs"]] == [
        "alpha/review/", "alpha/scan/", "beta/review/", "beta/scan/"]
    results = _results(batch_dir / "findings.sarif")
    assert len(results) == 4
    prov = results[-1]["properties"]["dagRuntime"]
    assert prov["topology"] == "beta"
    assert prov["node"] == "scan"
    assert prov["attempt"] == 2
    assert prov["profile"] == "sim"
    assert prov["runId"] == "b1-beta"
    assert prov["artifact"] == "scan.sarif"
    assert len(prov["artifactDigest"]) == 64
    assert prov["planDigest"] == summary.entries[1].plan_digest
    assert len(prov["promptDigest"]) == 64
    on_disk = json.loads((batch_dir / "summary.json").read_text())
    assert on_disk["findings"] == summary.findings
    assert sum(summary.findings.values()) == 4
    assert set(summary.findings) == {
        "error", "warning", "note", "none"}
    assert sum(summary.entries[0].findings.values()) == 2
    assert on_disk["findings_file"].endswith("findings.sarif")


def test_fingerprints_are_stable_across_batches(sarif_batch: Project) -> None:
    _batch(sarif_batch, "first")
    _batch(sarif_batch, "second")

    def prints(batch: str) -> list[str]:
        path = sarif_batch.artifacts / "batches" / batch / "findings.sarif"
        return [r["partialFingerprints"][FINGERPRINT_KEY] for r in _results(path)]

    first, second = prints("first"), prints("second")
    assert first == second
    assert len(set(first)) == len(first) == 4


def _source(node: str = "n") -> Source:
    return Source(topology="t", node=node, attempt=1, profile="p", run_id="r",
                  plan_digest="0" * 64, prompt_digest="1" * 64, artifact="a.sarif",
                  artifact_digest="2" * 64)


def test_fingerprint_ignores_wording_but_not_location() -> None:
    base = sarif_example("n")
    reworded = copy.deepcopy(base)
    reworded["runs"][0]["results"][0]["message"]["text"] = "Same issue, other words."
    moved = copy.deepcopy(base)
    moved["runs"][0]["results"][0]["locations"][0]["physicalLocation"]["region"][
        "startLine"] = 99

    def fp(log: dict[str, Any]) -> str:
        run, _ = _node_run("t", "n", [(log["runs"][0], _source())])
        return str(run["results"][0]["partialFingerprints"][FINGERPRINT_KEY])

    assert fp(base) == fp(reworded) != fp(moved)


def test_run_level_data_survives_the_merge() -> None:
    """A new user's trial: tool extensions (where CodeQL keeps its rules),
    originalUriBaseIds and versionControlProvenance were dropped, leaving results that
    pointed at nothing, and an extension rule's default level was lost."""
    def run(rule: str, base: str) -> dict[str, Any]:
        return {"tool": {"driver": {"name": "codeql"}, "extensions": [
                    {"name": f"pack-{rule}", "rules": [
                        {"id": rule, "defaultConfiguration": {"level": "note"}}]}]},
                "originalUriBaseIds": {"SRC": {"uri": f"file:///{base}/"}},
                "versionControlProvenance": [{"repositoryUri": "https://example.com/r"}],
                "artifacts": [{"location": {"uri": f"{rule}.py", "uriBaseId": "SRC"}}],
                "results": [{"message": {"text": rule}, "rule": {
                    "id": rule, "index": 0, "toolComponent": {"index": 0}},
                    "locations": [{"physicalLocation": {"artifactLocation": {
                        "index": 0}, "region": {"startLine": 3}}}]}]}

    out, findings = _node_run("t", "n", [(run("A", "one"), _source()),
                                         (run("B", "two"), _source())])
    _assert_official_sarif({"version": "2.1.0", "runs": [out]})
    assert [e["name"] for e in out["tool"]["extensions"]] == ["pack-A", "pack-B"]
    assert [r["rule"]["toolComponent"]["index"] for r in out["results"]] == [0, 1]
    assert out["originalUriBaseIds"] == {"SRC": {"uri": "file:///one/"}}  # first wins
    assert out["versionControlProvenance"] == [{"repositoryUri": "https://example.com/r"}]
    assert [f.level for f in findings] == ["note", "note"]  # the extension rule's default
    assert [f.location for f in findings] == ["A.py:3", "B.py:3"]  # by artifact index


def test_two_input_runs_merge_into_one_run_with_indexes_remapped() -> None:
    def run(rule: str, uri: str) -> dict[str, Any]:
        return {"tool": {"driver": {"name": "scanner", "rules": [
                    {"id": "COMMON"}, {"id": rule, "defaultConfiguration": {"level": "error"}}]}},
                "artifacts": [{"location": {"uri": uri}}],
                "results": [{"ruleIndex": 1, "message": {"text": rule},
                             "locations": [{"physicalLocation": {"artifactLocation": {
                                 "index": 0}}}]}]}

    out, findings = _node_run("t", "n", [(run("A", "a.py"), _source()),
                                         (run("B", "b.py"), _source())])
    _assert_official_sarif({"version": "2.1.0", "runs": [out]})
    rules = out["tool"]["driver"]["rules"]
    assert [r["id"] for r in rules] == ["COMMON", "A", "B"]  # COMMON shared
    assert [r["ruleIndex"] for r in out["results"]] == [1, 2]
    assert [r["ruleId"] for r in out["results"]] == ["A", "B"]
    locs = [r["locations"][0]["physicalLocation"]["artifactLocation"]["index"]
            for r in out["results"]]
    assert locs == [0, 1]
    assert [f.level for f in findings] == ["error", "error"]  # from the rule's default


def test_an_artifact_changed_after_acceptance_is_reported_not_merged(
        project: Project) -> None:
    result = run_topology(project, _sarif_topology(feedback=True))
    sarif = Path(result.run_dir) / "nodes/scan/workspace/scan.sarif"
    sarif.chmod(0o644)
    sarif.write_text(json.dumps({"version": "2.1.0", "runs": [{"tool": {}}]}))
    found = run_findings(Path(result.run_dir))
    assert found.findings == []
    assert len(found.problems) == 1
    assert found.problems[0].startswith("test-run/scan: scan.sarif: changed after it was "
                                        "accepted (blake3 ")
    # The node's run is left out whole (a new user's trial: an empty run for its category
    # would have closed that node's open alerts in code scanning).
    assert found.runs == []
    _assert_official_sarif(found.log())


def test_a_valid_sarif_swapped_in_after_acceptance_is_not_merged(project: Project) -> None:
    """Schema-valid is not enough: the bytes must be those node.succeeded accepted."""
    result = run_topology(project, _sarif_topology(feedback=True))
    sarif = Path(result.run_dir) / "nodes/scan/workspace/scan.sarif"
    log = json.loads(sarif.read_text())
    log["runs"][0]["results"][0]["message"]["text"] = "forged: all clear"
    sarif.chmod(0o644)
    sarif.write_text(json.dumps(log))
    found = run_findings(Path(result.run_dir))
    assert found.findings == []
    assert "changed after it was accepted" in found.problems[0]


# -- the CLI verb -----------------------------------------------------------------------

def test_findings_verb_formats(sarif_batch: Project, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    _batch(sarif_batch, "b3")
    art = str(sarif_batch.artifacts)
    assert main(["findings", "b3", "--artifacts", art, "--format", "sarif"]) == 0
    _assert_official_sarif(json.loads(capsys.readouterr().out))
    assert main(["findings", "b3-alpha", "--artifacts", art, "--format", "json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert {f["node"] for f in obj["findings"]} == {"scan", "review"}
    assert sum(obj["counts"].values()) == 2
    assert obj["problems"] == []
    assert main(["findings", "b3", "--artifacts", art]) == 0
    table = capsys.readouterr().out
    for header in ("level", "rule", "location", "message", "node"):
        assert header in table
    assert "SIM-SCAN" in table
    assert "beta/scan" in table
    out = tmp_path / "out" / "f.sarif"
    assert main(["findings", "b3", "--artifacts", art, "--format", "sarif", "-o",
                 str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["output"] == str(out)
    _assert_official_sarif(json.loads(out.read_text()))
    batch_dir = sarif_batch.artifacts / "batches" / "b3"
    assert collect(str(batch_dir), sarif_batch.artifacts).counts() == \
        json.loads((batch_dir / "summary.json").read_text())["findings"]


def test_findings_verb_unknown_target(project: Project,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["findings", "nope", "--artifacts", str(project.artifacts)]) == 2
    assert ("nope: not a run directory (no ledger.jsonl), not a batch directory (no "
            "summary.json), and no run or batch with that id under") in capsys.readouterr().err


def test_findings_text_is_inert_in_the_table() -> None:
    log = sarif_example("n")
    log["runs"][0]["results"][0]["message"]["text"] = "[bold red]x[/] \x1b[31mred\x1b[0m"
    run, findings = _node_run("t", "n", [(log["runs"][0], _source())])
    from runtime.report.findings import table_text

    text = table_text(Findings(runs=[run], findings=findings))
    assert "[bold red]x[/] red" in text
    assert "\x1b" not in text


# -- the shipped topologies produce findings end to end ---------------------------------

SHIPPED = sorted((REPO / "topologies").glob("*.yaml"))


@pytest.mark.parametrize("topology", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_each_shipped_topology_declares_sarif_and_asks_for_it(topology: Path) -> None:
    plan = plan_topology(topology, REPO / "prompts")
    sarif_nodes = [nid for nid, n in plan.manifest.nodes.items()
                   if any(a.kind == "sarif" for a in n.artifacts)]
    assert sarif_nodes, topology.name
    for nid in sarif_nodes:
        prompt = plan.prompts[plan.manifest.nodes[nid].prompt_digest].decode()
        assert "## Findings as SARIF 2.1.0" in prompt, nid
        assert "ruleId" in prompt, nid


def test_main_job_shows_findings_end_to_end(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    art = tmp_path / "artifacts"
    code = main(["batch", str(REPO / "topologies"), "--agent", "demo", "--batch-id", "main",
                 "--prompts", str(REPO / "prompts"), "--artifacts", str(art),
                 "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "findings: 2 error, 2 warning, 1 note in" in out
    batch_dir = art / "batches" / "main"
    results = _results(batch_dir / "findings.sarif")
    assert {r["properties"]["dagRuntime"]["topology"] for r in results} == {
        p.stem for p in SHIPPED}
    summary = BatchSummary.model_validate_json((batch_dir / "summary.json").read_bytes())
    supply = next(e for e in summary.entries if e.topology == "supply-chain-review")
    assert "ci-hardening" in supply.retries_after_feedback  # invalid SARIF, then corrected
    assert summary.findings == {"error": 2, "warning": 2, "note": 1, "none": 0}
    report = (batch_dir / "report.html").read_text()
    assert report.count('class="finding"') == 5


def test_findings_verb_exits_1_on_a_changed_artifact(project: Project,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    result = run_topology(project, _sarif_topology(feedback=True))
    sarif = Path(result.run_dir) / "nodes/scan/workspace/scan.sarif"
    sarif.chmod(0o644)
    sarif.write_text("{}")
    assert main(["findings", str(result.run_dir), "--format", "sarif"]) == 1
    captured = capsys.readouterr()
    _assert_official_sarif(json.loads(captured.out))
    assert "problem: test-run/scan: scan.sarif: changed after it was accepted" in captured.err


def test_run_prints_its_findings(project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    project.write_topology(_sarif_topology(feedback=True))
    assert main(project.cli("run", str(project.topology), "--run-id", "r1")) == 0
    out = capsys.readouterr().out
    level = sarif_example("scan")["runs"][0]["results"][0]["level"]
    assert f"findings: 1 {level} (runtime findings r1)" in out
    assert main(project.cli("run", str(project.topology), "--run-id", "r2", "--json")) == 0
    assert json.loads(capsys.readouterr().out)["findings"][level] == 1
