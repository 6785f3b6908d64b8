"""The engine seam (runtime/run/engine.py) and ``--engine ray`` against a real local Ray
(one ``ray.init`` for the whole module: starting Ray costs seconds)."""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from runtime.agents.base import AgentExit
from runtime.agents.capture import BoundedCapture
from runtime.failures import FailureClass, NodeStatus, Outcome, RunStatus
from runtime.plan.topology import ArtifactSpec
from runtime.prompt.redact import Redactor
from runtime.run.engine import AgentOutcome, LocalSite, collect_artifacts, deliver
from runtime.run.events import Event
from runtime.run.records import AttemptContext
from runtime.run.start import Hooks
from tests.conftest import REPO, Project, make_topology, python_agents, run_topology

if TYPE_CHECKING:
    from runtime.run.ray_engine import RayEngine  # imports ray: only when a test asks for it


@pytest.fixture(scope="module")
def ray_engine() -> Iterator[RayEngine]:
    import ray

    from runtime.run.ray_engine import RayEngine

    # One custom resource, for the profile-resource tests (a profile asking for it runs;
    # one asking for another never could).
    # address="local": always a new instance, never a cluster another process started.
    ray.init(address="local", num_cpus=2, resources={"claude": 1}, include_dashboard=False,
             log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    try:
        yield RayEngine()
    finally:
        ray.shutdown()


def _topo(agent: str) -> dict[str, Any]:
    topo = make_topology({"a": [], "b": ["a"], "c": ["a", "b"]},
                         b={"agent": "fail_first"})
    topo["agents"] = {**python_agents("write_all", "fail_first", "record_inputs"),
                      **{n: {"kind": "python", "target": f"tests.engine_agents:{n}"}
                         for n in ("crash_first",)}}
    topo["defaults"] = {"agent": agent, "max_attempts": 2}
    return topo


def _events(project: Project, run_id: str) -> list[tuple[Any, ...]]:
    """The ledger as the engine must not change it: kinds, nodes, attempts, outcomes,
    artifact digests (timestamps and durations aside)."""
    path = project.artifacts / "runs" / run_id / "ledger.jsonl"
    out = []
    for line in path.read_text().splitlines():
        ev = json.loads(line)
        out.append((ev["event"], ev.get("node"), ev.get("attempt"), ev.get("outcome"),
                    ev.get("status"), ev.get("prompt_digest"),
                    json.dumps(ev.get("artifacts"), sort_keys=True)))
    return out


def _attempt(project: Project, run_id: str, node: str, n: int) -> AttemptContext:
    path = project.artifacts / "runs" / run_id / "nodes" / node / "attempts" / str(n)
    return AttemptContext.model_validate_json((path / "attempt.json").read_bytes())


def test_ray_run_records_the_same_ledger_as_local(project: Project, ray_engine: RayEngine) -> None:
    topo = _topo("record_inputs")
    local = run_topology(project, topo, run_id="local")
    remote = run_topology(project, topo, run_id="ray", hooks=Hooks(engine=ray_engine))
    assert local.status is remote.status is RunStatus.SUCCEEDED
    assert _events(project, "ray") == _events(project, "local")
    # b failed once then succeeded, on the worker too; c saw a's and b's artifacts as
    # inputs shipped as bytes (nothing shared with the driver's workspace).
    assert [a.outcome for a in remote.state.nodes["b"].attempts] == [
        FailureClass.AGENT_EXIT, "succeeded"]
    seen = project.artifacts / "runs" / "ray" / "nodes" / "c" / "workspace"
    assert (seen / "c.json").exists()
    ctx = _attempt(project, "ray", "c", 1)
    assert (ctx.engine, ctx.worker_host) == ("ray", os.uname().nodename)
    assert ctx.worker
    assert not ctx.worker.startswith("pid")
    assert _attempt(project, "local", "c", 1).engine == "local"


def test_ray_inputs_reach_the_worker(project: Project, ray_engine: RayEngine) -> None:
    topo = make_topology({"a": [], "b": ["a"]})
    topo["agents"] = python_agents("write_all", "record_inputs")
    topo["defaults"] = {"agent": "write_all"}
    topo["nodes"][1]["agent"] = "record_inputs"
    topo["nodes"][1]["artifacts"].append({"path": "seen.txt"})
    result = run_topology(project, topo, run_id="inputs", hooks=Hooks(engine=ray_engine))
    assert result.status is RunStatus.SUCCEEDED
    seen = project.artifacts / "runs" / "inputs" / "nodes" / "b" / "workspace" / "seen.txt"
    assert seen.read_text() == "inputs/a/a.json"


def test_a_local_run_resumes_on_ray(project: Project, ray_engine: RayEngine) -> None:
    from runtime.run.start import resume_run

    topo = _topo("write_all")
    cancel = threading.Event()

    def after(event: Event) -> None:
        if event.event == "node.succeeded":
            cancel.set()  # a succeeded locally; the rest is left for the resume

    first = run_topology(project, topo, run_id="across",
                         hooks=Hooks(cancel=cancel, after_append=after))
    assert first.status is RunStatus.CANCELLED
    result = resume_run(project.artifacts / "runs" / "across",
                        redactor=Redactor.from_environment({}), hooks=Hooks(engine=ray_engine))
    assert result.status is RunStatus.SUCCEEDED
    assert _attempt(project, "across", "a", 1).engine == "local"
    last = result.state.nodes["c"].attempts[-1].attempt
    assert _attempt(project, "across", "c", last).engine == "ray"


def test_a_dying_worker_is_a_lost_attempt_and_the_node_reruns(
        project: Project, ray_engine: RayEngine) -> None:
    topo = _topo("crash_first")
    topo["nodes"] = topo["nodes"][:1]
    result = run_topology(project, topo, run_id="crash", hooks=Hooks(engine=ray_engine))
    node = result.state.nodes["a"]
    assert node.status is NodeStatus.SUCCEEDED
    assert [a.outcome for a in node.attempts] == [FailureClass.LOST, "succeeded"]
    lost = _attempt(project, "crash", "a", 1)
    assert lost.outcome is Outcome.LOST
    assert "the Ray worker running the attempt died (WorkerCrashedError)" in lost.error


def test_cancel_kills_the_ray_task_and_its_agent(project: Project, ray_engine: RayEngine,
                                                 tmp_path: Path) -> None:
    topo = _topo("sleeper")
    topo["nodes"] = topo["nodes"][:1]
    pidfile = tmp_path / "agent.pid"
    # A command agent in a session of its own: a killed worker would orphan it.
    topo["agents"]["sleeper"] = {"kind": "command", "sandbox": False, "argv": [
        "sh", "-c", f"echo $$ > {pidfile}; exec sleep 300"]}
    cancel = threading.Event()

    def cancel_once_running() -> None:
        # Cancel once the agent runs on the worker (its pid file written), not before.
        while not pidfile.exists() or not pidfile.read_text().strip():
            if cancel.wait(0.05):
                return
        cancel.set()

    threading.Thread(target=cancel_once_running, daemon=True).start()
    result = run_topology(project, topo, run_id="cancel",
                          hooks=Hooks(engine=ray_engine, cancel=cancel))
    assert result.status is RunStatus.CANCELLED
    assert _attempt(project, "cancel", "a", 1).outcome is Outcome.CANCELLED
    pid = int(pidfile.read_text())
    # The task stops it on the worker (SIGTERM, SIGKILL after 2 s) after Ray has told
    # the driver the task is cancelled: a bounded wait for it to go, no orphan left.
    gone = threading.Event()
    for _ in range(300):
        if not _running(pid):
            gone.set()
            break
        gone.wait(0.05)
    assert gone.is_set(), f"agent {pid} still running after the run was cancelled"


def _running(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone before, or while, it was read
        return False


def _site(tmp_path: Path) -> LocalSite:
    ws = tmp_path / "ws"
    ws.mkdir()
    return LocalSite(workspace=ws, attempt_dir=tmp_path, prompt_file=tmp_path / "p",
                     env={}, stdout=BoundedCapture(tmp_path / "out"),
                     stderr=BoundedCapture(tmp_path / "err"), cancel=threading.Event())


def test_collect_artifacts_caps_and_refuses_links(tmp_path: Path) -> None:
    (tmp_path / "big.txt").write_bytes(b"x" * 100)
    (tmp_path / "elsewhere").write_text("secret")
    (tmp_path / "link.txt").symlink_to(tmp_path / "elsewhere")
    specs = (ArtifactSpec(path="big.txt", max_bytes=10), ArtifactSpec(path="link.txt"),
             ArtifactSpec(path="absent.txt", required=False))
    got, problems = collect_artifacts(tmp_path, specs)
    assert got == {"big.txt": b"x" * 11}  # one past the cap: the driver sees it oversize
    assert len(problems) == 1
    assert problems[0].startswith("link.txt: cannot be read on the worker")


def test_deliver_never_writes_through_a_link(tmp_path: Path) -> None:
    site = _site(tmp_path)
    (site.workspace / "a.json").symlink_to(tmp_path / "target")
    outcome = AgentOutcome(exit=AgentExit(exit_code=0), engine="ray", host="h", worker="w",
                           started_at=0.0, finished_at=0.0, stdout=b"hello\n",
                           artifacts={"a.json": b"{}"})
    try:
        with pytest.raises(FileExistsError):
            deliver(outcome, site)
    finally:
        site.stdout.close()
        site.stderr.close()
    assert not (tmp_path / "target").exists()


def test_ray_address_needs_the_ray_engine(project: Project,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from runtime.cli import main

    project.write_topology(_topo("write_all"))
    code = main(project.cli("run", str(project.topology), "--ray-address", "auto"))
    assert code == 2
    assert "--ray-address needs --engine ray" in capsys.readouterr().err


def test_engine_ray_without_ray_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.errors import UsageError
    from runtime.run.ray_engine import RayEngine

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(UsageError, match=r"--engine ray needs the ray package: install the "
                       r"extra: pip install -e '\.\[ray\]'"):
        RayEngine()


def test_batch_and_retry_run_on_ray_from_the_cli(project: Project, ray_engine: RayEngine) -> None:
    """--engine ray on batch and retry: every attempt of the batch, and of the retry,
    records the ray engine (the module's Ray is joined, not started again)."""
    from runtime.cli import main

    topo = make_topology({"a": []}, a={"max_attempts": 1})
    topo["agents"] = python_agents("write_all", "always_exit_2")
    topo["defaults"] = {"agent": "always_exit_2"}
    project.write_topology(topo)
    art = str(project.artifacts)
    assert main(project.cli("batch", str(project.topology), "--batch-id", "rb",
                            "--engine", "ray", "--no-preflight")) == 1
    run_id = next((project.artifacts / "runs").glob("rb-*")).name
    assert main(["retry", "rb", "--artifacts", art, "--engine", "ray",
                 "--agent", "write_all"]) == 0
    assert [_attempt(project, run_id, "a", n).engine for n in (1, 2)] == ["ray", "ray"]


def _exclusive(tmp_path: Path, resources: dict[str, float] | None) -> dict[str, Any]:
    """Three independent nodes on a command agent that records how many of its attempts
    run at once (a marker file per running attempt in a shared directory)."""
    live = tmp_path / "live"
    live.mkdir()
    script = (f'touch {live}/$RUNTIME_NODE; ls {live} | wc -l > $RUNTIME_NODE.json; '
              f'sleep 0.5; rm {live}/$RUNTIME_NODE')
    topo = make_topology({"a": [], "b": [], "c": []})
    profile: dict[str, Any] = {"kind": "command", "sandbox": False,
                               "argv": ["sh", "-c", script]}
    if resources is not None:
        profile["resources"] = resources
    topo["agents"] = {"claude-cli": profile}
    topo["defaults"] = {"agent": "claude-cli", "max_attempts": 1}
    return topo


def _concurrency(project: Project, run_id: str) -> list[int]:
    ws = project.artifacts / "runs" / run_id / "nodes"
    return [int((ws / n / "workspace" / f"{n}.json").read_text()) for n in "abc"]


def test_a_profile_resource_limits_its_attempts_cluster_wide(
        project: Project, ray_engine: Any, tmp_path: Path) -> None:
    """Ray offers one `claude`: attempts asking for it run one at a time, though the
    run allows three and Ray has two CPUs."""
    topo = _exclusive(tmp_path, {"claude": 1})
    result = run_topology(project, topo, run_id="limited", jobs=3,
                          hooks=Hooks(engine=ray_engine))
    assert result.status is RunStatus.SUCCEEDED
    assert _concurrency(project, "limited") == [1, 1, 1]
    plan = json.loads((project.artifacts / "runs" / "limited" / "plan.json").read_text())
    assert plan["agents"]["claude-cli"]["resources"] == {"claude": 1.0}


def test_the_local_engine_ignores_profile_resources(project: Project, tmp_path: Path) -> None:
    topo = _exclusive(tmp_path, {"nowhere": 1})
    assert run_topology(project, topo, run_id="local").status is RunStatus.SUCCEEDED


def test_a_resource_no_node_offers_fails_the_node_naming_it(
        project: Project, ray_engine: Any, tmp_path: Path) -> None:
    topo = _exclusive(tmp_path, {"gpu-box": 2, "claude": 1})
    result = run_topology(project, topo, run_id="infeasible", hooks=Hooks(engine=ray_engine))
    assert result.status is RunStatus.FAILED
    ctx = _attempt(project, "infeasible", "a", 1)
    assert ctx.outcome is Outcome.LAUNCH_ERROR
    assert ctx.error == (
        "profile 'claude-cli' needs Ray resources {\"claude\": 1, \"gpu-box\": 2} and no "
        "live node of the Ray cluster offers gpu-box: 2; start a worker with them (ray "
        "start --address HEAD:6379 --resources '{\"claude\": 1, \"gpu-box\": 2}') or "
        "change the profile's resources")


class _VanishingNode:
    """A fake ray module: the one node offering ``claude`` leaves once the task is
    submitted, and the task never finishes (Ray would keep it pending forever)."""

    def __init__(self) -> None:
        self.submitted = False
        self.cancelled: list[Any] = []

    def nodes(self) -> list[dict[str, Any]]:
        return [{"Alive": not self.submitted, "Resources": {"CPU": 2.0, "claude": 1.0}}]

    def wait(self, refs: list[Any], timeout: float) -> tuple[list[Any], list[Any]]:
        threading.Event().wait(timeout)
        return [], refs

    def cancel(self, ref: Any, force: bool) -> None:
        self.cancelled.append((ref, force))


def test_a_resource_that_leaves_while_waiting_ends_the_wait(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.plan.profiles import PythonProfile
    from runtime.run import ray_engine as mod
    from runtime.run.engine import AgentRequest

    monkeypatch.setattr(mod, "FEASIBLE_CHECK_S", 0.01)
    monkeypatch.setattr(mod, "LOST_GRACE_S", 0.05)
    fake = _VanishingNode()
    engine = object.__new__(mod.RayEngine)
    engine._ray = fake

    class _Task:
        def options(self, **opts: Any) -> Any:
            assert opts == {"resources": {"claude": 1.0}}
            return self

        def remote(self, request: Any) -> str:
            fake.submitted = True
            return "ref"

    engine._task = _Task()
    profile = PythonProfile(kind="python", target="m:f", resources={"claude": 1})
    request = AgentRequest(run_id="r", node="a", attempt=1, max_attempts=1,
                           profile_name="p", profile=profile, prompt=b"", inputs=(),
                           env_names=(), timeout_s=5, artifacts=())
    site = _site(tmp_path)
    try:
        outcome = engine.run(request, site)
    finally:
        site.stdout.close()
        site.stderr.close()
    assert fake.cancelled == [("ref", False)]
    assert outcome.exit.launch_error is not None
    assert "no live node of the Ray cluster offers CPU: 1, claude: 1" in outcome.exit.launch_error


@pytest.mark.parametrize(("resources", "message"), [
    ("{claude: '1'}", "resource 'claude': quantity '1' must be a number of at least 0.0001 "
     "(e.g. 1, or 0.5)"),
    ("{claude: 0}", "resource 'claude': quantity 0 must be a number"),
    ("{claude: -1}", "resource 'claude': quantity -1 must be a number"),
    ("{claude: .inf}", "resource 'claude': quantity inf must be a number"),
    ("{claude: true}", "resource 'claude': quantity True must be a number"),
    ("{'': 1}", "resource name '': expected a non-empty string"),
    ("{CPU: 1}", "resource 'CPU' is Ray's own; name a custom resource (not CPU, GPU, memory, "
     "object_store_memory)"),
    ("{}", "expected a non-empty mapping of resource name to quantity, e.g. {claude: 1}"),
    ("[claude]", "expected a non-empty mapping of resource name to quantity"),
])
def test_bad_profile_resources_are_topology_errors(project: Project, resources: str,
                                                   message: str) -> None:
    from runtime.errors import TopologyError
    from runtime.plan.compile import plan_topology

    project.write_topology(
        "schema_version: 1\nname: t\nagents:\n  claude-cli:\n    kind: command\n"
        f"    argv: [claude]\n    resources: {resources}\n"
        "nodes:\n  - {id: a, prompt: task.md.j2, agent: claude-cli}\n")
    with pytest.raises(TopologyError) as err:
        plan_topology(project.topology, project.prompts)
    assert f"{project.topology}:7: agents.claude-cli.resources: {message}" in str(err.value)
    assert message in str(err.value)


def test_unset_resources_stay_out_of_the_plan(project: Project) -> None:
    from runtime.plan.compile import plan_topology

    topo = make_topology({"a": []})
    topo["agents"] = {"cmd": {"kind": "command", "argv": ["true"]}}
    topo["defaults"] = {"agent": "cmd"}
    project.write_topology(topo)
    manifest = plan_topology(project.topology, project.prompts).manifest
    assert "resources" not in json.loads(manifest.to_bytes())["agents"]["cmd"]


def test_an_agent_dies_with_its_killed_worker(project: Project, ray_engine: Any,
                                              tmp_path: Path) -> None:
    """kill -9 of the Ray worker under an unsandboxed agent: the agent goes too (its
    leader has PR_SET_PDEATHSIG), the attempt is lost and the node runs again."""
    pidfile = tmp_path / "agent.pid"
    topo = _topo("sleeper")
    topo["nodes"] = topo["nodes"][:1]
    topo["agents"]["sleeper"] = {"kind": "command", "sandbox": False, "argv": [
        "sh", "-c", f'if [ "$RUNTIME_ATTEMPT" = 1 ]; then echo $$ > {pidfile}; '
        'exec sleep 300; fi; echo {} > a.json']}
    killed: list[int] = []

    def kill_the_worker() -> None:
        while not pidfile.exists() or not pidfile.read_text().strip():
            threading.Event().wait(0.05)
        agent = int(pidfile.read_text())
        worker = int(Path(f"/proc/{agent}/stat").read_text().rsplit(")", 1)[1].split()[1])
        title = Path(f"/proc/{worker}/cmdline").read_bytes()
        killed.extend([agent, worker])
        if title.startswith(b"ray::"):  # the Ray worker, never anything else
            os.kill(worker, 9)

    threading.Thread(target=kill_the_worker, daemon=True).start()
    result = run_topology(project, topo, run_id="pdeath", hooks=Hooks(engine=ray_engine))
    assert result.status is RunStatus.SUCCEEDED
    assert [a.outcome for a in result.state.nodes["a"].attempts] == [
        FailureClass.LOST, "succeeded"]
    agent, worker = killed
    gone = threading.Event()
    for _ in range(200):  # SIGKILL on the worker's death: a bounded wait for the kernel
        if not _running(agent):
            gone.set()
            break
        gone.wait(0.05)
    assert gone.is_set(), f"agent {agent} outlived its killed worker {worker}"


def test_without_the_sandbox_a_missing_program_stays_a_launch_error(tmp_path: Path) -> None:
    from runtime.agents.base import Invocation
    from runtime.plan.profiles import CommandProfile
    from runtime.run.ray_engine import worker_agent

    agent = worker_agent(CommandProfile(kind="command", sandbox=False,
                                        argv=["no-such-agent-program", "-p"]))
    site = _site(tmp_path)
    inv = Invocation(run_id="r", node="a", attempt=1, max_attempts=1, prompt="p",
                     prompt_file=tmp_path / "p", workspace=site.workspace, timeout_s=5,
                     env={"PATH": os.environ["PATH"]}, artifacts=(), stdout=site.stdout,
                     stderr=site.stderr, cancel=threading.Event(), attempt_dir=tmp_path)
    try:
        exit_ = agent.run(inv)
    finally:
        site.stdout.close()
        site.stderr.close()
    assert exit_.launch_error == "no-such-agent-program: No such file or directory"


def _tree(run_dir: Path) -> set[str]:
    """Every path in a run directory but the time- and engine-specific records."""
    skip = {"report.html", "state.json", "ledger.jsonl", "attempt.json", "leaders.jsonl"}
    return {str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.name not in skip}


def test_the_shipped_batch_on_ray_matches_local(project: Project, ray_engine: RayEngine,
                                                tmp_path: Path) -> None:
    """The main job (the shipped topologies on the simulated agent) on --engine ray: the
    same per-node outcomes, attempts and findings as locally, and the same files in every
    run directory (a worker writes nothing there: the driver writes what comes back)."""
    from runtime.cli import main

    summaries = {}
    for engine in ("local", "ray"):
        art = tmp_path / engine
        assert main(["batch", str(REPO / "topologies"), "--agent", "demo", "--artifacts",
                     str(art), "--batch-id", "shipped", "--engine", engine]) == 0
        summaries[engine] = json.loads(
            (art / "batches" / "shipped" / "summary.json").read_text())
    local, remote = summaries["local"], summaries["ray"]

    def outcomes(summary: dict[str, Any]) -> dict[str, Any]:
        return {e["source"]: (e["status"], e["findings"], {
            n: (v["status"], v["attempts"], v["failure"]) for n, v in e["nodes"].items()})
            for e in summary["entries"]}

    assert outcomes(remote) == outcomes(local)
    assert len(local["entries"]) == len(list((REPO / "topologies").glob("*.yaml")))
    for lo, re in zip(local["entries"], remote["entries"], strict=True):
        tree = _tree(tmp_path / "local" / lo["run_dir"])
        assert "plan.json" in tree
        assert _tree(tmp_path / "ray" / re["run_dir"]) == tree


def test_an_agent_on_ray_reads_its_attempt_context(project: Project,
                                                   ray_engine: RayEngine) -> None:
    """RUNTIME_ATTEMPT_CONTEXT on a worker names the attempt.json the driver wrote, not a
    file that does not exist there."""
    topo = make_topology({"a": []}, a={"max_attempts": 2})
    script = ('cp "$RUNTIME_ATTEMPT_CONTEXT" ctx.json; '
              '[ "$RUNTIME_ATTEMPT" = 2 ]')  # attempt 1 fails: attempt 2 has a prior failure
    topo["agents"] = {"sh": {"kind": "command", "sandbox": False, "argv": ["sh", "-c", script]}}
    topo["defaults"] = {"agent": "sh"}
    topo["nodes"][0]["artifacts"] = [{"path": "ctx.json", "kind": "json"}]
    result = run_topology(project, topo, run_id="ctx", hooks=Hooks(engine=ray_engine))
    assert result.status is RunStatus.SUCCEEDED
    ws = project.artifacts / "runs" / "ctx" / "nodes" / "a" / "workspace"
    seen = json.loads((ws / "ctx.json").read_text())
    assert (seen["node"], seen["attempt"], seen["engine"]) == ("a", 2, "ray")
    assert [f["attempt"] for f in seen["prior_failures"]] == [1]
