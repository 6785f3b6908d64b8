"""Static, self-contained HTML reports for a run and for a batch.

Rendered from jinja2 templates (``runtime/report/templates/``) with autoescape on: every string
from a topology, an agent or a log reaches the page as text, never markup, and nothing
here escapes by hand. No network and no script: a Content-Security-Policy of
``default-src 'none'`` with inline styles only.

The run report lists nodes in DAG order with their duration, each attempt's start
time, duration, profile, failure class and one-line summary, relative links to the
attempt's files and every accepted artifact, the retry preamble each retry received and
a diff of its prompt against attempt 1's; a findings table; and the DAG drawn as a
layered inline SVG (``diagram.py``) where status is shown by a symbol, a word and a
border style as well as by colour. The batch report has the findings counts per level
and table, each run's duration and failure summaries, and links to each run's report.
Every link is relative to the report and is made only to a file that exists.
"""

from __future__ import annotations

import difflib
import functools
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import jinja2

from runtime.files import replace_atomically, within
from runtime.plan.manifest import Manifest
from runtime.prompt.assemble import SECTION_SEPARATOR
from runtime.report.diagram import Diagram, layout
from runtime.report.findings import Finding, Findings, count_levels, dag_order, merge, run_findings
from runtime.run.events import AttemptStarted, Event, RunFinished, RunStarted, read_events
from runtime.run.read import load_run
from runtime.run.state import NodeState, RunState
from runtime.run.summary import BatchEntry, BatchSummary

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
ATTEMPT_FILES = ("prompt.md", "stdout.log", "stderr.log", "attempt.json")
# Artifacts the report links: types a browser shows as text. An agent wrote every
# artifact, and a browser runs the script in one it renders as HTML, SVG or XML (by
# extension, or by sniffing a type it does not know), so any other is named, not linked.
LINKED_SUFFIXES = frozenset({".md", ".markdown", ".txt", ".text", ".log", ".json", ".jsonl",
                             ".sarif", ".csv", ".tsv", ".yaml", ".yml", ".toml", ".diff",
                             ".patch"})
LABEL_CHARS = 18  # what fits a diagram box (bold 11.5 px from 16 characters on)
FINDINGS_SHOWN = 500  # most severe first; the rest stay in findings.sarif

# Status as symbol, word and border as well as colour (WCAG 1.4.1). Fills are light so
# the dark label text keeps well above 4.5:1 contrast on every one of them.
STATUS_STYLE: dict[str, dict[str, str]] = {
    "succeeded": {"symbol": "✓", "fill": "#dafbe1", "stroke": "#1a7f37", "dash": "",
                  "width": "1.5"},
    "failed": {"symbol": "✗", "fill": "#ffebe9", "stroke": "#cf222e", "dash": "",
               "width": "3"},
    "skipped": {"symbol": "⊘", "fill": "#f6f8fa", "stroke": "#6e7781", "dash": "6 3",
                "width": "1.5"},
    "not-started": {"symbol": "○", "fill": "#f6f8fa", "stroke": "#6e7781", "dash": "2 3",
                    "width": "1.5"},
    "pending": {"symbol": "…", "fill": "#fff8c5", "stroke": "#9a6700", "dash": "4 2",
                "width": "1.5"},
    "running": {"symbol": "▶", "fill": "#fff8c5", "stroke": "#9a6700", "dash": "",
                "width": "1.5"},
}


@functools.lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("runtime.report", "templates"),
        autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True,
        lstrip_blocks=True)
    env.globals.update(CSP=CSP, STATUS_STYLE=STATUS_STYLE, FINDINGS_SHOWN=FINDINGS_SHOWN)
    env.filters.update(when=_when, seconds=_seconds)
    return env


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(ts)) if ts else "-"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 60:
        return f"{value:.2f} s" if value < 10 else f"{value:.1f} s"
    minutes, secs = divmod(round(value), 60)
    return f"{minutes} min {secs:02d} s" if minutes < 60 else \
        f"{minutes // 60} h {minutes % 60:02d} min"


def _href(base: Path, target: Path) -> str | None:
    """A URL relative to ``base`` for ``target`` when it exists, else None."""
    here, there = os.fspath(base), os.fspath(target)
    if not os.path.exists(there):
        return None
    # Most targets lie under base: a string cut, not relpath's two abspath calls (a
    # 1,000-node report makes ~4,000 links).
    rel = there[len(here) + 1:] if there.startswith(here + os.sep) else os.path.relpath(
        there, here)
    return "/".join(quote(part) for part in rel.split(os.sep))


# -- run report -----------------------------------------------------------------------

