"""The package's architecture (issue 12 item 2): no import cycles anywhere, and the
import-linter contracts in pyproject.toml (plan time never imports execution time,
reports read runs only through the read side, no layer imports one above it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grimp
import networkx as nx

REPO = Path(__file__).resolve().parent.parent


def test_no_module_imports_itself_back() -> None:
    """Function-level and TYPE_CHECKING imports count: a cycle hidden in a function is
    still two modules that cannot be understood, or moved, apart."""
    graph = grimp.build_graph("runtime", include_external_packages=False)
    edges: nx.DiGraph[str] = nx.DiGraph()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            edges.add_edge(module, imported)
    assert list(nx.simple_cycles(edges)) == []


def test_import_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([str(lint), "--config", str(REPO / "pyproject.toml")], cwd=REPO,
                          env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout
