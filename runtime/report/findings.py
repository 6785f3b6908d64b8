"""Findings: every accepted SARIF artifact of a run or a batch, merged into one SARIF log.

One SARIF ``run`` per node that declared a ``sarif`` artifact, in DAG order, with
``automationDetails.id`` = ``<topology>/<node>/``. The trailing slash matters: code
scanning takes everything up to the last ``/`` as the analysis category and refuses two
runs of one tool with the same category in one upload; without it every node of a
topology would share the category ``<topology>/``. Each result keeps what the agent wrote
and gains provenance under ``properties.dagRuntime`` (topology, node, attempt, agent
profile, run id, plan digest, node prompt digest, artifact path and digest) and a
stable ``partialFingerprints["dagRuntime/v1"]`` so code scanning de-duplicates the same
finding across batches.

The fingerprint hashes what holds still between two analyses of the same code: the
topology, the node, the rule, the location's URI and its anchor (the snippet text when
the agent quoted one, else the start line), plus an index among results that share all
of that. It leaves out the message (a language model words the same finding differently
on every run), attempt numbers, run ids and digests.

Read side only: it reads run directories and never writes into them. Artifact files are
read without following a symlink out of the workspace and within the declared size; a
file that no longer passes the SARIF schema is reported as a tool notification in its
node's run rather than merged.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from runtime.digest import blake3_hex, canonical_json
from runtime.errors import UsageError
from runtime.failures import Outcome
from runtime.files import replace_atomically, within
from runtime.plan.manifest import Manifest
from runtime.plan.topology import ArtifactSpec
from runtime.prompt.redact import sanitize
from runtime.run.contract import sarif_errors
from runtime.run.read import load_run
from runtime.run.state import NodeState, RunState

SARIF_VERSION = "2.1.0"
SARIF_SCHEMA_URI = ("https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/"
                    "sarif-schema-2.1.0.json")
FINGERPRINT_KEY = "dagRuntime/v1"
PROVENANCE_KEY = "dagRuntime"
LEVELS: tuple[str, ...] = ("error", "warning", "note", "none")
Level = Literal["error", "warning", "note", "none"]
DRIVER = {"name": "dag-runtime", "informationUri": "https://pypi.org/project/dag-runtime/"}
MESSAGE_LIMIT = 300


class Finding(BaseModel):
    """One result, flattened for tables, JSON output and reports."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    level: Level
    rule: str
    location: str
    message: str
    topology: str
    node: str
    attempt: int
    profile: str
    run_id: str
    artifact: str
    fingerprint: str


@dataclass(frozen=True)
class Source:
    """Where a SARIF artifact came from: the node's accepted attempt."""

    topology: str
    node: str
    attempt: int
    profile: str
    run_id: str
    plan_digest: str
    prompt_digest: str
    artifact: str
    artifact_digest: str

    def provenance(self) -> dict[str, Any]:
        """The SARIF ``properties`` that trace a result to its run, node, attempt and artifact."""
        return {"topology": self.topology, "node": self.node, "attempt": self.attempt,
                "profile": self.profile, "runId": self.run_id, "planDigest": self.plan_digest,
                "promptDigest": self.prompt_digest, "artifact": self.artifact,
                "artifactDigest": self.artifact_digest}


@dataclass
class Findings:
    """A merged SARIF log and the same results flattened."""

    runs: list[dict[str, Any]] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def log(self) -> dict[str, Any]:
        """The merged SARIF 2.1.0 log."""
        return {"$schema": SARIF_SCHEMA_URI, "version": SARIF_VERSION, "runs": self.runs}

    def counts(self) -> dict[str, int]:
        """Findings per SARIF level."""
        return count_levels(self.findings)

    def extend(self, other: Findings) -> None:
        """Add ``other``'s runs, findings and problems to these."""
        self.runs += other.runs
        self.findings += other.findings
        self.problems += other.problems


def count_levels(findings: Iterable[Finding]) -> dict[str, int]:
    """Findings per SARIF level, every level present (zero when none)."""
    counts = dict.fromkeys(LEVELS, 0)
    for f in findings:
        counts[f.level] += 1
    return counts


# -- which runs ---------------------------------------------------------------------

