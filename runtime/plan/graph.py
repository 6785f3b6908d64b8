"""Text renderings of a topology's DAG: Mermaid (default) and Graphviz DOT."""

from __future__ import annotations

import json

from runtime.plan.manifest import Manifest


def to_mermaid(manifest: Manifest) -> str:
    """A Mermaid flowchart; nodes that opt into retry feedback are marked."""
    ids = {nid: f"n{i}" for i, nid in enumerate(manifest.nodes)}
    lines = ["flowchart TD"]
    for nid, node in manifest.nodes.items():
        mark = " (retry feedback)" if node.retry_feedback else ""
        lines.append(f'  {ids[nid]}["{nid}{mark}"]')
    for nid, node in manifest.nodes.items():
        lines += [f"  {ids[up]} --> {ids[nid]}" for up in node.needs]
    return "\n".join(lines) + "\n"


def to_dot(manifest: Manifest) -> str:
    """A Graphviz digraph; ids are JSON-quoted, which DOT accepts as strings."""
    lines = [f"digraph {json.dumps(manifest.topology.name)} {{", "  rankdir=TB;"]
    for nid, node in manifest.nodes.items():
        style = ", style=bold" if node.retry_feedback else ""
        lines.append(f"  {json.dumps(nid)} [shape=box{style}];")
    for nid, node in manifest.nodes.items():
        lines += [f"  {json.dumps(up)} -> {json.dumps(nid)};" for up in node.needs]
    lines.append("}")
    return "\n".join(lines) + "\n"
