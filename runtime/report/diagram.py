"""Layered drawing of a DAG for the HTML report: coordinates only, no markup.

Left to right, one column per layer (longest path from a source), so a deep topology
grows sideways and a wide one downwards. An edge that skips layers passes through a
reserved slot in every column between its ends (Sugiyama's virtual nodes), so no edge
crosses a node box: between columns an edge is a curve that stays inside the gap, and
inside a column it runs through its own slot. A few barycentre sweeps order each column
to keep edges from crossing each other. Each box has one port per edge on its left
(incoming) and right (outgoing) side, in the order of the other ends, so edges never
fan out from one point.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from runtime.plan.dag import Dag

BOX_W, BOX_H = 148, 58
GAP_X, GAP_Y = 36, 12
SLOT_H = 16  # height reserved in a column for an edge passing through it
PAD = 12
SWEEPS = 4


@dataclass(frozen=True)
class Box:
    """A node's box, placed: its top-left corner in SVG user units."""
    node: str
    x: float
    y: float


@dataclass(frozen=True)
class Edge:
    """An edge from ``source`` to ``target``, as an SVG path."""
    source: str
    target: str
    path: str


@dataclass(frozen=True)
class Diagram:
    """A laid-out DAG, ready to draw as SVG."""
    width: int
    height: int
    boxes: list[Box]
    edges: list[Edge]
    box_w: int = BOX_W
    box_h: int = BOX_H


def _layers(graph: Dag, order: list[str]) -> dict[str, int]:
    layer: dict[str, int] = {}
    for nid in order:
        layer[nid] = max((layer[u] + 1 for u in graph.pred[nid]), default=0)
    return layer


def _virtualise(graph: Dag, order: list[str], layer: dict[str, int],
                ) -> tuple[list[list[str]], dict[tuple[str, str], list[str]],
                           dict[str, list[str]], dict[str, list[str]]]:
    """Columns of real and virtual nodes; each edge's chain of virtual nodes."""
    columns: list[list[str]] = [[] for _ in range(max(layer.values(), default=0) + 1)]
    for nid in order:
        columns[layer[nid]].append(nid)
    rank = {n: i for i, n in enumerate(order)}
    chains: dict[tuple[str, str], list[str]] = {}
    succ: dict[str, list[str]] = defaultdict(list)
    pred: dict[str, list[str]] = defaultdict(list)
    for u, v in sorted(graph.edges, key=lambda e: (rank[e[0]], rank[e[1]])):
        prev, chain = u, []
        for col in range(layer[u] + 1, layer[v]):
            dummy = f"\0{u}\0{v}\0{col}"  # NUL never occurs in a node id
            columns[col].append(dummy)
            succ[prev].append(dummy)
            pred[dummy].append(prev)
            chain.append(dummy)
            prev = dummy
        succ[prev].append(v)
        pred[v].append(prev)
        chains[(u, v)] = chain
    return columns, chains, succ, pred


def _order(columns: list[list[str]], succ: dict[str, list[str]],
           pred: dict[str, list[str]]) -> None:
    """Barycentre sweeps, down then up; stable, so ties keep topological order."""
    pos = {n: i for col in columns for i, n in enumerate(col)}

    def sweep(col: list[str], neighbours: dict[str, list[str]]) -> None:
        def key(n: str) -> float:
            near = neighbours.get(n, [])
            return sum(pos[m] for m in near) / len(near) if near else float(pos[n])

        col.sort(key=key)
        for i, n in enumerate(col):
            pos[n] = i

    for _ in range(SWEEPS):
        for col in columns[1:]:
            sweep(col, pred)
        for col in reversed(columns[:-1]):
            sweep(col, succ)


def layout(graph: Dag) -> Diagram:
    """Place every node of ``graph`` and route every edge."""
    order = graph.order()
    if not order:
        return Diagram(width=2 * PAD, height=2 * PAD, boxes=[], edges=[])
    layer = _layers(graph, order)
    columns, chains, succ, pred = _virtualise(graph, order, layer)
    _order(columns, succ, pred)

    def slot(n: str) -> float:
        return SLOT_H if n.startswith("\0") else BOX_H + GAP_Y

    tallest = max(sum(slot(n) for n in col) for col in columns)
    y: dict[str, float] = {}
    for col in columns:
        top = PAD + (tallest - sum(slot(n) for n in col)) / 2  # centre each column
        for n in col:
            y[n] = top
            top += slot(n)
    x: dict[str, float] = {n: PAD + i * (BOX_W + GAP_X) for i, col in enumerate(columns)
                           for n in col}
    boxes = [Box(node=n, x=x[n], y=y[n]) for n in order]
    edges = _route(graph, chains, x, y)
    width = int(PAD * 2 + len(columns) * BOX_W + (len(columns) - 1) * GAP_X)
    return Diagram(width=width, height=int(tallest - GAP_Y + 2 * PAD), boxes=boxes,
                   edges=edges)


def _route(graph: Dag, chains: dict[tuple[str, str], list[str]],
           x: dict[str, float], y: dict[str, float]) -> list[Edge]:
    def centre(n: str) -> float:
        return y[n] + (SLOT_H / 2 if n.startswith("\0") else BOX_H / 2)

    def first_hop(u: str, v: str) -> str:
        return (chains[(u, v)] or [v])[0]

    def last_hop(u: str, v: str) -> str:
        return (chains[(u, v)] or [u])[-1]

    out_port: dict[tuple[str, str], float] = {}
    in_port: dict[tuple[str, str], float] = {}
    for n in graph.nodes:
        outs = sorted(graph.succ[n], key=functools.partial(_after, centre, first_hop, n))
        for i, v in enumerate(outs):
            out_port[(n, v)] = y[n] + BOX_H * (i + 1) / (len(outs) + 1)
        ins = sorted(graph.pred[n], key=functools.partial(_before, centre, last_hop, n))
        for i, u in enumerate(ins):
            in_port[(u, n)] = y[n] + BOX_H * (i + 1) / (len(ins) + 1)
    edges = []
    for (u, v), chain in chains.items():
        px, py = x[u] + BOX_W, out_port[(u, v)]
        parts = [f"M{px:g} {py:g}"]
        for d in chain:
            parts.append(_curve(px, py, x[d], centre(d)))
            parts.append(f"L{x[d] + BOX_W:g} {centre(d):g}")
            px, py = x[d] + BOX_W, centre(d)
        parts.append(_curve(px, py, x[v], in_port[(u, v)]))
        edges.append(Edge(source=u, target=v, path=" ".join(parts)))
    return edges


def _after(centre: Callable[[str], float], hop: Callable[[str, str], str], n: str,
           v: str) -> float:
    return centre(hop(n, v))


def _before(centre: Callable[[str], float], hop: Callable[[str, str], str], n: str,
            u: str) -> float:
    return centre(hop(u, n))


def _curve(x1: float, y1: float, x2: float, y2: float) -> str:
    """A cubic from the right side of one column to the left side of the next.

    Both control points lie between them, so the curve stays inside the gap.
    """
    mid = (x1 + x2) / 2
    return f"C{mid:g} {y1:g} {mid:g} {y2:g} {x2:g} {y2:g}"
