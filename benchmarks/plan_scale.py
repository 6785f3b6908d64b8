"""Planning throughput on synthetic 10k- and 100k-node topologies, against a floor.

Each measurement is a whole process (`python -m runtime plan ...`), the way users run
it. The floor, measured in the same run, is a process that renders the same prompts
with jinja2, hashes them with blake3 and writes them, with no YAML, validation, graph
checks or manifest. File creation on shared machines stalls now and then, so each case
reports the best of --repeat runs. Usage:

    python benchmarks/plan_scale.py [--sizes 10000 100000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEMPLATE = """\
# {{ topology.name }}: {{ node.id }}
Analyse {{ vars.target }} for {{ objective }}.
{% for up in needs %}{% for a in up.artifacts %}- read {{ a.input_path }}
{% endfor %}{% endfor %}Write {% for a in node.artifacts %}{{ a.path }} {% endfor %}
"""

WIDTH = 20


def node_ids(n: int) -> list[str]:
    return [f"n{i:06d}" for i in range(n)]


def needs_of(i: int) -> list[int]:
    """Layered DAG, WIDTH wide: each node needs one or two nodes of the previous layer."""
    if i < WIDTH:
        return []
    base = i - WIDTH
    return [base] if i % 3 else [base, base - base % WIDTH + (base + 1) % WIDTH]


def write_topology(n: int, path: Path) -> None:
    ids = node_ids(n)
    lines = ["schema_version: 1", f"name: synthetic-{n}", "vars: {target: contracts/}",
             "defaults: {agent: simulated}", "nodes:"]
    for i, nid in enumerate(ids):
        needs = ",".join(ids[j] for j in needs_of(i))
        lines.append(f"  - {{id: {nid}, prompt: t.md.j2, needs: [{needs}], objective: "
                     f"check {nid}, artifacts: [{{path: {nid}.json, kind: json}}]}}")
    path.write_text("\n".join(lines) + "\n")


FLOOR = r"""
import os, sys, blake3, jinja2
sys.path.insert(0, sys.argv[3])
from plan_scale import TEMPLATE, node_ids, needs_of
n, out = int(sys.argv[1]), sys.argv[2]
os.makedirs(out)
ids = node_ids(n)
tmpl = jinja2.Environment(keep_trailing_newline=True).from_string(TEMPLATE)
for i, nid in enumerate(ids):
    ctx = {"topology": {"name": f"synthetic-{n}"}, "vars": {"target": "contracts/"},
           "objective": f"check {nid}", "node": {"id": nid, "artifacts": [{"path": nid + ".json"}]},
           "needs": [{"id": ids[j], "artifacts": [{"input_path": f"inputs/{ids[j]}/{ids[j]}.json"}]}
                     for j in needs_of(i)]}
    data = tmpl.render(ctx).encode()
    name = os.path.join(out, blake3.blake3(data).hexdigest() + ".md")
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
    os.write(fd, data)
    os.close(fd)
"""


def timed(argv: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{argv[:4]} failed:\n{proc.stderr}")
    return elapsed


def measure(n: int, repeat: int, work: Path) -> dict[str, float]:
    case = work / f"n{n}"
    (case / "prompts").mkdir(parents=True)
    (case / "prompts" / "t.md.j2").write_text(TEMPLATE)
    write_topology(n, case / "topology.yaml")
    plan_times, floor_times = [], []
    for r in range(repeat):
        out = case / f"artifacts-{r}"
        plan_times.append(timed([sys.executable, "-m", "runtime", "plan",
                                 str(case / "topology.yaml"), "--prompts",
                                 str(case / "prompts"), "--artifacts", str(out)]))
        shutil.rmtree(out)
        floor_out = case / f"floor-{r}"
        floor_times.append(timed([sys.executable, "-c", FLOOR, str(n), str(floor_out),
                                  str(Path(__file__).parent)]))
        shutil.rmtree(floor_out)
    best, floor = min(plan_times), min(floor_times)
    return {"nodes": n, "plan_s": round(best, 3), "floor_s": round(floor, 3),
            "nodes_per_s": round(n / best), "ratio_to_floor": round(best / floor, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="plan-scale-") as tmp:
        results = [measure(n, args.repeat, Path(tmp)) for n in args.sizes]
    linearity: dict[str, float | str] | None = None
    if len(results) > 1:
        a, b = results[0], results[-1]
        growth = (b["plan_s"] / a["plan_s"]) / (b["nodes"] / a["nodes"])
        linearity = {"linearity": round(growth, 2),
                     "meaning": "time ratio / size ratio between the smallest and largest "
                                "size; 1.0 is linear"}
    if args.json:
        print(json.dumps([*results, linearity] if linearity else results, indent=2))
        return
    for r in results:
        print(f"{r['nodes']:>7} nodes: plan {r['plan_s']:.3f} s ({r['nodes_per_s']} "
              f"nodes/s), floor {r['floor_s']:.3f} s, ratio {r['ratio_to_floor']}x")
    if linearity:
        print(f"linearity (1.0 = linear): {linearity['linearity']}")


if __name__ == "__main__":
    main()
