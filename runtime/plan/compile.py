"""Topology -> sealed plan: content-addressed prompts plus a canonical manifest.

``compile_plan`` is pure (templates are read, nothing is written); ``write_plan`` is the
I/O edge. The manifest's canonical JSON is ``plan.json`` byte for byte, so
``blake3(plan.json)`` is the plan digest (DESIGN section 4). The manifest holds no
time stamp, host name or absolute path.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from runtime.digest import PLAN_DIR_PREFIX_LEN, blake3_hex, canonical_json
from runtime.errors import PlanFormatError
from runtime.files import write_read_only
from runtime.plan.profiles import BUILTIN_PROFILES
from runtime.plan.render import (
    RENDER_MAX_BYTES,
    RENDER_TIMEOUT_S,
    Renderer,
    RenderLimits,
    node_context,
)
from runtime.plan.topology import Topology
from runtime.prompt.assemble import constant_digests

if TYPE_CHECKING:
    pass
from runtime.plan.manifest import MANIFEST_NAME, PROMPTS_DIR, CompiledPlan, Manifest

_INHERITED = ("max_attempts", "retry_feedback", "retry_on", "timeout_s", "backoff_s",
              "feedback_max_bytes")


def compile_plan(topo: Topology, renderer: Renderer) -> CompiledPlan:
    """Render every node's prompt and build the manifest. Reads templates; writes nothing.

    The manifest is built as plain JSON data from the validated topology's dump (one
    pass in pydantic-core), hashed, then validated once as a ``Manifest``: per-node model
    construction and re-serialisation cost more than rendering on 100k-node plans.
    """
    by_id = {n.id: n for n in topo.nodes}
    dumped = topo.model_dump(mode="json", by_alias=True)
    defaults = dumped["defaults"]
    for key in RENDER_LIMIT_KEYS:  # unset: not in the digest (shipped digests unchanged)
        if defaults[key] is None:
            del defaults[key]
    prompts: dict[str, bytes] = {}
    nodes: dict[str, dict[str, Any]] = {}
    for node, raw in zip(topo.nodes, dumped["nodes"], strict=True):
        data = renderer.render(node.prompt, node_context(topo, node, by_id), node.id).encode()
        digest = blake3_hex(data)
        prompts[digest] = data
        entry = {key: defaults[key] if raw[key] is None else raw[key] for key in _INHERITED}
        agent = raw["agent"] or defaults["agent"]
        if raw["timeout_s"] is None:  # the node's own, else its profile's, else the default
            profile = topo.agents.get(agent) or BUILTIN_PROFILES.get(agent)
            if profile is not None and profile.timeout_s is not None:
                entry["timeout_s"] = profile.timeout_s
        entry.update(prompt_digest=digest, template=raw["prompt"], needs=raw["needs"],
                     agent=agent, fallback=raw["fallback"],
                     objective=raw["objective"], acceptance=raw["acceptance"],
                     artifacts=raw["artifacts"])
        nodes[node.id] = entry
    data_ = {
        "schema_version": 1,
        "topology": {"name": topo.name, "description": topo.description,
                     "digest": blake3_hex(canonical_json(dumped))},
        "vars": dumped["vars"],
        "agents": {**{k: v.model_dump(mode="json") for k, v in BUILTIN_PROFILES.items()},
                   **dumped["agents"]},
        "constants": constant_digests(),
        "nodes": nodes,
    }
    raw_bytes = canonical_json(data_)
    return CompiledPlan(Manifest.model_validate(data_), raw_bytes, MappingProxyType(prompts))


def write_plan(plan: CompiledPlan, artifacts_root: Path) -> Path:
    """Write ``plan`` under ``artifacts/plans/<digest-prefix>/`` once; return that directory.

    The directory is built under a temporary name and renamed into place, so a reader
    never sees half a plan. If it already exists it must verify clean and is reused.
    """
    plans = artifacts_root / "plans"
    plans.mkdir(parents=True, exist_ok=True)
    final = plans / plan.digest[:PLAN_DIR_PREFIX_LEN]
    if final.exists():
        _reuse_existing(final, plan.digest)
        return final
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=plans))
    try:
        (tmp / PROMPTS_DIR).mkdir()
        for digest, data in plan.prompts.items():
            write_read_only(tmp / PROMPTS_DIR / f"{digest}.md", data)
        write_read_only(tmp / MANIFEST_NAME, plan.manifest_bytes)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.exists():
                raise
            _reuse_existing(final, plan.digest)  # a concurrent planner won the race
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _reuse_existing(plan_dir: Path, digest: str) -> None:
    from runtime.plan.verify import verify_plan_dir  # verify imports this module

    problems = verify_plan_dir(plan_dir, expected_digest=digest)
    if problems:
        raise PlanFormatError(plan_dir, "a plan with this digest exists but does not verify "
                              "(" + "; ".join(problems[:5]) + "); move it aside and plan again")


def plan_topology(path: Path, prompts_root: Path, overrides: dict[str, str] | None = None,
                  ) -> CompiledPlan:
    """Load, validate and compile a topology file (reads only; writes nothing)."""
    from runtime.plan.topology import load_topology

    with _collector_paused():
        topo = load_topology(path, prompts_root, overrides)
        return compile_plan(topo, Renderer(prompts_root, render_limits(topo)))


RENDER_LIMIT_KEYS = ("render_timeout_s", "render_max_bytes")


def render_limits(topo: Topology) -> RenderLimits:
    """The topology's per-template render bounds, the runtime's defaults where unset."""
    d = topo.defaults
    return RenderLimits(
        timeout_s=d.render_timeout_s if d.render_timeout_s is not None else RENDER_TIMEOUT_S,
        max_bytes=d.render_max_bytes if d.render_max_bytes is not None else RENDER_MAX_BYTES)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while planning.

    Planning allocates millions of small acyclic objects; the cyclic collector's repeated
    full passes over them made 100k-node plans grow superlinearly.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
