"""``--engine ray``: each attempt's agent runs as one Ray task, on any worker of a cluster.

The task gets the whole ``AgentRequest`` (prompt bytes, inputs as bytes) and lays it out
in a temporary directory on the worker: nothing assumes the driver's file system. It
runs the agent through the same adapters (and so the same sandbox) as locally and
returns an ``AgentOutcome`` with the captured output and the declared artifacts as
bytes; the driver writes them. Ray's own retries are off (``max_retries=0``,
``retry_exceptions=False``): the runtime's policy alone decides what runs again. A
worker or node that dies under a task makes the attempt ``lost`` (uncharged; the node
runs again); a cancelled run cancels its tasks; each stops its agent's process tree on the worker.

Secrets are read from the worker's environment by the names the profile lists; the
driver never ships their values.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from runtime.agents import AnyProfile
from runtime.agents.base import Agent, AgentExit, Invocation
from runtime.agents.capture import BoundedCapture
from runtime.errors import UsageError
from runtime.plan.profiles import CommandProfile
from runtime.run.engine import AgentOutcome, AgentRequest, LocalSite, collect_artifacts, invocation

NAME = "ray"
log = logging.getLogger(__name__)
POLL_S = 0.1
# How long a cancelled task waits for its adapter to stop the agent (the command
# adapter's own SIGTERM, then SIGKILL after 2 s).
CANCEL_GRACE_S = 5.0
INSTALL_HINT = "install the extra: pip install -e '.[ray]'"
# Joining a cluster that is not there makes ray.init retry for minutes (20 GCS connects of
# ~35 s each, in Ray 2.60). These bound it: a TCP probe of the address first (a closed
# port is refused at once, an unroutable host times out), then ray.init itself.
PROBE_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 15.0
ACCEPTED_ADDRESSES = ("accepted: auto (the cluster `ray start` started on this host, or "
                      "RAY_ADDRESS), ray://HOST:10001 (Ray Client) or HOST:6379 (the head "
                      "node's GCS port)")
# A task asking for resources no live node has would wait in Ray forever: checked before
# submitting, and every FEASIBLE_CHECK_S while waiting (a node may leave). A task whose
# node died gets its own error from Ray; LOST_GRACE_S leaves time for that to arrive
# (a lost attempt, run again) before an infeasible wait becomes a launch_error.
FEASIBLE_CHECK_S = 1.0
LOST_GRACE_S = 10.0
_HOST_PORT = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9_.-]+)):"
                        r"(?P<port>[0-9]{1,5})$")


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise UsageError(f"--engine ray needs the ray package: {INSTALL_HINT}") from None
    return ray


def run_on_worker(request: AgentRequest) -> AgentOutcome:
    """The Ray task body: run one attempt's agent in a temporary directory and return its outcome.

    It needs nothing from the driver's machine, so it runs on any worker (or anywhere).
    """
    started = time.time()
    with tempfile.TemporaryDirectory(prefix=f"runtime-{request.node}-") as tmp:
        root = Path(tmp)
        ws = root / "workspace"
        attempt_dir = root / "attempts" / str(request.attempt)
        attempt_dir.mkdir(parents=True)
        ws.mkdir()
        for item in request.inputs:
            dst = ws / item.path
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(item.data)
            dst.chmod(0o444)
        prompt_file = attempt_dir / "prompt.md"
        prompt_file.write_bytes(request.prompt)
        context_file = attempt_dir / "attempt.json"
        context_file.write_bytes(request.context)
        prompt_file.chmod(0o444)
        context_file.chmod(0o444)
        env = {
            "RUNTIME_RUN_ID": request.run_id, "RUNTIME_NODE": request.node,
            "RUNTIME_ATTEMPT": str(request.attempt),
            "RUNTIME_MAX_ATTEMPTS": str(request.max_attempts),
            "RUNTIME_WORKSPACE": str(ws), "RUNTIME_PROMPT_FILE": str(prompt_file),
            "RUNTIME_ATTEMPT_CONTEXT": str(context_file),
        }
        stdout = BoundedCapture(attempt_dir / "stdout.log")
        stderr = BoundedCapture(attempt_dir / "stderr.log")
        try:
            inv = invocation(request, prompt_file=prompt_file, workspace=ws,
                             attempt_dir=attempt_dir, env=env, stdout=stdout, stderr=stderr,
                             cancel=threading.Event())
            exit_ = _run_cancellable(request, inv)
        finally:
            stdout.close()
            stderr.close()
        artifacts, problems = collect_artifacts(ws, request.artifacts)
        err = stderr.contents()
        if problems:
            err += ("\n" + "\n".join(problems) + "\n").encode()
        return AgentOutcome(
            exit=exit_, engine=NAME, host=socket.gethostname(), worker=_node_id(),
            started_at=started, finished_at=time.time(), stdout_total=stdout.total,
            stderr_total=stderr.total, stdout=stdout.contents(),
            stderr=err, artifacts=artifacts)


def worker_agent(profile: AnyProfile) -> Agent:
    """The adapter a Ray worker runs a profile with: the local one, made to die with its worker.

    The local one, except that an unsandboxed command agent's leader gets PR_SET_PDEATHSIG
    (SIGKILL) so it dies with a worker that dies (a sandboxed one has it already: bwrap
    --die-with-parent, and its pid namespace takes the whole tree). The driver of a remote
    worker cannot clean up what a dead worker leaves (the local engine's resume does, from
    leaders.jsonl).
    """
    from runtime.agents import make_agent
    from runtime.agents.command import CommandAgent

    if not isinstance(profile, CommandProfile) or profile.sandbox is not False:
        return make_agent(profile)
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        log.warning("setpriv (util-linux) is not on this worker's PATH: an unsandboxed agent "
                    "may outlive a worker that dies")
        return make_agent(profile)
    shim: str = setpriv

    class DiesWithWorker(CommandAgent):
        def launch_argv(self, inv: Invocation, env: dict[str, str],
                        ) -> tuple[list[str], dict[str, str], dict[str, int]] | str:
            launch = super().launch_argv(inv, env)
            if isinstance(launch, str):
                return launch
            argv, env, fds = launch
            # A program that is not there stays the adapter's own launch_error (setpriv
            # would report it as its exit 127 instead).
            if ("/" in argv[0] and not os.access(argv[0], os.X_OK)) or ("/" not in argv[0] and
                    shutil.which(argv[0], path=env.get("PATH", os.defpath)) is None):
                return launch
            # setpriv execs the agent: the pid (recorded as the leader) is the agent's.
            return [shim, "--pdeathsig", "KILL", "--", *argv], env, fds

    return DiesWithWorker(profile)


def _run_cancellable(request: AgentRequest, inv: Invocation) -> AgentExit:
    """Run the agent in a thread so that a ``ray.cancel`` reaches the adapter as ``inv.cancel``.

    A non-forced ``ray.cancel`` raises KeyboardInterrupt in this task's main thread; with
    the agent in another thread, it becomes ``inv.cancel`` and the adapter kills the agent's
    process tree by its own rules before the task ends (a forced cancel would kill the
    worker and orphan the tree).
    """
    box: list[AgentExit | BaseException] = []

    def target() -> None:
        try:
            box.append(worker_agent(request.profile).run(inv))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the task's thread
            box.append(exc)

    worker = threading.Thread(target=target, daemon=True, name=f"agent-{inv.node}")
    worker.start()
    try:
        while worker.is_alive():
            worker.join(POLL_S)
    except KeyboardInterrupt:
        inv.cancel.set()
        worker.join(CANCEL_GRACE_S)
        raise
    result = box[0]
    if isinstance(result, BaseException):
        raise result
    return result


def _node_id() -> str:
    try:
        import ray

        return str(ray.get_runtime_context().get_node_id())
    except Exception:  # noqa: BLE001 - outside a Ray worker there is no node id
        return f"pid {os.getpid()}"


def parse_address(address: str, flag: str = "--ray-address") -> tuple[str, int] | None:
    """The host and port ``--ray-address`` names (None for ``auto``, which Ray resolves).

    Any other form is a usage error naming the accepted ones.
    """
    if address == "auto":
        return None
    rest = address.removeprefix("ray://")
    match = _HOST_PORT.match(rest)
    port = int(match["port"]) if match else 0
    if match is None or not 1 <= port <= 65535:
        raise UsageError(f"{flag} {address!r}: not a Ray address; {ACCEPTED_ADDRESSES}")
    return match["v6"] or match["host"], port


def probe(flag: str, address: str, host: str, port: int,
          timeout: float = PROBE_TIMEOUT_S) -> None:
    """Refuse an address nothing listens on, in at most ``timeout`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        reason = (f"no answer within {timeout:g} s" if isinstance(exc, TimeoutError)
                  else (exc.strerror or str(exc)).lower())
        raise UsageError(f"{flag} {address}: no Ray cluster answers at {host}:{port} "
                         f"({reason}); {ACCEPTED_ADDRESSES}") from None


def call_within(fn: Callable[[], object], timeout: float) -> BaseException | None:
    """Run ``fn`` in a daemon thread for at most ``timeout`` seconds.

    Returns its exception, or a TimeoutError when it has not returned (the thread is
    abandoned; the CLI exits), or None.
    """
    box: list[BaseException | None] = []

    def target() -> None:
        try:
            fn()
            box.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box.append(exc)

    thread = threading.Thread(target=target, daemon=True, name="ray-init")
    thread.start()
    thread.join(timeout)
    return box[0] if box else TimeoutError(f"no answer within {timeout:g} s")


class _NotMainThread(logging.Filter):
    """Drop ray.init's warning about the SIGTERM handler: under the CLI it is noise.

    ray.init off the main thread warns that it set no SIGTERM handler; the CLI sets its own
    around every run, so the warning is noise.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


def connect(ray: Any, address: str | None) -> None:
    """Join the Ray cluster at ``address``, or raise a UsageError naming it; joining is bounded.

    Join the cluster at ``address`` (None: RAY_ADDRESS, else start a local Ray), or raise a
    UsageError naming the address and the accepted forms; joining is bounded.
    """
    named = address or os.environ.get("RAY_ADDRESS") or None
    flag = "--ray-address" if address else "RAY_ADDRESS"

    def init() -> None:
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)

    if named is None:
        # Started here, in this thread, unbounded: Ray starts its GCS and raylet with
        # PR_SET_PDEATHSIG, which fires when the *thread* that started them ends, so a
        # helper thread would take the new cluster down with it.
        error: BaseException | None = None
        try:
            init()
        except (ConnectionError, RuntimeError, ValueError) as exc:
            error = exc
    else:
        target = parse_address(named, flag)
        if target is not None:
            probe(flag, named, *target)
        # Joining starts no process: a helper thread bounds it.
        quiet = _NotMainThread()
        log = logging.getLogger("ray._private.worker")
        log.addFilter(quiet)
        try:
            error = call_within(init, CONNECT_TIMEOUT_S)
        finally:
            log.removeFilter(quiet)
    if error is None:
        return
    if not isinstance(error, (ConnectionError, TimeoutError, RuntimeError, ValueError)):
        raise error
    detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if named is None:
        raise UsageError(f"--engine ray: could not start a local Ray ({detail})") from None
    raise UsageError(f"{flag} {named}: cannot join a Ray cluster there ({detail}); "
                     f"{ACCEPTED_ADDRESSES}") from None


class RayEngine:
    """An engine that submits each attempt as a Ray task.

    Submits each attempt as a Ray task to the cluster at ``address`` (None: start or join a
    local one, as ``ray.init`` does).
    """

    name = NAME

    def __init__(self, address: str | None = None) -> None:
        if address is not None:
            parse_address(address)  # a malformed address is refused before Ray starts
        ray = _ray()
        self._ray = ray
        if not ray.is_initialized():
            connect(ray, address)
        self._task = ray.remote(max_retries=0, retry_exceptions=False)(run_on_worker)
        self._lost = (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError,
                      ray.exceptions.OutOfMemoryError)

    # C901: one polling loop watches completion, cancellation and placement together.
    def run(self, request: AgentRequest, site: LocalSite) -> AgentOutcome:  # noqa: C901
        """Submit the attempt as a Ray task and watch it until it ends, or cancel it.

        Cancelled with the attempt, or once no live node can place it for a grace period.
        """
        ray = self._ray
        started = time.time()
        resources = request.profile.resources
        if resources:
            problem = self.infeasible(request.profile_name, resources)
            if problem:
                return AgentOutcome(exit=AgentExit(launch_error=problem), engine=NAME,
                                    host="", worker="", started_at=started,
                                    finished_at=time.time())
            ref = self._task.options(resources=dict(resources)).remote(request)
        else:
            ref = self._task.remote(request)
        checked = time.monotonic()
        infeasible_since: float | None = None
        while True:
            done, _ = ray.wait([ref], timeout=POLL_S)
            if done:
                break
            now = time.monotonic()
            if resources and now - checked >= FEASIBLE_CHECK_S:
                checked = now
                problem = self.infeasible(request.profile_name, resources)
                if problem is None:
                    infeasible_since = None
                elif infeasible_since is None:
                    infeasible_since = now
                elif now - infeasible_since >= LOST_GRACE_S:
                    ray.cancel(ref, force=False)
                    return AgentOutcome(exit=AgentExit(launch_error=problem), engine=NAME,
                                        host="", worker="", started_at=started,
                                        finished_at=time.time())
            if site.cancel.is_set():
                # Not forced: a killed worker would orphan the agent's process group (it
                # runs in a session of its own). The task stops the agent itself, within
                # the adapter's grace; Ray marks the task cancelled at once, so the
                # driver does not wait for that.
                ray.cancel(ref, force=False)
                return AgentOutcome(exit=AgentExit(cancelled=True), engine=NAME, host="",
                                    worker="", started_at=started, finished_at=time.time())
        try:
            outcome: AgentOutcome = ray.get(ref)
        except self._lost as exc:
            return AgentOutcome(
                exit=AgentExit(), engine=NAME, host="", worker="", started_at=started,
                finished_at=time.time(),
                lost=f"the Ray worker running the attempt died ({type(exc).__name__})")
        return outcome

    def infeasible(self, profile: str, resources: Mapping[str, float]) -> str | None:
        """Why no live node can ever run a task asking for ``resources``, or None when one can.

        Every attempt also takes one CPU, which counts too.
        """
        wanted = {"CPU": 1.0, **resources}
        nodes = [n.get("Resources", {}) for n in self._ray.nodes() if n.get("Alive")]
        if any(all(have.get(k, 0.0) >= v for k, v in wanted.items()) for have in nodes):
            return None
        short = sorted(k for k, v in wanted.items()
                       if not any(have.get(k, 0.0) >= v for have in nodes))
        missing = ", ".join(f"{k}: {wanted[k]:g}" for k in (short or sorted(wanted)))
        where = (f"no live node of the Ray cluster offers {missing}" if short else
                 f"no single live node of the Ray cluster offers all of {missing}")
        return (f"profile {profile!r} needs Ray resources {_json_resources(resources)} and "
                f"{where}; start a worker with them (ray start --address HEAD:6379 "
                f"--resources '{_json_resources(resources)}') or change the profile's "
                "resources")


def _json_resources(resources: Mapping[str, float]) -> str:
    import json

    return json.dumps({k: (int(v) if float(v).is_integer() else v)
                       for k, v in sorted(resources.items())})