def resolve_target(target: str, artifacts: Path) -> tuple[Literal["run", "batch"], Path]:
    """``RUN|BATCH_ID``: a run or batch directory, or an id under ``artifacts``."""
    path = Path(target)
    if (path / "ledger.jsonl").is_file():
        return "run", path
    if (path / "summary.json").is_file():
        return "batch", path
    run_dir, batch_dir = artifacts / "runs" / target, artifacts / "batches" / target
    is_run, is_batch = (run_dir / "ledger.jsonl").is_file(), (batch_dir / "summary.json"
                                                                ).is_file()
    if is_run and is_batch:
        raise UsageError(f"{target}: both a run ({run_dir}) and a batch ({batch_dir}); "
                         "give the directory instead of the id")
    if is_run:
        return "run", run_dir
    if is_batch:
        return "batch", batch_dir
    raise UsageError(f"{target}: not a run directory (no ledger.jsonl), not a batch directory "
                     f"(no summary.json), and no run or batch with that id under {artifacts}")


def batch_run_dirs(batch_dir: Path) -> list[Path]:
    """The run directories of a batch, in summary order.

    Located by run id under the batch's own artifacts root, so a batch moved with its
    artifacts still resolves.
    """
    try:
        summary = json.loads((batch_dir / "summary.json").read_bytes())
    except (OSError, ValueError) as exc:
        raise UsageError(f"{batch_dir / 'summary.json'}: cannot read the batch summary: "
                         f"{exc}") from None
    runs_root = batch_dir.parent.parent / "runs"
    out = []
    for entry in summary.get("entries", []):
        run_id = entry.get("run_id") if isinstance(entry, dict) else None
        if isinstance(run_id, str) and (runs_root / run_id / "ledger.jsonl").is_file():
            out.append(runs_root / run_id)
    return out


def collect(target: str, artifacts: Path) -> Findings:
    """Findings of a run or of every run of a batch."""
    kind, path = resolve_target(target, artifacts)
    if kind == "run":
        return run_findings(path)
    return merge(batch_run_dirs(path))


def merge(run_dirs: Iterable[Path]) -> Findings:
    """Merge the findings of several runs, in the given order."""
    out = Findings()
    for run_dir in run_dirs:
        out.extend(run_findings(run_dir))
    return out


# -- one run ------------------------------------------------------------------------

def dag_order(manifest: Manifest) -> list[str]:
    """Nodes in the order the scheduler considers them (deterministic topological)."""
    return manifest.dag().order()


def run_findings(run_dir: Path, loaded: tuple[Manifest, RunState] | None = None) -> Findings:
    """Every accepted SARIF artifact of one run: one SARIF run per declaring node.

    ``loaded``: the run's manifest and folded state when the caller has them already
    (the report does), so the ledger is not parsed again.
    """
    manifest, state = loaded if loaded is not None else load_run(run_dir)
    out = Findings()
    for nid in dag_order(manifest):
        specs = [a for a in manifest.nodes[nid].artifacts if a.kind == "sarif"]
        ns = state.nodes[nid]
        accepted = _accepted_attempt(ns)
        if not specs or accepted is None:
            continue
        attempt, profile = accepted
        inputs: list[tuple[dict[str, Any], Source]] = []
        notes: list[str] = []
        for spec in specs:
            log, source, problem = _read_artifact(
                run_dir, manifest, (state.run_id, state.plan_digest), nid, attempt, profile,
                spec, (ns.artifacts or {}).get(spec.path))
            if problem is not None:
                notes.append(problem)
                out.problems.append(f"{state.run_id}/{nid}: {problem}")
            elif log is not None and source is not None:
                inputs += [(run, source) for run in log.get("runs", [])]
        if notes:
            # Left out whole: code scanning reads a node's run as its latest analysis of
            # that category, and an empty or partial one would close its open alerts.
            continue
        node_run, findings = _node_run(manifest.topology.name, nid, inputs)
        out.runs.append(node_run)
        out.findings += findings
    return out


def _accepted_attempt(ns: NodeState) -> tuple[int, str] | None:
    if ns.status.value != "succeeded":
        return None
    done = [a for a in ns.attempts if a.outcome is Outcome.SUCCEEDED]
    return (done[-1].attempt, done[-1].profile) if done else None


