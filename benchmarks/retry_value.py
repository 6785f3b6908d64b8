"""What the retry preamble buys on the incident reproduction (topologies/incident-replay).

Runs the shipped incident topology twice, as whole `runtime run` processes on the
scripted simulated agent: with retry_feedback on (as shipped), and with
`--set durable-handler.retry_feedback=false` (byte-identical replay). Prints attempts
used, nodes completed and wall time for both. The simulated agent makes the same
deterministic mistake on every attempt unless the prior-failure block names it.

    python benchmarks/retry_value.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def run(feedback: bool, artifacts: Path) -> tuple[dict[str, Any], float]:
    argv = [sys.executable, "-m", "runtime", "run", str(ROOT / "topologies/incident-replay.yaml"),
            "--prompts", str(ROOT / "prompts"), "--artifacts", str(artifacts), "--json"]
    if not feedback:
        argv += ["--set", "durable-handler.retry_feedback=false"]
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - start
    if proc.returncode not in (0, 1):
        raise SystemExit(proc.stderr)
    return json.loads(proc.stdout), elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for feedback in (True, False):
            times = []
            for i in range(args.repeat):
                result, elapsed = run(feedback, Path(tmp) / f"{feedback}-{i}")
                times.append(elapsed)
            nodes = result["nodes"]
            rows.append({
                "retry_feedback": feedback, "status": result["status"],
                "handler_attempts": nodes["durable-handler"]["attempts"],
                "attempts_total": sum(n["attempts"] for n in nodes.values()),
                "nodes_succeeded": sum(n["status"] == "succeeded" for n in nodes.values()),
                "nodes_skipped": sum(n["status"] == "skipped" for n in nodes.values()),
                "wall_s_best": round(min(times), 3),
            })
    for r in rows:
        print(f"retry_feedback={str(r['retry_feedback']).lower():<5} {r['status']:<9} "
              f"handler attempts {r['handler_attempts']}, attempts in all "
              f"{r['attempts_total']}, nodes succeeded {r['nodes_succeeded']}, skipped "
              f"{r['nodes_skipped']}, wall {r['wall_s_best']:.2f} s (best of {args.repeat})")
    on, off = rows
    print(f"with feedback: {off['handler_attempts']} -> {on['handler_attempts']} attempts on "
          f"the failing node; {on['nodes_succeeded']} vs {off['nodes_succeeded']} nodes done")


if __name__ == "__main__":
    main()
