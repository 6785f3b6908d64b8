"""Static, self-contained HTML reports for a run and for a batch.

No network and no script: a Content-Security-Policy of ``default-src 'none'`` with inline
styles only. Every string that came from a topology, an agent or a log is escaped. The
run report draws the DAG as inline SVG coloured by node status, lists each node's
attempts with failure classes and errors, shows the retry preamble each retry received
and a diff of attempt k's prompt against attempt 1's, and the digests.
"""

from __future__ import annotations

import difflib
import html
import os
from pathlib import Path

import networkx as nx

from .assemble import SECTION_SEPARATOR
from .batch import BatchSummary
from .files import replace_atomically
from .ledger import NodeState, RunState
from .plan import Manifest
from .records import read_attempt_context
from .run import load_run

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:2rem;color:#1b1f23;max-width:1200px}
h1{font-size:1.5rem}h2{font-size:1.2rem;margin-top:2rem}
code,pre{font:12px/1.4 ui-monospace,monospace}
pre{background:#f6f8fa;padding:.6rem;overflow-x:auto;white-space:pre-wrap;word-break:break-all}
table{border-collapse:collapse;margin:.5rem 0}td,th{border:1px solid #d0d7de;padding:.25rem .5rem;
text-align:left;vertical-align:top}.status{font-weight:600;padding:0 .3rem;border-radius:3px}
.succeeded{background:#d1f7d6}.failed{background:#ffd7d5}.skipped{background:#e6e6e6}
.pending,.running,.cancelled,.invalid{background:#fff3c4}
.add{color:#116329;background:#e6ffec}.del{color:#82071e;background:#ffebe9}
svg text{font:11px system-ui,sans-serif}details{margin:.3rem 0}
"""
FILL = {"succeeded": "#2da44e", "failed": "#cf222e", "skipped": "#8c959f", "pending": "#d4a72c",
        "running": "#d4a72c"}
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _page(title: str, body: str) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
            f"<title>{_e(title)}</title><style>{CSS}</style></head>"
            f"<body>{body}</body></html>\n")


def dag_svg(manifest: Manifest, state: RunState) -> str:
    """Nodes in layers by longest path from a source; edges as straight lines."""
    graph = manifest.dag()
    layer: dict[str, int] = {}
    for nid in nx.topological_sort(graph):
        layer[nid] = max((layer[u] + 1 for u in graph.pred[nid]), default=0)
    rows: dict[int, list[str]] = {}
    for nid in sorted(layer, key=lambda n: (layer[n], n)):
        rows.setdefault(layer[nid], []).append(nid)
    w, h, gx, gy = 170, 34, 24, 40
    pos = {nid: (gx + i * (w + gx), gy + r * (h + gy)) for r, ids in rows.items()
           for i, nid in enumerate(ids)}
    width = gx + max(len(ids) for ids in rows.values()) * (w + gx)
    height = gy + len(rows) * (h + gy)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'role="img" aria-label="DAG">']
    for up, down in graph.edges:
        (x1, y1), (x2, y2) = pos[up], pos[down]
        parts.append(f'<line x1="{x1 + w / 2}" y1="{y1 + h}" x2="{x2 + w / 2}" y2="{y2}" '
                     'stroke="#57606a" stroke-width="1.2"/>')
    for nid, (x, y) in pos.items():
        status = state.nodes[nid].status.value
        attempts = len(state.nodes[nid].attempts)
        parts.append(
            f'<g class="node status-{status}" data-node="{_e(nid)}" data-status="{status}">'
            f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="5" fill="{FILL[status]}"/>'
            f'<text x="{x + 8}" y="{y + 21}" fill="#fff">{_e(nid[:22])} · {attempts}</text>'
            "</g>")
    parts.append("</svg>")
    return "".join(parts)


def _diff(first: str, later: str) -> str:
    lines = []
    for line in difflib.unified_diff(first.splitlines(), later.splitlines(), "attempt 1",
                                     "this attempt", lineterm="", n=1):
        cls = "add" if line.startswith("+") and not line.startswith("+++") else \
            "del" if line.startswith("-") and not line.startswith("---") else ""
        lines.append(f'<span class="{cls}">{_e(line)}</span>' if cls else _e(line))
    return "\n".join(lines) or "(identical)"


def _attempt_rows(run_dir: Path, nid: str, ns: NodeState) -> str:
    rows, first_prompt = [], None
    plan_prompt = _read(run_dir / "nodes" / nid / "prompt.rendered.md")
    for rec in ns.attempts:
        adir = run_dir / "nodes" / nid / "attempts" / str(rec.attempt)
        prompt = _read(adir / "prompt.md")
        first_prompt = prompt if first_prompt is None else first_prompt
        ctx = read_attempt_context(adir)
        outcome = rec.outcome or "unfinished"
        extra = []
        if rec.error:
            extra.append(f"<details><summary>error</summary><pre>{_e(rec.error)}</pre></details>")
        if ctx is not None and ctx.preamble_digest:
            extra.append(f'<details class="preamble" open><summary>retry preamble '
                         f"(<code>{_e(ctx.preamble_digest[:16])}</code>)</summary>"
                         f"<pre>{_e(_preamble(prompt, first_prompt, plan_prompt))}</pre></details>")
        if rec.attempt != ns.attempts[0].attempt and prompt is not None:
            extra.append(f'<details class="diff"><summary>prompt diff against attempt 1'
                         f"</summary><pre>{_diff(first_prompt or '', prompt)}</pre></details>")
        digest = f"<code>{_e(ctx.prompt_digest[:16])}</code>" if ctx else ""
        rows.append(f'<tr data-attempt="{rec.attempt}"><td>{rec.attempt}</td>'
                    f"<td>{_e(rec.profile)}</td><td><span class=\"status "
                    f'{"succeeded" if outcome == "succeeded" else "failed"}">{_e(outcome)}'
                    f"</span></td><td>{_e(rec.exit_code)}</td><td>{digest}</td>"
                    f"<td>{''.join(extra)}</td></tr>")
    return "".join(rows)


def _preamble(prompt: str | None, first: str | None, plan_prompt: str | None) -> str:
    """Exactly the inserted section: attempt k is attempt 1's head, the preamble, the
    section separator, then the plan prompt (DESIGN section 6)."""
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


def render_run_report(run_dir: Path) -> Path:
    manifest, state = load_run(run_dir)
    nodes = []
    for nid, ns in state.nodes.items():
        pn = manifest.nodes[nid]
        note = f" — upstream {_e(ns.failed_ancestor)} failed" if ns.failed_ancestor else (
            f" — {_e(ns.reason)}" if ns.reason else "")
        nodes.append(
            f'<section class="node-detail" id="node-{_e(nid)}" data-node="{_e(nid)}">'
            f'<h3>{_e(nid)} <span class="status {ns.status.value}">{ns.status.value}</span>'
            f"{note}</h3><p>prompt digest <code>{_e(pn.prompt_digest)}</code>, "
            f"max_attempts {pn.max_attempts}, retry_feedback "
            f"{str(pn.retry_feedback).lower()}</p>"
            f"<table><tr><th>#</th><th>profile</th><th>outcome</th><th>exit</th>"
            f"<th>prompt</th><th>details</th></tr>{_attempt_rows(run_dir, nid, ns)}</table>"
            "</section>")
    body = (f'<h1>Run {_e(state.run_id)} <span class="status {state.status.value}" '
            f'id="run-status">{state.status.value}</span></h1>'
            f"<p>topology <b>{_e(state.topology)}</b>, plan digest "
            f"<code>{_e(state.plan_digest)}</code>, attempts used {state.attempts_used}</p>"
            f"<h2>DAG</h2>{dag_svg(manifest, state)}<h2>Nodes</h2>{''.join(nodes)}")
    out = run_dir / "report.html"
    replace_atomically(out, _page(f"Run {state.run_id}", body).encode())
    return out


def render_batch_report(summary: BatchSummary, batch_dir: Path) -> Path:
    rows = []
    for e in summary.entries:
        link = ""
        if e.run_dir:
            rel = os.path.relpath(Path(e.run_dir) / "report.html", batch_dir)
            link = f'<a href="{_e(rel)}">report</a>'
        counts: dict[str, int] = {}
        for n in e.nodes.values():
            counts[n.status.value] = counts.get(n.status.value, 0) + 1
        rows.append(
            f'<tr class="entry" data-topology="{_e(e.topology or e.source)}">'
            f"<td>{_e(e.topology or e.source)}</td>"
            f'<td><span class="status {e.status}">{e.status}</span></td>'
            f"<td>{_e(', '.join(f'{k} {v}' for k, v in sorted(counts.items())))}</td>"
            f"<td>{sum(n.attempts for n in e.nodes.values())}</td>"
            f"<td>{_e(', '.join(e.retries_after_feedback) or '-')}</td>"
            f"<td><code>{_e((e.plan_digest or '')[:16])}</code></td><td>{link}</td>"
            f"<td>{_e(e.error or '')}</td></tr>")
    body = (f'<h1>Batch {_e(summary.batch_id)} <span class="status {summary.status}" '
            f'id="batch-status">{summary.status}</span></h1><table><tr><th>topology</th>'
            "<th>status</th><th>nodes</th><th>attempts</th><th>succeeded after feedback</th>"
            f"<th>plan</th><th>run</th><th>error</th></tr>{''.join(rows)}</table>")
    out = batch_dir / "report.html"
    replace_atomically(out, _page(f"Batch {summary.batch_id}", body).encode())
    return out
