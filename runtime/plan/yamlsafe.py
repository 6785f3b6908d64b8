"""Safe YAML loading with source lines, duplicate-key detection and an alias-bomb guard.

PyYAML's safe loader never builds arbitrary objects, but it expands aliases while
constructing, so a few hundred bytes of nested anchors ("billion laughs") can take all
memory. We compose the node graph first (aliases stay shared references there),
measure how large the document would be once expanded, refuse it above a bound, and
only then construct Python objects. The composed graph also gives each field's line.

PyYAML's safe loader (YAML 1.1, libyaml's parser) is the only parser, at every file
size. An earlier rapidyaml fast path for files over 256 KiB made acceptance depend on
size: fuzzing generated documents that passed its screen found rapidyaml accepting
~150 in 30,000 that PyYAML refuses (plain scalars starting with `]` or `}`, `?` and
`x:` inside flow sequences, ...), and its C++ error handler wrote to stderr. Nesting is
bounded (``MAX_DEPTH``) in the same pass that bounds alias expansion, before anything
is constructed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from runtime.errors import Problem

try:  # libyaml's parser is ~10x faster; construction stays PyYAML's safe constructor.
    _Loader: type[yaml.SafeLoader] = yaml.CSafeLoader  # type: ignore[assignment]
except AttributeError:  # pragma: no cover - wheels ship libyaml on our platforms
    _Loader = yaml.SafeLoader

MAX_BYTES = 64 * 1024 * 1024
MAX_EXPANDED_NODES = 20_000_000
# Deeper than any topology needs (a JSON Schema inside an artifact sits ~10 levels
# down), and shallow enough that nothing downstream (pydantic, json, jsonschema)
# recurses anywhere near Python's recursion limit.
MAX_DEPTH = 64


Path_ = tuple[str | int, ...]


@dataclass(frozen=True)
class LoadedYaml:
    """A parsed document and its composed node graph, kept to look up lines."""

    data: Any
    root: yaml.Node | None = field(repr=False, compare=False)

    def line_of(self, path: Path_) -> int:
        """1-based line of the value at ``path`` (or of its nearest ancestor found)."""
        node = self.root
        line = node.start_mark.line + 1 if node is not None else 0
        for part in path:
            child = _child(node, part)
            if child is None:
                break
            node = child
            line = node.start_mark.line + 1
        return line


def _child(node: yaml.Node | None, part: str | int) -> yaml.Node | None:
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.value == str(part):
                found: yaml.Node = value
                return found
    if isinstance(node, yaml.SequenceNode) and isinstance(part, int) \
            and 0 <= part < len(node.value):
        item: yaml.Node = node.value[part]
        return item
    return None


def load_yaml(raw: bytes, file: str) -> tuple[LoadedYaml | None, list[Problem]]:
    """Parse ``raw`` as one YAML document; return it or the problems that stop it."""
    if len(raw) > MAX_BYTES:
        return None, [Problem(file, 0, "", f"file is {len(raw)} bytes; at most {MAX_BYTES}")]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        return None, [
            Problem(file, line, "", f"not UTF-8 (byte 0x{raw[exc.start]:02x} at offset "
                    f"{exc.start}); save the file as UTF-8")
        ]
    loader = _Loader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return LoadedYaml(None, None), []
        problems = _check_graph(root, file)
        if problems:
            return None, problems
        data = loader.construct_document(root)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 0
        return None, [Problem(file, line, "", f"invalid YAML: {exc.problem or exc}")]
    except yaml.YAMLError as exc:
        return None, [Problem(file, 0, "", f"invalid YAML: {exc}")]
    finally:
        loader.dispose()
    return LoadedYaml(data, root), []


def _check_graph(root: yaml.Node, file: str) -> list[Problem]:
    """Refuse alias bombs, recursive aliases, deep nesting and duplicate keys, in one pass.

    Deep nesting means past ``MAX_DEPTH``.
    """
    problems: list[Problem] = []
    sizes: dict[int, int] = {}
    depths: dict[int, int] = {}
    active: set[int] = set()
    # Iterative post-order walk: documents with 100k nodes nest deeper than recursion allows.
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            active.discard(key)
            children = _children(node)
            sizes[key] = 1 + sum(sizes[id(c)] for c in children)
            if sizes[key] > MAX_EXPANDED_NODES:
                return [Problem(file, node.start_mark.line + 1, "",
                                f"YAML aliases expand to more than {MAX_EXPANDED_NODES} "
                                "nodes; refusing to expand (alias bomb?)")]
            if not isinstance(node, yaml.ScalarNode):
                depths[key] = 1 + max((depths[id(c)] for c in children), default=0)
                if depths[key] > MAX_DEPTH:
                    return [Problem(file, node.start_mark.line + 1, "",
                                    f"mappings and lists nest more than {MAX_DEPTH} levels "
                                    "deep; flatten the document")]
            else:
                depths[key] = 0
            continue
        if key in sizes:
            continue
        if key in active:
            return [Problem(file, node.start_mark.line + 1, "", "recursive YAML alias")]
        active.add(key)
        stack.append((node, True))
        if isinstance(node, yaml.MappingNode):
            problems.extend(_duplicate_keys(node, file))
        stack.extend((c, False) for c in _children(node) if id(c) not in sizes)
    return problems


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _duplicate_keys(node: yaml.MappingNode, file: str) -> list[Problem]:
    seen: set[str] = set()
    out = []
    for key, _ in node.value:
        if not isinstance(key, yaml.ScalarNode):
            continue
        if key.value in seen:
            out.append(Problem(file, key.start_mark.line + 1, str(key.value),
                               "duplicate key; each key may appear once per mapping"))
        seen.add(key.value)
    return out
