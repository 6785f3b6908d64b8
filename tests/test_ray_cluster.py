"""``--engine ray`` on a two-worker cluster (ray.cluster_utils.Cluster: a head that runs
no tasks and two worker nodes, each with its own raylet, on this host), driven by the
CLI in a subprocess as a user would. A raylet killed under an attempt makes the attempt
``lost`` (uncharged) and the node runs again on the other worker; once no live node
offers the profile's resource, the node fails clearly instead of waiting forever."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO, Project

# The cluster's GCS declares a node dead after 2 missed 1 s health checks (Ray's default
# is 5 of 3 s): the test's clock, not the behaviour under test.
HEALTH = {"health_check_period_ms": 1000, "health_check_failure_threshold": 2}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "_system_config": HEALTH})
    try:
        for _ in range(2):
            c.add_node(num_cpus=1, resources={"scanner": 1})
        c.wait_for_nodes()
        yield c
    finally:
        c.shutdown()  # type: ignore[no-untyped-call]  # ray.cluster_utils is untyped


def _topology(project: Project, pidfile: Path) -> Path:
    project.template("t.md.j2", "Scan {{ node.id }}.\n")
    # Attempt 1 sleeps (its node is killed under it); a later attempt succeeds.
    script = (f'if [ "$RUNTIME_ATTEMPT" = 1 ]; then echo $$ > {pidfile}; exec sleep 300; '
              'fi; echo {} > a.json')
    return project.write_topology(yaml.safe_dump({
        "schema_version": 1, "name": "cluster",
        "agents": {"scan": {"kind": "command", "sandbox": False, "resources": {"scanner": 1},
                            "argv": ["sh", "-c", script]}},
        "defaults": {"agent": "scan", "max_attempts": 1},
        "nodes": [{"id": "a", "prompt": "t.md.j2",
                   "artifacts": [{"path": "a.json", "kind": "json"}]}]}))


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _run_killing_the_agents_node(project: Project, cluster: Any, run_id: str,
                                 ) -> tuple[int, int]:
    """Run the topology from the CLI; once attempt 1's agent runs, kill the raylet of the
    node it runs on. Returns the CLI's exit status and the agent's pid."""
    from ray._private import ray_constants

    pidfile = project.root / f"{run_id}.pid"
    topology = _topology(project, pidfile)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "runtime", *project.cli(
            "run", str(topology), "--engine", "ray", "--ray-address", cluster.address,
            "--no-preflight", "--run-id", run_id, "--json")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        stop = threading.Event()
        while not (pidfile.exists() and pidfile.read_text().strip()):
            assert proc.poll() is None, "the run ended before its agent started"
            stop.wait(0.05)
        agent = int(pidfile.read_text())
        raylet = _ppid(_ppid(agent))  # agent -> Ray worker -> its node's raylet
        node = next(n for n in cluster.worker_nodes if raylet in [
            p.process.pid for p in n.all_processes[ray_constants.PROCESS_TYPE_RAYLET]])
        node.kill_raylet()
        cluster.worker_nodes.remove(node)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, agent


def _attempts(project: Project, run_id: str) -> list[dict[str, Any]]:
    root = project.artifacts / "runs" / run_id / "nodes" / "a" / "attempts"
    return [json.loads((root / str(n) / "attempt.json").read_text())
            for n in range(1, len(list(root.iterdir())) + 1)]


def _running(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone before, or while, it was read
        return False


@pytest.mark.slow
def test_a_killed_node_is_a_lost_attempt_then_the_other_runs_it_then_a_clear_failure(
        project: Project, cluster: Any) -> None:
    # Two workers offer `scanner`: the node runs again on the one left.
    code, agent = _run_killing_the_agents_node(project, cluster, "elsewhere")
    assert code == 0
    lost, rerun = _attempts(project, "elsewhere")
    assert (lost["outcome"], rerun["outcome"]) == ("lost", "succeeded")
    assert lost["error"].startswith("the Ray worker running the attempt died (")
    assert rerun["engine"] == "ray"
    assert rerun["worker"]
    gone = threading.Event()
    for _ in range(200):  # the agent died with its worker (PR_SET_PDEATHSIG)
        if not _running(agent):
            gone.set()
            break
        gone.wait(0.05)
    assert gone.is_set(), f"agent {agent} outlived its killed node"

    # Now one worker offers it; once that one is killed, nothing can run the node.
    code, _ = _run_killing_the_agents_node(project, cluster, "nowhere")
    assert code == 1
    lost, refused = _attempts(project, "nowhere")
    assert (lost["outcome"], refused["outcome"]) == ("lost", "launch_error")
    assert refused["error"].startswith(
        "profile 'scan' needs Ray resources {\"scanner\": 1} and no live node of the Ray "
        "cluster offers CPU: 1, scanner: 1; start a worker with them")
