"""Per-attempt overhead of ``--engine ray`` against the local engine (issue 14).

One plan of N independent nodes on a ``command`` agent that writes its artifact with
``sh`` (unsandboxed: the sandbox costs the same on either engine), run with the same
``--jobs`` on the local engine and on a local Ray started here. Ray's start-up (its
``ray.init`` and a small warm-up run that starts the workers) is reported apart.
Printed: milliseconds per attempt for each engine and their ratio (goal in issue 14:
ray <= 2x local), and the same on Ray with a profile that requests a custom resource
(each such attempt first checks that a live node offers it: one ``ray.nodes()`` call).

    python benchmarks/engines.py [--nodes 100] [--jobs 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runtime.plan import plan_topology, write_plan  # noqa: E402
from runtime.records import RunSettings  # noqa: E402
from runtime.redact import Redactor  # noqa: E402
from runtime.run import Hooks, start_run  # noqa: E402


def _plan(root: Path, nodes: int, resources: dict[str, float] | None = None) -> Path:
    (root / "prompts").mkdir(parents=True)
    (root / "prompts" / "t.md.j2").write_text("Task {{ node.id }}.\n")
    topo = {"schema_version": 1, "name": "bench",
            "agents": {"sh": {"kind": "command", "sandbox": False, "argv": [
                "sh", "-c", 'printf "{}" > "$RUNTIME_NODE.json"'],
                **({"resources": resources} if resources else {})}},
            "defaults": {"agent": "sh"},
            "nodes": [{"id": f"n{i}", "prompt": "t.md.j2",
                       "artifacts": [{"path": f"n{i}.json", "kind": "json"}]}
                      for i in range(nodes)]}
    (root / "t.yaml").write_text(yaml.safe_dump(topo))
    return write_plan(plan_topology(root / "t.yaml", root / "prompts"), root / "artifacts")


def _per_attempt(plan: Path, root: Path, run_id: str, jobs: int, hooks: Hooks,
                 nodes: int) -> float:
    started = time.perf_counter()
    result = start_run(plan, root / "artifacts", RunSettings(jobs=jobs), run_id=run_id,
                       redactor=Redactor.from_environment({}), hooks=hooks, verified=True)
    elapsed = time.perf_counter() - started
    assert result.status == "succeeded", result.status
    return elapsed / nodes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        plan = _plan(root, args.nodes)
        local = _per_attempt(plan, root, "local", args.jobs, Hooks(), args.nodes)
        import ray

        from runtime.ray_engine import RayEngine

        t0 = time.perf_counter()
        ray.init(num_cpus=args.jobs, resources={"bench": args.jobs}, include_dashboard=False,
                 log_to_driver=False)
        engine = RayEngine()
        # A first small run starts the workers and imports the runtime in them: that is
        # start-up, like ray.init, not per-attempt overhead.
        warm = _plan(root / "warm", args.jobs * 2)
        _per_attempt(warm, root / "warm", "warm", args.jobs, Hooks(engine=engine), args.jobs * 2)
        startup = time.perf_counter() - t0
        try:
            remote = _per_attempt(plan, root, "ray", args.jobs, Hooks(engine=engine),
                                  args.nodes)
            limited_plan = _plan(root / "res", args.nodes, {"bench": 1})
            limited = _per_attempt(limited_plan, root / "res", "res", args.jobs,
                                   Hooks(engine=engine), args.nodes)
        finally:
            ray.shutdown()
    print(f"{args.nodes} nodes, --jobs {args.jobs}")
    print(f"local engine   {local * 1000:8.1f} ms/attempt")
    print(f"ray engine     {remote * 1000:8.1f} ms/attempt  (start-up {startup:.1f} s apart)")
    print(f"ratio ray/local {remote / local:6.2f}  (goal <= 2.0)")
    print(f"ray, resources {limited * 1000:8.1f} ms/attempt  (ratio to ray {limited / remote:.2f})")


if __name__ == "__main__":
    main()
