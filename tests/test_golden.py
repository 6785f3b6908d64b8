"""Shipped topologies must reproduce their reviewed digests (tests/golden/*.json)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.plan.compile import plan_topology
from runtime.plan.verify import diff_golden, golden_of, read_golden
from tests.conftest import REPO

SHIPPED = sorted((REPO / "topologies").glob("*.yaml"))


@pytest.mark.parametrize("topology", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_topology_matches_its_golden_digests(topology: Path) -> None:
    golden_path = REPO / "tests" / "golden" / f"{topology.stem}.json"
    update = (f"if the change is intended, run: runtime plan topologies/{topology.name} "
              f"--golden-out tests/golden/{topology.stem}.json")
    assert golden_path.is_file(), f"no golden file; {update}"
    golden = read_golden(golden_path)
    plan = plan_topology(topology, REPO / "prompts", dict(golden.vars))
    differences = diff_golden(golden, golden_of(plan, dict(golden.vars)))
    assert not differences, "\n".join([*differences, update])


def test_every_shipped_topology_has_a_retry_feedback_node() -> None:
    for topology in SHIPPED:
        manifest = plan_topology(topology, REPO / "prompts").manifest
        assert any(n.retry_feedback for n in manifest.nodes.values()), topology.name
        assert all(n.artifacts for n in manifest.nodes.values()), topology.name


def test_no_stale_golden_files() -> None:
    stems = {p.stem for p in SHIPPED}
    stale = [p.name for p in (REPO / "tests" / "golden").glob("*.json") if p.stem not in stems]
    assert not stale, f"golden files without a topology: {stale}"