# PLR0913: Private: one artifact's provenance (run, node, attempt, profile, digest).
def _read_artifact(run_dir: Path, manifest: Manifest, run: tuple[str, str], nid: str,  # noqa: PLR0913
                   attempt: int,
                   profile: str, spec: ArtifactSpec, accepted: str | None,
                   ) -> tuple[dict[str, Any] | None, Source | None, str | None]:
    """Read one accepted artifact.

    ``accepted`` is the digest node.succeeded recorded (None in runs recorded before it
    did): bytes that differ were changed after the contract accepted them (a later process,
    a sibling agent) and are not merged.
    """
    workspace = run_dir / "nodes" / nid / "workspace"
    real = within(workspace, spec.path)
    # The same rule as the artifact contract: resolved inside the workspace, a regular file.
    if real is None or not os.path.isfile(real):
        if not spec.required and not os.path.lexists(workspace / spec.path):
            return None, None, None  # optional and absent: nothing to merge
        return None, None, f"{spec.path}: missing or not a regular file in the workspace"
    try:
        with open(real, "rb") as fh:
            raw = fh.read(spec.max_bytes + 1)
    except OSError as exc:
        return None, None, f"{spec.path}: cannot read: {exc.strerror}"
    if len(raw) > spec.max_bytes:
        return None, None, f"{spec.path}: over its limit of {spec.max_bytes} bytes"
    if accepted and blake3_hex(raw) != accepted:
        return None, None, (f"{spec.path}: changed after it was accepted (blake3 "
                            f"{blake3_hex(raw)[:12]}..., accepted {accepted[:12]}...)")
    try:
        log = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None, None, f"{spec.path}: no longer valid JSON"
    errors = sarif_errors(log)
    if errors:
        return None, None, f"{spec.path}: no longer valid SARIF 2.1.0: {errors[0]}"
    source = Source(topology=manifest.topology.name, node=nid, attempt=attempt,
                    profile=profile, run_id=run[0], plan_digest=run[1],
                    prompt_digest=manifest.nodes[nid].prompt_digest, artifact=spec.path,
                    artifact_digest=blake3_hex(raw))
    return log, source, None


# -- merging ------------------------------------------------------------------------

def _node_run(topology: str, nid: str, inputs: list[tuple[dict[str, Any], Source]],
              ) -> tuple[dict[str, Any], list[Finding]]:
    """Merge a node's input SARIF runs into one output run.

    The input runs' rules and artifacts concatenated (equal entries shared, indexes
    remapped), their tool extensions concatenated (a result's ``toolComponent`` index
    shifted to match; CodeQL keeps its rules there), their ``originalUriBaseIds`` (the
    first meaning of a name wins) and ``versionControlProvenance`` kept, every result with
    provenance and fingerprint.
    """
    driver: dict[str, Any] = {}
    rules: list[Any] = []
    artifacts: list[Any] = []
    extensions: list[Any] = []
    bases: dict[str, Any] = {}
    provenance: list[Any] = []
    results: list[dict[str, Any]] = []
    tools: list[str] = []
    for run, source in inputs:
        in_driver = run.get("tool", {}).get("driver", {})
        tools.append(str(in_driver.get("name", "")))
        if not driver:
            driver = {k: copy.deepcopy(v) for k, v in in_driver.items() if k != "rules"}
        rule_map = _share(rules, in_driver.get("rules", []))
        art_map = _share(artifacts, run.get("artifacts", []))
        shift = len(extensions)
        extensions += copy.deepcopy(run.get("tool", {}).get("extensions", []))
        for name, base in (run.get("originalUriBaseIds") or {}).items():
            bases.setdefault(name, copy.deepcopy(base))
        _share(provenance, run.get("versionControlProvenance", []))
        for res in run.get("results", []):
            results.append(_result(res, rule_map, art_map, in_driver.get("rules", []),
                                   source, shift))
    fingerprints = _fingerprints(topology, nid, results)
    findings = []
    for res, fp in zip(results, fingerprints, strict=True):
        res.setdefault("partialFingerprints", {})[FINGERPRINT_KEY] = fp
        findings.append(_flatten(res, rules, fp, extensions, artifacts))
    out: dict[str, Any] = {
        "tool": {"driver": {**(driver or DRIVER), **({"rules": rules} if rules else {})}},
        "automationDetails": {"id": f"{topology}/{nid}/"},  # category: see the docstring
        "results": results,
        "properties": {PROVENANCE_KEY: {"topology": topology, "node": nid,
                                        "tools": sorted(set(tools))}},
    }
    if extensions:
        out["tool"]["extensions"] = extensions
    if artifacts:
        out["artifacts"] = artifacts
    if bases:
        out["originalUriBaseIds"] = bases
    if provenance:
        out["versionControlProvenance"] = provenance
    return out, findings


def _share(pool: list[Any], items: list[Any]) -> list[int]:
    """Append ``items`` to ``pool`` without duplicates; return each item's index in the pool.

    Equal entries are shared: SARIF asks rules and artifacts to be unique.
    """
    mapping = []
    for item in items:
        if item in pool:
            mapping.append(pool.index(item))
        else:
            pool.append(copy.deepcopy(item))
            mapping.append(len(pool) - 1)
    return mapping


# PLR0913: Private: one result, with the maps its run's indexes go through.
def _result(res: dict[str, Any], rule_map: list[int], art_map: list[int],  # noqa: PLR0913
            in_rules: list[Any], source: Source, shift: int = 0) -> dict[str, Any]:
    out = copy.deepcopy(res)
    index = out.get("ruleIndex")
    if isinstance(index, int) and 0 <= index < len(rule_map):
        out["ruleIndex"] = rule_map[index]
        if "ruleId" not in out and isinstance(in_rules[index], dict) \
                and "id" in in_rules[index]:
            out["ruleId"] = in_rules[index]["id"]
    rule_ref = out.get("rule")
    if isinstance(rule_ref, dict) and isinstance(rule_ref.get("index"), int) \
            and 0 <= rule_ref["index"] < len(rule_map) and "toolComponent" not in rule_ref:
        rule_ref["index"] = rule_map[rule_ref["index"]]
    component = rule_ref.get("toolComponent") if isinstance(rule_ref, dict) else None
    if isinstance(component, dict) and isinstance(component.get("index"), int):
        component["index"] += shift  # this run's extensions follow earlier runs' ones
    for loc in _artifact_locations(out):
        if isinstance(loc.get("index"), int) and 0 <= loc["index"] < len(art_map):
            loc["index"] = art_map[loc["index"]]
    props = out.setdefault("properties", {})
    props[PROVENANCE_KEY] = source.provenance()
    return out


