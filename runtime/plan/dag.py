"""A plan's node graph, as the scheduler and the reports read it.

Planning checks the graph with the standard library's ``graphlib`` and asks networkx
only to explain a cycle (``topology.py``). Running and reporting need four things of a
valid graph: each node's upstream and downstream nodes, its descendants, and one
deterministic topological order. They are answered here so that ``runtime run`` does
not import networkx, 285 modules and about 100 ms of every start.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Dag:
    """Edges upstream -> downstream. Nodes, ``pred`` and ``succ`` keep insertion order.

    Args:
        pred: each node's upstream nodes (its needs, in the order declared).
        succ: each node's downstream nodes, in the order their edges were added.
    """

    pred: Mapping[str, tuple[str, ...]]
    succ: Mapping[str, tuple[str, ...]]

    @classmethod
    def of(cls, needs: Iterable[tuple[str, Iterable[str]]]) -> Dag:
        """The graph of ``(node, its needs)`` pairs, nodes in the order they first appear."""
        pred: dict[str, list[str]] = {}
        succ: dict[str, list[str]] = {}
        for nid, ups in needs:
            pred.setdefault(nid, [])
            succ.setdefault(nid, [])
            for up in ups:
                pred.setdefault(up, [])
                succ.setdefault(up, []).append(nid)
                pred[nid].append(up)
        return cls(pred={n: tuple(u) for n, u in pred.items()},
                   succ={n: tuple(d) for n, d in succ.items()})

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every node, in insertion order."""
        return tuple(self.pred)

    @property
    def edges(self) -> list[tuple[str, str]]:
        """Every edge ``(upstream, downstream)``, grouped by upstream node."""
        return [(u, v) for u, downs in self.succ.items() for v in downs]

    def order(self) -> list[str]:
        """The topological order that takes the smallest ready id first.

        The same order as networkx's ``lexicographical_topological_sort`` (a test checks it
        on random graphs): the scheduler starts nodes in it, and reports list them in it.
        """
        waiting = {n: len(ups) for n, ups in self.pred.items()}
        ready = [n for n, count in waiting.items() if count == 0]
        heapq.heapify(ready)
        out: list[str] = []
        while ready:
            node = heapq.heappop(ready)
            out.append(node)
            for child in self.succ[node]:
                waiting[child] -= 1
                if waiting[child] == 0:
                    heapq.heappush(ready, child)
        if len(out) != len(waiting):
            raise ValueError("the graph has a cycle")  # a plan's never does (checked)
        return out

    def descendants(self, node: str) -> set[str]:
        """Every node downstream of ``node``, however far."""
        seen: set[str] = set()
        stack = list(self.succ[node])
        while stack:
            n = stack.pop()
            if n not in seen:
                seen.add(n)
                stack.extend(self.succ[n])
        return seen