@dataclass
class AttemptView:
    """One attempt as the run report shows it."""
    number: int
    profile: str
    outcome: str
    failure: bool
    started: float | None
    duration: float | None
    exit_code: int | None
    summary: str
    error: str
    prompt_digest: str
    links: list[tuple[str, str]]
    preamble: str = ""
    preamble_digest: str = ""
    diff: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class NodeView:
    """One node as the run report shows it."""
    id: str
    status: str
    label: str
    note: str
    objective: str
    prompt_digest: str
    max_attempts: int
    retry_feedback: bool
    started: float | None
    duration: float | None
    attempts: list[AttemptView]
    artifacts: list[tuple[str, str | None, str]]  # path, link, why not linked
    findings: int
    retried: bool = False  # `runtime retry` gave it a fresh max_attempts


def _display_status(ns: NodeState) -> str:
    # A node the run never reached (deadline, budget) has no attempt: it did not fail.
    # Skipped by itself (no failed ancestor) is how the runtime records it; failed with no
    # attempt is how runs recorded before it did.
    if not ns.attempts and (ns.status.value == "failed" or (
            ns.status.value == "skipped" and not ns.failed_ancestor)):
        return "not-started"
    return ns.status.value


def _note(ns: NodeState, state: RunState) -> str:
    if ns.failed_ancestor:
        up = state.nodes.get(ns.failed_ancestor)
        if up is not None and _display_status(up) == "not-started":
            return f"upstream {ns.failed_ancestor} not started ({up.reason})"
        return f"upstream {ns.failed_ancestor} failed"
    return ns.reason or ""


# PLR0913: Private view builder: the run's loaded parts, read once by the caller.
def _node_view(run_dir: Path, manifest: Manifest, state: RunState, nid: str,  # noqa: PLR0913
               starts: dict[tuple[str, int], AttemptStarted], findings: int) -> NodeView:
    pn, ns = manifest.nodes[nid], state.nodes[nid]
    # What the run last ran the node with: the plan's values unless `--set` changed them.
    set_: dict[str, Any] = state.settings.get("overrides", {}).get(nid, {})
    attempts = _attempt_views(run_dir, nid, ns, starts)
    status = _display_status(ns)
    started = min((a.started for a in attempts if a.started), default=None)
    ends = [a.started + a.duration for a in attempts if a.started and a.duration is not None]
    artifacts: list[tuple[str, str | None, str]] = []
    if ns.status.value == "succeeded":
        ws = run_dir / "nodes" / nid / "workspace"
        for spec in pn.artifacts:
            real = within(ws, spec.path)
            target = ws / spec.path
            ok = real is not None and os.path.isfile(real)  # as the contract accepted it
            if not ok:
                artifacts.append((spec.path, None, "absent"))
            elif Path(real or spec.path).suffix.lower() not in LINKED_SUFFIXES or \
                    Path(spec.path).suffix.lower() not in LINKED_SUFFIXES:
                artifacts.append((spec.path, None, "not linked: a browser might run what "
                                  "the agent wrote in it"))
            else:
                artifacts.append((spec.path, _href(run_dir, target), ""))
    word = "not started" if status == "not-started" else status
    plural = "" if len(ns.attempts) == 1 else "s"
    label = f"{STATUS_STYLE[status]['symbol']} {word} · {len(ns.attempts)} attempt{plural}"
    return NodeView(
        id=nid, status=status, label=label, note=_note(ns, state), objective=pn.objective or "",
        prompt_digest=pn.prompt_digest, max_attempts=int(set_.get("max_attempts",
                                                                 pn.max_attempts)),
        retry_feedback=bool(set_.get("retry_feedback", pn.retry_feedback)), started=started,
        duration=(max(ends) - started) if started and ends else None, attempts=attempts,
        artifacts=artifacts, findings=findings, retried=ns.retry_from > 1)


def _attempt_views(run_dir: Path, nid: str, ns: NodeState,
                   starts: dict[tuple[str, int], AttemptStarted]) -> list[AttemptView]:
    """Each attempt as the ledger recorded it (never ``attempt.json``, which an agent can reach).

    The prompts are read only to show what changed: a node with one attempt has no diff
    and no preamble, so its prompt files are linked, not read.
    """
    views: list[AttemptView] = []
    retried = len(ns.attempts) > 1
    first_prompt: str | None = None
    plan_prompt = _read(run_dir / "nodes" / nid / "prompt.rendered.md") if retried else None
    for rec in ns.attempts:
        adir = run_dir / "nodes" / nid / "attempts" / str(rec.attempt)
        prompt = _read(adir / "prompt.md") if retried else None
        first_prompt = prompt if first_prompt is None else first_prompt
        start = starts.get((nid, rec.attempt))
        outcome = rec.outcome or "unfinished"
        view = AttemptView(
            number=rec.attempt, profile=rec.profile, outcome=str(outcome),
            failure=outcome != "succeeded", started=start.ts if start else None,
            duration=rec.duration_s, exit_code=rec.exit_code, summary=rec.summary,
            error=rec.error, prompt_digest=start.prompt_digest if start else "",
            links=[(name, href) for name in ATTEMPT_FILES
                   if (href := _href(run_dir, adir / name)) is not None])
        if start is not None and start.preamble_digest:
            view.preamble_digest = start.preamble_digest
            view.preamble = _preamble(prompt, first_prompt, plan_prompt)
        if rec.attempt != ns.attempts[0].attempt and prompt is not None:
            view.diff = _diff(first_prompt or "", prompt)
        views.append(view)
    return views


