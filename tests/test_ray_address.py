"""``--ray-address``: a malformed or unreachable address is a usage error (exit 2) in
bounded time, naming the address and the accepted forms, before anything is written."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from runtime.errors import UsageError
from runtime.run import ray_engine
from runtime.run.ray_engine import ACCEPTED_ADDRESSES, call_within, connect, parse_address
from tests.conftest import REPO, Project, make_topology

ACCEPTED = "accepted: auto (the cluster `ray start` started on this host, or RAY_ADDRESS), " \
    "ray://HOST:10001 (Ray Client) or HOST:6379 (the head node's GCS port)"


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def listener() -> Iterator[int]:
    """A loopback port that accepts connections but is no Ray cluster."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield int(s.getsockname()[1])


@pytest.mark.parametrize(("address", "expected"), [
    ("auto", None), ("10.1.2.3:6379", ("10.1.2.3", 6379)),
    ("ray://head.example:10001", ("head.example", 10001)),
    ("[fd00::2]:6379", ("fd00::2", 6379)),
])
def test_accepted_addresses(address: str, expected: Any) -> None:
    assert parse_address(address) == expected


@pytest.mark.parametrize("address", [
    "", "local", "10.1.2.3", "10.1.2.3:", "10.1.2.3:0", "10.1.2.3:70000", ":6379",
    "http://head:6379", "ray://head", "head:6379/x", "fd00::2:6379",
])
def test_malformed_addresses_name_the_accepted_forms(address: str) -> None:
    with pytest.raises(UsageError) as err:
        parse_address(address)
    assert str(err.value) == f"--ray-address {address!r}: not a Ray address; {ACCEPTED}"
    assert ACCEPTED_ADDRESSES == ACCEPTED


def _cli(project: Project, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "runtime", *project.cli(*argv)],
                          capture_output=True, text=True, env=env, timeout=120, check=False)


@pytest.mark.parametrize("scheme", ["", "ray://"])
def test_a_closed_port_is_exit_2_before_anything_is_written(project: Project,
                                                           scheme: str) -> None:
    project.write_topology(make_topology({"a": []}))
    address = f"{scheme}127.0.0.1:{_closed_port()}"
    done = _cli(project, "run", str(project.topology), "--engine", "ray",
                "--ray-address", address, "--no-preflight")
    assert done.returncode == 2, done.stderr
    port = address.rsplit(":", 1)[1]
    assert (f"error: --ray-address {address}: no Ray cluster answers at 127.0.0.1:{port} "
            f"(connection refused); {ACCEPTED}") in done.stderr
    assert not project.artifacts.exists()  # no plan directory, no run directory


def test_batch_refuses_it_before_anything_is_written(project: Project) -> None:
    project.write_topology(make_topology({"a": []}))
    address = f"127.0.0.1:{_closed_port()}"
    done = _cli(project, "batch", str(project.topology), "--engine", "ray",
                "--ray-address", address, "--no-preflight")
    assert done.returncode == 2
    assert f"--ray-address {address}: no Ray" in done.stderr
    assert not project.artifacts.exists()


@pytest.mark.parametrize("verb", ["resume", "retry"])
def test_resume_and_retry_refuse_it_and_leave_the_run_as_it_was(project: Project,
                                                                verb: str) -> None:
    from runtime.cli import main

    project.write_topology(make_topology({"a": []}))
    assert main(project.cli("run", str(project.topology), "--run-id", "r")) == 0
    ledger = project.artifacts / "runs" / "r" / "ledger.jsonl"
    before = ledger.read_bytes()
    address = f"127.0.0.1:{_closed_port()}"
    done = _cli(project, verb, "r", "--engine", "ray", "--ray-address", address)
    assert done.returncode == 2
    assert f"--ray-address {address}: no Ray" in done.stderr
    assert ledger.read_bytes() == before


class _FakeRay:
    """Stands in for the ray module: its init blocks, or raises ``error``."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error
        self.release = threading.Event()

    def init(self, **_: Any) -> None:
        if self.error is not None:
            raise self.error
        self.release.wait(30)


def test_a_listener_that_is_no_ray_cluster_is_refused_in_bounded_time(
        listener: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray_engine, "CONNECT_TIMEOUT_S", 0.2)
    fake = _FakeRay()
    try:
        with pytest.raises(UsageError) as err:
            connect(fake, f"127.0.0.1:{listener}")
    finally:
        fake.release.set()
    assert str(err.value) == (f"--ray-address 127.0.0.1:{listener}: cannot join a Ray "
                              f"cluster there (no answer within 0.2 s); {ACCEPTED}")


def test_ray_address_from_the_environment_is_named(
        listener: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{listener}")
    with pytest.raises(UsageError) as err:
        connect(_FakeRay(ConnectionError("GCS refused\nmore")), None)
    assert str(err.value) == (f"RAY_ADDRESS 127.0.0.1:{listener}: cannot join a Ray "
                              f"cluster there (GCS refused); {ACCEPTED}")
    monkeypatch.setenv("RAY_ADDRESS", "nowhere")
    with pytest.raises(UsageError, match=r"^RAY_ADDRESS 'nowhere': not a Ray address"):
        connect(_FakeRay(), None)


def test_a_local_ray_that_cannot_start_is_a_usage_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(UsageError, match=r"^--engine ray: could not start a local Ray "
                       r"\(no space\)$"):
        connect(_FakeRay(RuntimeError("no space")), None)


def test_other_errors_are_not_disguised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(KeyError):
        connect(_FakeRay(KeyError("bug")), None)


def test_call_within() -> None:
    assert call_within(lambda: None, 5) is None
    assert isinstance(call_within(lambda: 1 / 0, 5), ZeroDivisionError)
    stop = threading.Event()
    try:
        late = call_within(lambda: stop.wait(30), 0.05)
    finally:
        stop.set()
    assert isinstance(late, TimeoutError)
    assert str(late) == "no answer within 0.05 s"


def test_without_an_address_the_cli_starts_a_local_ray_that_lasts_the_run(
        project: Project) -> None:
    """The default: a local Ray started by the CLI itself. (Started from a helper thread,
    Ray's GCS and raylet died with that thread: PR_SET_PDEATHSIG follows the thread.)"""
    project.write_topology(make_topology({"a": [], "b": ["a"]}))
    done = _cli(project, "run", str(project.topology), "--engine", "ray", "--no-preflight",
                "--run-id", "local-ray", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    ctx = project.artifacts / "runs" / "local-ray" / "nodes" / "b" / "attempts" / "1"
    assert '"engine":"ray"' in (ctx / "attempt.json").read_text().replace(" ", "")
