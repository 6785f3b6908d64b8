"""HTML reports: escaped, self-contained, DAG order, links that resolve, findings, the
diagram's geometry and contrast; and the same checks on the DOM headless Chromium built."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import networkx as nx
import pytest

from runtime.batch import BatchOptions, run_batch
from runtime.plan.compile import plan_topology
from runtime.plan.dag import Dag
from runtime.prompt.redact import Redactor
from runtime.report.diagram import BOX_H, BOX_W, Diagram, layout
from runtime.report.findings import dag_order
from runtime.report.html import CSP, STATUS_STYLE, render_batch_report, render_run_report
from runtime.run.events import AttemptStarted, read_events
from runtime.run.read import load_run
from tests.agent_scripts import HOSTILE_MARKUP
from tests.conftest import REPO, Project, make_topology, python_agents, run_topology

EVIL = HOSTILE_MARKUP
PAGE_WIDTH = 1200 - 2 * 32  # the page's max width less its margins


@pytest.fixture
def run_dir(project: Project) -> Path:
    topo = make_topology({"a": [], "b": ["a"], "c": ["b"]}, b={"retry_feedback": True})
    topo["agents"] = {**python_agents("write_all", "fail_first", "always_exit_2",
                                      "markup_finding"),
                      "sim": {"kind": "simulated"}}
    topo["defaults"] = {"agent": "write_all"}
    topo["nodes"][1]["agent"] = "fail_first"
    topo["nodes"].append({"id": "d", "prompt": "task.md.j2", "agent": "always_exit_2",
                          "max_attempts": 1})
    topo["nodes"].append({"id": "e", "prompt": "task.md.j2", "needs": ["d"]})
    # An agent-written finding whose message is markup: it must stay text.
    topo["nodes"].append({"id": "scan", "prompt": "task.md.j2", "needs": ["a"],
                          "agent": "markup_finding",
                          "artifacts": [{"path": "scan.sarif", "kind": "sarif"}]})
    project.template("task.md.j2", "Task {{ node.id }} " + EVIL + "\n")
    return Path(run_topology(project, topo).run_dir)


class _Dom(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.nodes: dict[str, str] = {}
        self.sections: list[str] = []
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.tags.append((tag, a))
        if a.get("id"):
            self.ids.add(str(a["id"]))
        if tag == "g" and a.get("data-node"):
            self.nodes[str(a["data-node"])] = str(a.get("data-status"))
        if tag == "section" and a.get("data-node"):
            self.sections.append(str(a["data-node"]))

    def handle_data(self, data: str) -> None:
        self.text.append(data)

    def attr(self, tag: str, name: str) -> list[str]:
        return [str(a[name]) for t, a in self.tags if t == tag and a.get(name) is not None]


def _parse(html: str) -> _Dom:
    dom = _Dom()
    dom.feed(html)
    return dom


def _check_links(dom: _Dom, page: Path) -> int:
    """Every link is relative and resolves: a file that exists, or an id on the page."""
    hrefs = dom.attr("a", "href")
    for href in hrefs:
        parts = urlsplit(href)
        assert not parts.scheme, href
        assert not parts.netloc, href
        assert not href.startswith("/"), href
        if parts.path:
            assert (page.parent / unquote(parts.path)).is_file(), href
        elif parts.fragment:
            assert parts.fragment in dom.ids, href
    return len(hrefs)


def _check_no_host_path(html: str, *roots: Path) -> None:
    for root in roots:
        assert str(root) not in html
        assert str(root.resolve()) not in html


def _check_run_dom(dom: _Dom, run_dir: Path) -> None:
    manifest, _ = load_run(run_dir)
    assert dom.sections == dag_order(manifest)  # nodes in DAG order
    assert dom.nodes == {"a": "succeeded", "b": "succeeded", "c": "succeeded", "d": "failed",
                         "e": "skipped", "scan": "succeeded"}
    tags = [t for t, _ in dom.tags]
    assert "script" not in tags
    assert "img" not in tags  # the agent's markup stayed text
    assert any(t == "details" and a.get("class") == "preamble" for t, a in dom.tags)
    text = "".join(dom.text)
    assert EVIL in text
    assert "prior-failure-v1" in text
    assert "upstream d failed" in text
    assert "fatal: could not parse contract" in text  # d's one-line summary
    metas = [a for t, a in dom.tags if t == "meta" and a.get("http-equiv")]
    assert metas[0]["content"] == CSP
    findings = [a for t, a in dom.tags if t == "tr" and a.get("class") == "finding"]
    assert [f["data-node"] for f in findings] == ["scan"]
    assert "findings" in dom.ids


def test_long_ids_that_share_a_prefix_stay_apart_in_the_diagram(project: Project) -> None:
    """A new user's trial: three ids cut at 17 characters all read 'dependency-review…'."""
    ids = [f"dependency-review-service-{s}" for s in ("alpha", "beta", "gamma")]
    topo = make_topology({i: [] for i in ids})
    run = Path(run_topology(project, topo).run_dir)
    html = render_run_report(run).read_text()
    labels = {label for label in re.findall(r">(dependen[^<]*)</text>", html)}
    assert len(labels) == 3, labels


