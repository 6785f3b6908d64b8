from __future__ import annotations

import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from runtime.report import render_run_report
from tests.conftest import Project, make_topology, python_agents, run_topology

EVIL = '<script>alert(1)</script><img src="http://evil.example/x.png">'


@pytest.fixture
def run_dir(project: Project) -> Path:
    topo = make_topology({"a": [], "b": ["a"], "c": ["b"]}, b={"retry_feedback": True})
    topo["agents"] = {**python_agents("write_all", "fail_first", "always_exit_2"),
                      "sim": {"kind": "simulated"}}
    topo["defaults"] = {"agent": "write_all"}
    topo["nodes"][1]["agent"] = "fail_first"
    topo["nodes"].append({"id": "d", "prompt": "task.md.j2", "agent": "always_exit_2",
                          "max_attempts": 1})
    topo["nodes"].append({"id": "e", "prompt": "task.md.j2", "needs": ["d"]})
    project.template("task.md.j2", "Task {{ node.id }} " + EVIL + "\n")
    return Path(run_topology(project, topo).run_dir)


class _Dom(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.nodes: dict[str, str] = {}
        self.tags: list[tuple[str, dict[str, Any]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.tags.append((tag, a))
        if tag == "g" and a.get("data-node"):
            self.nodes[str(a["data-node"])] = str(a.get("data-status"))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _check_dom(dom: _Dom) -> None:
    assert dom.nodes == {"a": "succeeded", "b": "succeeded", "c": "succeeded",
                         "d": "failed", "e": "skipped"}
    tags = [t for t, _ in dom.tags]
    assert "script" not in tags and "img" not in tags  # the agent's markup stayed text
    assert any(t == "details" and a.get("class") == "preamble" for t, a in dom.tags)
    text = "".join(dom.text)
    assert EVIL in text and "prior-failure-v1" in text
    assert "upstream d failed" in text


def test_report_html_is_escaped_and_complete(run_dir: Path) -> None:
    html = render_run_report(run_dir).read_text()
    assert "default-src 'none'" in html
    dom = _Dom()
    dom.feed(html)
    _check_dom(dom)
    links = [v for _, attrs in dom.tags for k, v in attrs.items()
             if k in ("src", "href") and v and "://" in v]
    assert links == []  # nothing is fetched: the report is self-contained


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.slow
def test_report_renders_in_headless_chromium(run_dir: Path, tmp_path: Path) -> None:
    browser = _chromium()
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed; .ci/run installs it")
        pytest.skip("chromium not installed (apt-get install chromium)")
    report = render_run_report(run_dir)
    proc = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom",
         report.as_uri()],
        capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = _Dom()
    dom.feed(proc.stdout)
    _check_dom(dom)
