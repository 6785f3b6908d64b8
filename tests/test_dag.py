"""The plan's node graph answers what networkx would, without importing it at run time."""

from __future__ import annotations

import random

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.plan.dag import Dag


def _random_dag(n: int, pairs: list[tuple[int, int]], names: list[str]) -> list[tuple[str,
                                                                                   list[str]]]:
    """``(node, needs)`` in a shuffled order; an edge only from a lower to a higher index."""
    needs: dict[str, list[str]] = {names[i]: [] for i in range(n)}
    for a, b in pairs:
        lo, hi = sorted((a, b))
        if lo != hi and names[lo] not in needs[names[hi]]:
            needs[names[hi]].append(names[lo])
    order = list(needs)
    random.Random(len(pairs)).shuffle(order)
    return [(nid, needs[nid]) for nid in order]


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=14).flatmap(lambda n: st.tuples(
    st.just(n), st.lists(st.tuples(st.integers(0, max(n - 1, 0)),
                                   st.integers(0, max(n - 1, 0))), max_size=3 * n),
    st.permutations([f"n{i:02d}" for i in range(n)]))))
def test_agrees_with_networkx(graph: tuple[int, list[tuple[int, int]], list[str]]) -> None:
    n, pairs, names = graph
    needs = _random_dag(n, pairs, names)
    dag = Dag.of(needs)
    nxg: nx.DiGraph[str] = nx.DiGraph()
    for nid, ups in needs:  # as Manifest.dag() built it before
        nxg.add_node(nid)
        nxg.add_edges_from((up, nid) for up in ups)
    assert dag.order() == list(nx.lexicographical_topological_sort(nxg))
    assert list(dag.nodes) == list(nxg.nodes)
    assert dag.edges == list(nxg.edges)
    for nid in dag.nodes:
        assert list(dag.pred[nid]) == list(nxg.pred[nid])
        assert list(dag.succ[nid]) == list(nxg.succ[nid])
        assert dag.descendants(nid) == nx.descendants(nxg, nid)


def test_a_cycle_has_no_order() -> None:
    with pytest.raises(ValueError, match="cycle"):
        Dag.of([("a", ["b"]), ("b", ["a"])]).order()