def _diff(first: str, later: str) -> list[tuple[str, str]]:
    lines = []
    for line in difflib.unified_diff(first.splitlines(), later.splitlines(), "attempt 1",
                                     "this attempt", lineterm="", n=1):
        cls = "add" if line.startswith("+") and not line.startswith("+++") else \
            "del" if line.startswith("-") and not line.startswith("---") else ""
        lines.append((cls, line))
    return lines


def _preamble(prompt: str | None, first: str | None, plan_prompt: str | None) -> str:
    """The retry preamble cut out of attempt k's prompt, or "" when it cannot be isolated.

    Attempt k is attempt 1's head, the preamble, the section separator, then the plan prompt
    (DESIGN section 6).
    """
    if not prompt or not first or plan_prompt is None or not first.endswith(plan_prompt):
        return ""
    head = first[: len(first) - len(plan_prompt)]
    tail = SECTION_SEPARATOR + plan_prompt
    if not prompt.startswith(head) or not prompt.endswith(tail):
        return ""
    return prompt[len(head): len(prompt) - len(tail)]


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


@dataclass
class RunTimes:
    """When the run and each attempt started, from the ledger's timestamps."""
    started: float | None
    finished: float | None
    attempts: dict[tuple[str, int], AttemptStarted]  # (node, attempt) -> its start event
    active: float | None = None  # seconds some process was running it (gaps left out)

    @property
    def duration(self) -> float | None:
        """The seconds the run ran, or None while it has not finished.

        Summed over each process that ran it (run, resume, retry): the hour between a run
        and its ``runtime retry`` is not the run's.
        """
        if not self.started or not self.finished:
            return None
        return self.active if self.active is not None else self.finished - self.started


def run_times(events: list[Event]) -> RunTimes:
    """When the run started and last finished, and how each attempt started (ledger)."""
    started = next((e.ts for e in events if isinstance(e, RunStarted)), None)
    # Finished only when the latest process finished it (a retry still running is not).
    latest = next((e for e in reversed(events) if isinstance(e, RunStarted | RunFinished)),
                  None)
    finished = latest.ts if isinstance(latest, RunFinished) else None
    starts = {(e.node, e.attempt): e for e in events if isinstance(e, AttemptStarted)}
    active, since, last = 0.0, None, None
    for e in events:  # a process's span: its run.started to its last event
        if isinstance(e, RunStarted):
            if since is not None and last is not None:
                active += last - since
            since = e.ts
        last = e.ts
    if since is not None and last is not None:
        active += last - since
    return RunTimes(started=started, finished=finished, attempts=starts, active=active)


def _diagram_nodes(views: list[NodeView]) -> dict[str, dict[str, str]]:
    out = {}
    for v in views:
        # Cut in the middle: ids that share a prefix (review-service-alpha, -beta) differ
        # at the end.
        head = (LABEL_CHARS - 1) // 2
        short = v.id if len(v.id) <= LABEL_CHARS else \
            v.id[:head] + "…" + v.id[len(v.id) - (LABEL_CHARS - 1 - head):]
        word = v.status.replace("-", " ")
        count = len(v.attempts)
        detail = f"{count} attempt{'' if count == 1 else 's'}" if count else (v.note or "")
        if len(detail) > LABEL_CHARS + 3:
            detail = detail[: LABEL_CHARS + 2] + "…"
        out[v.id] = {"short": short, "status": v.status,
                     "state": f"{STATUS_STYLE[v.status]['symbol']} {word}", "detail": detail,
                     "title": f"{v.id}: {v.label}" + (f" — {v.note}" if v.note else "")}
    return out


def render_run_report(run_dir: Path) -> Path:
    """Write ``run_dir/report.html``; return its path."""
    return report_run(run_dir)[0]


