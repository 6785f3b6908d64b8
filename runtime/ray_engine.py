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

import os
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .agents import AgentExit, Invocation
from .capture import BoundedCapture
from .engine import AgentOutcome, AgentRequest, LocalSite, collect_artifacts, invocation
from .errors import UsageError

NAME = "ray"
POLL_S = 0.1
# How long a cancelled task waits for its adapter to stop the agent (the command
# adapter's own SIGTERM, then SIGKILL after 2 s).
CANCEL_GRACE_S = 5.0
INSTALL_HINT = "install the extra: pip install -e '.[ray]'"


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise UsageError(f"--engine ray needs the ray package: {INSTALL_HINT}") from None
    return ray


def run_on_worker(request: AgentRequest) -> AgentOutcome:
    """The Ray task body: run one attempt's agent in a temporary directory and return its outcome.

    The task body: lay the request out in a temporary directory, run the agent, hand back
    what it left. Runs on a Ray worker (or anywhere: it needs nothing else).
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
        env = {
            "RUNTIME_RUN_ID": request.run_id, "RUNTIME_NODE": request.node,
            "RUNTIME_ATTEMPT": str(request.attempt),
            "RUNTIME_MAX_ATTEMPTS": str(request.max_attempts),
            "RUNTIME_WORKSPACE": str(ws), "RUNTIME_PROMPT_FILE": str(prompt_file),
            "RUNTIME_ATTEMPT_CONTEXT": str(attempt_dir / "attempt.json"),
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


def _run_cancellable(request: AgentRequest, inv: Invocation) -> AgentExit:
    """Run the agent in a thread so that a ``ray.cancel`` reaches the adapter as ``inv.cancel``.

    A non-forced ``ray.cancel`` raises KeyboardInterrupt in this task's main thread; with
    the agent in another thread, it becomes ``inv.cancel`` and the adapter kills the agent's
    process tree by its own rules before the task ends (a forced cancel would kill the
    worker and orphan the tree).
    """
    from .agents import make_agent

    box: list[AgentExit | BaseException] = []

    def target() -> None:
        try:
            box.append(make_agent(request.profile).run(inv))
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


class RayEngine:
    """An engine that submits each attempt as a Ray task.

    Submits each attempt as a Ray task to the cluster at ``address`` (None: start or join a
    local one, as ``ray.init`` does).
    """

    name = NAME

    def __init__(self, address: str | None = None) -> None:
        ray = _ray()
        self._ray = ray
        if not ray.is_initialized():
            try:
                ray.init(address=address, include_dashboard=False, log_to_driver=False,
                         configure_logging=False)
            except ConnectionError as exc:
                raise UsageError(f"--ray-address {address}: cannot connect to a Ray "
                                 f"cluster ({exc})") from None
        self._task = ray.remote(max_retries=0, retry_exceptions=False)(run_on_worker)
        self._lost = (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError,
                      ray.exceptions.OutOfMemoryError)

    def run(self, request: AgentRequest, site: LocalSite) -> AgentOutcome:
        """Submit the attempt as a Ray task, cancel it when the attempt is cancelled, deliver it."""
        ray = self._ray
        started = time.time()
        ref = self._task.remote(request)
        while True:
            done, _ = ray.wait([ref], timeout=POLL_S)
            if done:
                break
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