def test_agent_written_active_content_is_named_not_linked(project: Project) -> None:
    """A new user's trial: the report linked an agent's .html and .svg artifacts, and a
    browser opening one from it ran the agent's script."""
    topo = make_topology({"a": []})
    topo["nodes"][0]["artifacts"] = [{"path": p, "kind": "file"}
                                     for p in ("page.html", "chart.SVG", "doc.xht", "noext",
                                               "notes.md")]
    topo["agents"] = python_agents("write_all")
    topo["defaults"] = {"agent": "write_all"}
    run = Path(run_topology(project, topo).run_dir)
    dom = _parse(render_run_report(run).read_text())
    hrefs = dom.attr("a", "href")
    assert "nodes/a/workspace/notes.md" in hrefs
    assert not any(h.endswith(("page.html", "chart.SVG", "doc.xht", "noext")) for h in hrefs)
    assert "".join(dom.text).count("not linked: a browser might run what the agent wrote "
                                   "in it") == 4


def test_run_report_is_escaped_complete_and_linked(run_dir: Path, project: Project) -> None:
    html = render_run_report(run_dir).read_text()
    dom = _parse(html)
    _check_run_dom(dom, run_dir)
    _check_no_host_path(html, project.root)
    hrefs = dom.attr("a", "href")
    assert _check_links(dom, run_dir / "report.html") > 20
    for name in ("prompt.md", "attempt.json"):
        for n in (1, 2):
            assert f"nodes/b/attempts/{n}/{name}" in hrefs
    # Logs exist only when the agent wrote to them: linked exactly when they exist.
    logs = [f"nodes/{nid}/attempts/{n}/{name}" for nid in ("a", "b", "d")
            for n in (1, 2) for name in ("stdout.log", "stderr.log")]
    assert [log for log in logs if log in hrefs] == [
        log for log in logs if (run_dir / log).is_file()]
    assert any(log in hrefs for log in logs)
    assert "nodes/scan/workspace/scan.sarif" in hrefs
    assert "nodes/a/workspace/a.json" in hrefs
    assert "nodes/d/workspace/d.json" not in hrefs  # d failed: nothing was accepted
    # A skipped node says why instead of drawing an empty attempts table.
    assert "No attempt was made: upstream d failed." in "".join(dom.text)
    assert re.search(r"started \d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ · duration [\d.]+ s", html)


def test_node_never_started_is_not_drawn_failed(project: Project) -> None:
    topo = make_topology({"a": [], "b": ["a"]})
    result = run_topology(project, topo, deadline_at=time.time() - 1)
    html = render_run_report(Path(result.run_dir)).read_text()
    dom = _parse(html)
    assert dom.nodes["a"] == "not-started"
    assert "run deadline passed" in "".join(dom.text)
    node_a = html[html.index('data-node="a"'):]
    node_a = node_a[: node_a.index("</g>")]
    assert STATUS_STYLE["failed"]["stroke"] not in node_a  # not red
    assert "not started" in node_a
    assert "failed" not in node_a
    assert dom.nodes["b"] == "skipped"
    assert "upstream a not started (run deadline passed)" in "".join(dom.text)


def _batch_project(project: Project) -> Path:
    folder = project.root / "topologies"
    folder.mkdir()
    good = make_topology({"a": [], "b": ["a"]}, name="good")
    good["nodes"][1]["artifacts"].append({"path": "b.sarif", "kind": "sarif"})
    bad = make_topology({"x": [], "y": ["x"]}, name="bad", x={"max_attempts": 1})
    bad["agents"]["sim"] = {"kind": "simulated", "mistakes": {"x": {"kind": "exit_nonzero"}}}
    import yaml

    for name, topo in (("good", good), ("bad", bad)):
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(topo, sort_keys=False))
    (folder / "broken.yaml").write_text("schema_version: 1\nname: b\n")
    return folder


