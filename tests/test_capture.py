from __future__ import annotations

import resource
from pathlib import Path

import pytest

from runtime.agents import make_agent
from runtime.agents.base import Invocation
from runtime.agents.capture import BoundedCapture
from runtime.plan.profiles import CommandProfile


def test_small_output_is_kept_whole(tmp_path: Path) -> None:
    cap = BoundedCapture(tmp_path / "out.log", head=16, tail=16)
    cap.write(b"hello\n")
    cap.write("world\n")
    cap.close()
    assert (tmp_path / "out.log").read_bytes() == b"hello\nworld\n"
    assert (cap.total, cap.dropped) == (12, 0)


def test_head_and_tail_kept_and_drop_counted(tmp_path: Path) -> None:
    cap = BoundedCapture(tmp_path / "out.log", head=10, tail=10)
    for i in range(100):
        cap.write(f"{i:03d}\n".encode())
    cap.close()
    data = (tmp_path / "out.log").read_bytes()
    assert data.startswith(b"000\n001\n00")
    assert data.endswith(b"\n[... 380 bytes dropped ...]\n7\n098\n099\n")
    assert cap.total == 400
    assert cap.dropped == 380
    assert b"[... 380 bytes dropped ...]" in data


def test_tail_text_starts_at_a_line_boundary_after_a_cut(tmp_path: Path) -> None:
    cap = BoundedCapture(tmp_path / "err.log", head=4, tail=24)
    cap.write(b"AAAA" + b"token=SECRETSECRETSECRET\nlast line\n")
    cap.close()
    assert cap.tail_text(4096) == "last line\n"
    small = BoundedCapture(tmp_path / "e2.log")
    small.write(b"one\ntwo\nthree\n")
    assert small.tail_text(9) == "three\n"  # the limit itself cut "two"
    assert small.tail_text(100) == "one\ntwo\nthree\n"
    small.close()


@pytest.mark.slow
def test_a_gigabyte_of_output_stays_bounded(tmp_path: Path) -> None:
    """Through the command agent's supervisor, the path every agent's output takes."""
    cap = BoundedCapture(tmp_path / "big.log")
    err = BoundedCapture(tmp_path / "err.log")
    inv = Invocation(run_id="r", node="n", attempt=1, max_attempts=1, prompt="",
                     prompt_file=tmp_path / "p.md", workspace=tmp_path, timeout_s=120,
                     env={}, artifacts=(), stdout=cap, stderr=err)
    agent = make_agent(CommandProfile(kind="command", prompt_via="file",
                                      argv=["head", "-c", str(1 << 30), "/dev/zero"]))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert agent.run(inv).exit_code == 0
    cap.close()
    err.close()
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert cap.total == 1 << 30
    assert (tmp_path / "big.log").stat().st_size < 140 * 1024
    assert grown_kib < 64 * 1024  # far below the gigabyte that went through