def _artifact_locations(value: Any) -> Iterator[dict[str, Any]]:
    """Every artifactLocation object in a result (they are the values of these keys)."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key in ("artifactLocation", "analysisTarget") and isinstance(item, dict):
                yield item
            yield from _artifact_locations(item)
    elif isinstance(value, list):
        for item in value:
            yield from _artifact_locations(item)


def _primary(res: dict[str, Any], artifacts: list[Any] | None = None,
             ) -> tuple[str, str, int | None]:
    """(uri, anchor, start line) of a result's first physical location.

    A location given only by its index in the run's ``artifacts`` takes that artifact's
    uri.
    """
    locs = res.get("locations") or []
    phys = locs[0].get("physicalLocation", {}) if locs and isinstance(locs[0], dict) else {}
    where = phys.get("artifactLocation", {}) if isinstance(phys, dict) else {}
    uri = str(where.get("uri", "")) if isinstance(where, dict) else ""
    index = where.get("index") if isinstance(where, dict) else None
    entries = artifacts or []
    if not uri and isinstance(index, int) and 0 <= index < len(entries):
        entry = entries[index]
        if isinstance(entry, dict) and isinstance(entry.get("location"), dict):
            uri = str(entry["location"].get("uri", ""))
    region = phys.get("region", {}) if isinstance(phys.get("region"), dict) else {}
    line = region.get("startLine") if isinstance(region.get("startLine"), int) else None
    snippet = region.get("snippet", {}).get("text") if isinstance(region.get("snippet"),
                                                                  dict) else None
    if not uri and locs and isinstance(locs[0], dict):
        logical = locs[0].get("logicalLocations") or [{}]
        uri = str(logical[0].get("fullyQualifiedName", logical[0].get("name", "")))
    anchor = " ".join(str(snippet).split()) if snippet else ("" if line is None else str(line))
    return uri.removeprefix("./"), anchor, line


def _rule_id(res: dict[str, Any]) -> str:
    if isinstance(res.get("ruleId"), str):
        return str(res["ruleId"])
    rule = res.get("rule")
    return str(rule.get("id", "")) if isinstance(rule, dict) else ""


def _fingerprints(topology: str, nid: str, results: list[dict[str, Any]]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for res in results:
        uri, anchor, _ = _primary(res)
        base = blake3_hex(canonical_json([topology, nid, _rule_id(res), uri, anchor]))[:32]
        seen[base] = seen.get(base, 0) + 1
        out.append(f"{base}:{seen[base]}")
    return out


def _level(res: dict[str, Any], rules: list[Any], extensions: list[Any]) -> Level:
    level = res.get("level")
    if level is None:
        rule = _extension_rule(res, extensions)
        if rule is None:
            index = res.get("ruleIndex")
            rule = rules[index] if isinstance(index, int) and 0 <= index < len(rules) else \
                next((r for r in rules if isinstance(r, dict) and r.get("id") == _rule_id(res)),
                     None)
        if isinstance(rule, dict):
            level = rule.get("defaultConfiguration", {}).get("level")
    # SARIF's default level is "warning" (section 3.27.10).
    return level if level in LEVELS else "warning"


def _extension_rule(res: dict[str, Any], extensions: list[Any]) -> Any:
    """The rule a result names in a tool extension (``rule.toolComponent.index``), or None."""
    ref = res.get("rule")
    component = ref.get("toolComponent") if isinstance(ref, dict) else None
    if not isinstance(component, dict) or not isinstance(component.get("index"), int):
        return None
    index, rule_index = component["index"], ref.get("index")  # type: ignore[union-attr]
    if not 0 <= index < len(extensions) or not isinstance(rule_index, int):
        return None
    in_rules = extensions[index].get("rules", []) if isinstance(extensions[index], dict) \
        else []
    return in_rules[rule_index] if 0 <= rule_index < len(in_rules) else None


def _text(value: str, limit: int = MESSAGE_LIMIT) -> str:
    """Agent-written text for one table cell: no control characters, one line, bounded."""
    line = " ".join(sanitize(value).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _flatten(res: dict[str, Any], rules: list[Any], fp: str,
             extensions: list[Any] | None = None, artifacts: list[Any] | None = None,
             ) -> Finding:
    uri, _, line = _primary(res, artifacts or [])
    msg = res.get("message", {})
    text = msg.get("text") or msg.get("markdown") or msg.get("id") or ""
    prov = res["properties"][PROVENANCE_KEY]
    return Finding(
        level=_level(res, rules, extensions or []), rule=_text(_rule_id(res) or "-", 120),
        location=_text(f"{uri}:{line}" if uri and line else uri or "-", 200),
        message=_text(str(text)), topology=prov["topology"], node=prov["node"],
        attempt=prov["attempt"], profile=prov["profile"], run_id=prov["runId"],
        artifact=prov["artifact"], fingerprint=fp)


# -- output -------------------------------------------------------------------------

def sarif_bytes(findings: Findings) -> bytes:
    """The merged SARIF log, as the bytes of ``findings.sarif``."""
    return (json.dumps(findings.log(), indent=2, ensure_ascii=False) + "\n").encode()


def write_sarif(path: Path, findings: Findings) -> Path:
    """Write the merged SARIF log to ``path`` atomically; return ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_atomically(path, sarif_bytes(findings))
    return path


def json_bytes(findings: Findings) -> bytes:
    """Counts, flattened findings and problems as JSON, for ``runtime findings --json``."""
    obj = {"counts": findings.counts(), "findings": [f.model_dump() for f in findings.findings],
           "problems": findings.problems}
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode()


def table_text(findings: Findings, width: int = 160) -> str:
    """A plain table (severity, rule, location, message, node), most severe first."""
    from io import StringIO

    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    rank = {lv: i for i, lv in enumerate(LEVELS)}
    table = Table(title="findings: " + ", ".join(
        f"{n} {lv}" for lv, n in findings.counts().items()), title_justify="left")
    for col in ("level", "rule", "location", "message", "node"):
        table.add_column(col, overflow="fold")
    for f in sorted(findings.findings, key=lambda f: (rank[f.level], f.topology, f.node)):
        # Text cells: agent-written text is never parsed as rich markup.
        table.add_row(Text(f.level), Text(f.rule), Text(f.location), Text(f.message),
                      Text(f"{f.topology}/{f.node}"))
    buf = StringIO()
    Console(file=buf, width=width, color_system=None, force_terminal=False).print(table)
    lines = buf.getvalue()
    if findings.problems:
        lines += "".join(f"problem: {_text(p, 400)}\n" for p in findings.problems)
    return lines