def _render_batch(project: Project) -> Path:
    summary = run_batch([_batch_project(project)], BatchOptions(
        prompts=project.prompts, artifacts=project.artifacts, batch_id="rb",
        redactor=Redactor()))
    for entry in summary.entries:
        if entry.run_dir:
            render_run_report(Path(entry.run_dir))
    return render_batch_report(summary, project.artifacts / "batches" / "rb")


def _check_batch_dom(dom: _Dom, report: Path) -> None:
    text = " ".join(dom.text)
    assert "findings" in dom.ids
    assert "finding-counts" in dom.ids
    findings = [a for t, a in dom.tags if t == "tr" and a.get("class") == "finding"]
    assert [f["data-node"] for f in findings] == ["b"]
    assert "good/b" in text
    assert re.search(r"x\s*: agent_exit — exit status 1", text)  # the failure summary
    assert "broken.yaml:1: nodes: required field is missing" in text  # invalid topology
    assert re.search(r"\d+\.\d+ s", text)  # durations
    assert "findings.sarif" in dom.attr("a", "href")
    assert _check_links(dom, report) >= 4


def test_batch_report_counts_durations_failures(project: Project) -> None:
    report = _render_batch(project)
    html = report.read_text()
    dom = _parse(html)
    _check_batch_dom(dom, report)
    _check_no_host_path(html, project.root)
    counts = {a["data-level"] for t, a in dom.tags if t == "span" and a.get("data-level")}
    assert counts == {"error", "warning", "note", "none"}


# -- the diagram ----------------------------------------------------------------------

SHIPPED = sorted((REPO / "topologies").glob("*.yaml"))


def _random_dag(seed: int) -> Dag:
    rnd = nx.gnp_random_graph(12, 0.25, seed=seed, directed=True)
    return Dag.of((f"n{v}", [f"n{u}" for u in sorted(rnd.pred[v]) if u < v])
                  for v in rnd.nodes)


def _graphs() -> list[tuple[str, Dag]]:
    out = [(p.stem, plan_topology(p, REPO / "prompts").manifest.dag()) for p in SHIPPED]
    return out + [(f"random-{s}", _random_dag(s)) for s in range(8)]


def _points(path: str) -> list[tuple[float, float]]:
    """Sample points along an SVG path of M, L and C commands."""
    tokens = re.findall(r"[MLC]|-?\d+(?:\.\d+)?", path)
    pts: list[tuple[float, float]] = []
    cur = (0.0, 0.0)
    i = 0
    while i < len(tokens):
        cmd = tokens[i]
        if cmd in ("M", "L"):
            nxt = (float(tokens[i + 1]), float(tokens[i + 2]))
            if cmd == "L":
                pts += [(cur[0] + (nxt[0] - cur[0]) * t / 20, cur[1] + (nxt[1] - cur[1]) * t / 20)
                        for t in range(21)]
            cur, i = nxt, i + 3
        else:
            c = [float(v) for v in tokens[i + 1: i + 7]]
            p0, p1, p2, p3 = cur, (c[0], c[1]), (c[2], c[3]), (c[4], c[5])
            for k in range(41):
                t = k / 40
                pts.append(tuple(  # type: ignore[arg-type]
                    (1 - t) ** 3 * a + 3 * (1 - t) ** 2 * t * b + 3 * (1 - t) * t * t * c_
                    + t ** 3 * d for a, b, c_, d in zip(p0, p1, p2, p3, strict=True)))
            cur, i = p3, i + 7
    return pts


@pytest.mark.parametrize(("name", "graph"), _graphs(), ids=[n for n, _ in _graphs()])
def test_no_edge_crosses_a_node_box(name: str, graph: Dag) -> None:
    diagram: Diagram = layout(graph)
    boxes = {b.node: b for b in diagram.boxes}
    assert set(boxes) == set(graph.nodes)
    assert len(diagram.edges) == len(graph.edges)
    for edge in diagram.edges:
        pts = _points(edge.path)
        src, dst = boxes[edge.source], boxes[edge.target]
        assert pts[0][0] == pytest.approx(src.x + BOX_W)  # leaves from the right side
        assert pts[-1][0] == pytest.approx(dst.x)  # arrives at the left side (arrowhead)
        for x, y in pts:
            for b in diagram.boxes:
                inside = b.x + 0.5 < x < b.x + BOX_W - 0.5 and b.y + 0.5 < y < b.y + BOX_H - 0.5
                assert not inside, f"{edge.source}->{edge.target} crosses {b.node}"
            assert 0 <= x <= diagram.width
            assert 0 <= y <= diagram.height