def report_run(run_dir: Path) -> tuple[Path, Findings]:
    """Write ``run_dir/report.html``; return its path and the run's findings.

    For a caller that also shows the findings: the ledger is read and folded once.
    """
    events = read_events(run_dir / "ledger.jsonl")
    manifest, state = load_run(run_dir, events=events)
    times = run_times(events)
    found = run_findings(run_dir, loaded=(manifest, state))
    per_node = {nid: sum(1 for f in found.findings if f.node == nid) for nid in state.nodes}
    views = [_node_view(run_dir, manifest, state, nid, times.attempts, per_node[nid])
             for nid in dag_order(manifest)]
    diagram: Diagram = layout(manifest.dag())
    html = _env().get_template("run.html.j2").render(
        state=state, times=times, nodes=views, diagram=diagram,
        dnodes=_diagram_nodes(views), findings=_sorted(found.findings),
        counts=found.counts(), problems=found.problems,
        files=[(n, h) for n in ("plan.json", "ledger.jsonl", "state.json")
               if (h := _href(run_dir, run_dir / n)) is not None],
        node_anchor=lambda f: f"#node-{f.node}",
        status_counts=_status_counts(state))
    out = run_dir / "report.html"
    replace_atomically(out, html.encode())
    return out, found


def _status_counts(state: RunState) -> dict[str, int]:
    counts: dict[str, int] = {}
    for ns in state.nodes.values():
        key = _display_status(ns)
        counts[key] = counts.get(key, 0) + 1
    return counts


def _sorted(findings: list[Finding]) -> list[Finding]:
    rank = {"error": 0, "warning": 1, "note": 2, "none": 3}
    return sorted(findings, key=lambda f: (rank[f.level], f.topology, f.node, f.rule))


# -- batch report ---------------------------------------------------------------------

@dataclass
class EntryView:
    """One topology of a batch as the batch report shows it."""
    entry: BatchEntry
    name: str
    error: str
    report: str | None
    duration: float | None
    started: float | None
    status_counts: dict[str, int]
    attempts: int
    failures: list[tuple[str, str, str]]  # node, failure class or reason, summary
    findings: dict[str, int]


def _entry_view(batch_dir: Path, runs_root: Path, entry: BatchEntry) -> EntryView:
    run_dir = runs_root / entry.run_id if entry.run_id else None
    report = _href(batch_dir, run_dir / "report.html") if run_dir else None
    counts: dict[str, int] = {}
    failures: list[tuple[str, str, str]] = []
    times = RunTimes(None, None, {})
    if run_dir is not None and (run_dir / "ledger.jsonl").is_file():
        events = read_events(run_dir / "ledger.jsonl")
        manifest, state = load_run(run_dir, events=events)
        times = run_times(events)
        counts = _status_counts(state)
        for nid in dag_order(manifest):
            ns = state.nodes[nid]
            if ns.status.value == "failed":
                last = ns.last_failure
                failures.append((nid, ns.failure.value if ns.failure else (ns.reason or ""),
                                 (last.summary if last else "") or ns.reason or ""))
    else:
        for n in entry.nodes.values():
            counts[n.status.value] = counts.get(n.status.value, 0) + 1
    # The topology file as given may be absolute: show it relative to the report.
    source = os.path.abspath(entry.source)
    shown = os.path.relpath(source, batch_dir)
    error = (entry.error or "").replace(source, shown).replace(entry.source, shown)
    return EntryView(entry=entry, name=entry.topology or shown, error=error, report=report,
                     duration=times.duration,
                     started=times.started, status_counts=counts,
                     attempts=sum(n.attempts for n in entry.nodes.values()),
                     failures=failures, findings=entry.findings or count_levels([]))


def render_batch_report(summary: BatchSummary, batch_dir: Path) -> Path:
    """Write ``batch_dir/report.html``; return its path."""
    runs_root = batch_dir.parent.parent / "runs"
    views = [_entry_view(batch_dir, runs_root, e) for e in summary.entries]
    run_dirs = [runs_root / e.run_id for e in summary.entries
                if e.run_id and (runs_root / e.run_id / "ledger.jsonl").is_file()]
    found = merge(run_dirs)
    reports = {v.entry.run_id: v.report for v in views}
    starts = [v.started for v in views if v.started]
    ends = [v.started + v.duration for v in views if v.started and v.duration is not None]
    html = _env().get_template("batch.html.j2").render(
        summary=summary, entries=views, findings=_sorted(found.findings),
        counts=found.counts(), problems=found.problems, reports=reports,
        duration=(max(ends) - min(starts)) if starts and ends else None,
        started=min(starts) if starts else None,
        files=[(n, h) for n in ("findings.sarif", "summary.json")
               if (h := _href(batch_dir, batch_dir / n)) is not None],
        finding_href=lambda f: f"{reports[f.run_id]}#node-{f.node}" if reports.get(f.run_id)
        else None)
    out = batch_dir / "report.html"
    replace_atomically(out, html.encode())
    return out


def template_names() -> list[str]:
    """The templates shipped as package data (a test checks they install)."""
    return sorted(_env().list_templates())