def test_boxes_never_overlap_and_ports_are_distinct() -> None:
    for _, graph in _graphs():
        d = layout(graph)
        for i, a in enumerate(d.boxes):
            for b in d.boxes[i + 1:]:
                assert abs(a.x - b.x) >= BOX_W or abs(a.y - b.y) >= BOX_H
        starts = [(e.source, _points(e.path)[0]) for e in d.edges]
        assert len(set(starts)) == len(starts)  # no fan-out from one point


@pytest.mark.parametrize("topology", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_dags_fit_the_page(topology: Path) -> None:
    assert layout(plan_topology(topology, REPO / "prompts").manifest.dag()).width <= PAGE_WIDTH


def _luminance(hex_colour: str) -> float:
    def channel(v: int) -> float:
        c = v / 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (int(hex_colour[i: i + 2], 16) for i in (1, 3, 5))
    return 0.2126 * channel(r) + 0.7152 * channel(g) + 0.0722 * channel(b)


def _contrast(a: str, b: str) -> float:
    hi, lo = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


@pytest.mark.parametrize("status", sorted(STATUS_STYLE))
def test_diagram_labels_meet_wcag_aa(status: str) -> None:
    fill = STATUS_STYLE[status]["fill"]
    for text in ("#1f2328", "#424a53"):  # label and detail colours in dag.svg.j2
        assert _contrast(text, fill) >= 4.5, (status, text)
    assert _contrast(STATUS_STYLE[status]["stroke"], "#ffffff") >= 3.0  # WCAG 1.4.11


def test_status_is_not_told_by_colour_alone() -> None:
    symbols = {s["symbol"] for s in STATUS_STYLE.values()}
    borders = {(s["dash"], s["width"]) for s in STATUS_STYLE.values()}
    assert len(symbols) == len(STATUS_STYLE)  # each status has its own symbol (and word)
    assert len(borders) >= 4


# -- headless Chromium ------------------------------------------------------------------

def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _dump_dom(page: Path, profile: Path) -> str:
    browser = _chromium()
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed; .ci/run installs it")
        pytest.skip("chromium not installed (apt-get install chromium)")
    proc = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--no-first-run", f"--user-data-dir={profile}", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.slow
def test_reports_render_in_headless_chromium(run_dir: Path, project: Project,
                                             tmp_path: Path) -> None:
    page = render_run_report(run_dir)
    html = _dump_dom(page, tmp_path / "profile")
    dom = _parse(html)
    _check_run_dom(dom, run_dir)
    _check_links(dom, page)
    _check_no_host_path(html, project.root)
    batch = _render_batch(project)
    html = _dump_dom(batch, tmp_path / "profile")
    dom = _parse(html)
    _check_batch_dom(dom, batch)
    _check_no_host_path(html, project.root)


def test_findings_table_is_bounded_most_severe_first() -> None:
    from runtime.report.findings import Finding
    from runtime.report.html import _env

    def finding(level: str) -> Finding:
        return Finding(level=level, rule="R", location="a.py:1", message="m", topology="t",  # type: ignore[arg-type]
                       node="n", attempt=1, profile="p", run_id="r", artifact="a.sarif",
                       fingerprint="f")

    table = _env().get_template("macros.html.j2").module.findings_table  # type: ignore[attr-defined]
    html = str(table([finding("error"), finding("note"), finding("note")], lambda f: None,
                     False, 2))
    assert html.count('class="finding"') == 2
    assert 'id="findings-more">1 more' in html


def test_report_shows_what_the_ledger_says_not_a_forged_attempt_record(run_dir: Path) -> None:
    """attempt.json is reachable by an unsandboxed agent; the report reads the ledger instead."""
    record = run_dir / "nodes" / "b" / "attempts" / "2" / "attempt.json"
    real = next(e for e in read_events(run_dir / "ledger.jsonl")
                if isinstance(e, AttemptStarted) and (e.node, e.attempt) == ("b", 2))
    assert real.preamble_digest is not None  # b retried with feedback: its preamble is shown
    record.chmod(0o644)
    record.write_text(record.read_text().replace(real.preamble_digest, "f0f0" * 16))
    html = render_run_report(run_dir).read_text()
    assert "f0f0f0f0" not in html
    assert real.preamble_digest[:16] in html
