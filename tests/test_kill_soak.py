"""SIGKILL at exact ledger boundaries, then recover from the CLI (issue 9).

``benchmarks/kill_soak.py`` kills at random moments; these tests kill at the moments
that matter, deterministically: the real ``python -m runtime`` runs with
``Ledger.append`` wrapped so that the process group SIGKILLs itself just before or just
after the n-th event of one kind. Then ``runtime resume`` (or, when the crash left no
run to resume, ``runtime run`` again) must finish the run with the same record a clean
run gives: every node succeeded once, no succeeded node re-run, every attempt terminal,
``state.json`` in step with the ledger, no agent left running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from runtime.run.events import (
    AttemptFinished,
    AttemptStarted,
    NodeSucceeded,
    RunFinished,
    read_events,
)

RUN_ID = "soak"
TOKEN = "kill-soak-test-token"
# Kills the runtime's whole process group (it runs in a new session, like the soak's
# os.killpg) at CRASH_AT=<before|after>:<event>:<n>; page-cache writes survive, as after
# a real kill -9.
CRASHER = """
import os, runpy, signal, sys
import runtime.run.ledger as ledger

where, kind, nth = os.environ["CRASH_AT"].split(":")
seen = [0]
original = ledger.Ledger.append

def append(self, event, **kwargs):
    hit = event.event == kind and (seen.__setitem__(0, seen[0] + 1) or seen[0] == int(nth))
    if hit and where == "before":
        os.killpg(os.getpgrp(), signal.SIGKILL)
    out = original(self, event, **kwargs)
    if hit and where == "after":
        os.killpg(os.getpgrp(), signal.SIGKILL)
    return out

ledger.Ledger.append = append
sys.argv = ["runtime", *sys.argv[1:]]
runpy.run_module("runtime", run_name="__main__")
"""
AGENT = "sleep 0.05; echo \"$1\" > out.txt"


def _project(root: Path) -> Path:
    (root / "prompts").mkdir()
    (root / "prompts" / "t.md.j2").write_text("Run node {{ node.id }}.\n")
    argv = json.dumps(["sh", "-c", AGENT, TOKEN, "{node}"])
    nodes = {"a": [], "b": ["a"], "c": ["a"], "d": ["b", "c"]}
    lines = ["schema_version: 1", "name: kill-test", "agents:",
             f"  cmd: {{kind: command, argv: {argv}, prompt_via: file}}",
             # max_attempts 1: a succeeded attempt re-run, or charged twice, shows at once.
             "defaults: {agent: cmd, max_attempts: 1}", "nodes:"]
    lines += [f"  - {{id: {n}, prompt: t.md.j2, needs: [{', '.join(d)}], "
              "artifacts: [{path: out.txt}]}" for n, d in nodes.items()]
    (root / "topology.yaml").write_text("\n".join(lines) + "\n")
    return root


def _cli(root: Path, args: list[str], crash_at: str | None = None
         ) -> subprocess.CompletedProcess[str]:
    common = ["--prompts", str(root / "prompts"), "--artifacts", str(root / "artifacts")]
    env = dict(os.environ)
    prefix = [sys.executable, "-m", "runtime"]
    if crash_at is not None:
        env["CRASH_AT"] = crash_at
        prefix = [sys.executable, "-c", CRASHER]
    return subprocess.run([*prefix, *args, *common], cwd=root, env=env, text=True,
                          capture_output=True, start_new_session=True, timeout=120,
                          check=False)


def _run_args(root: Path) -> list[str]:
    return ["run", str(root / "topology.yaml"), "--jobs", "2", "--run-id", RUN_ID]


def _leftovers() -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and TOKEN.encode() in (entry / "cmdline").read_bytes():
                found.append(entry.name)
        except OSError:
            continue
    return found


def _problems(run_dir: Path) -> list[str]:
    events = read_events(run_dir / "ledger.jsonl")
    problems = []
    finished = [e for e in events if isinstance(e, RunFinished)]
    if not finished or finished[-1].status != "succeeded":
        problems.append(f"run status {finished[-1].status if finished else 'unfinished'}")
    once = Counter(e.node for e in events if isinstance(e, NodeSucceeded))
    problems += [f"{n}: {once[n]} node.succeeded" for n in "abcd" if once[n] != 1]
    won = Counter(e.node for e in events
                  if isinstance(e, AttemptFinished) and e.outcome == "succeeded")
    problems += [f"{n}: {c} succeeded attempts (re-run)" for n, c in won.items() if c > 1]
    starts = Counter((e.node, e.attempt) for e in events if isinstance(e, AttemptStarted))
    ends = Counter((e.node, e.attempt) for e in events if isinstance(e, AttemptFinished))
    problems += [f"{k}: started {starts[k]}, finished {ends[k]}"
                 for k in starts | ends if starts[k] != 1 or ends[k] != 1]
    seqs = [e.seq for e in events]
    problems += ["seq not increasing"] if seqs != sorted(set(seqs)) else []
    state = json.loads((run_dir / "state.json").read_text())["status"]
    problems += [f"state.json says {state}"] if state != "succeeded" else []
    return problems


CRASH_POINTS = [
    # run.started is staged with the run directory and renamed into place (the crash
    # before the rename is test_resume's); the earliest window here is just after it.
    pytest.param("before:attempt.started:1", id="run-laid-out-nothing-started"),
    pytest.param("after:attempt.started:1", id="agent-running"),
    pytest.param("before:node.succeeded:1", id="attempt-succeeded-no-node-succeeded"),
    pytest.param("after:node.succeeded:2", id="between-nodes"),
    pytest.param("after:run.finished:1", id="after-run-finished"),
]


@pytest.mark.parametrize("crash_at", CRASH_POINTS)
def test_a_kill_at_a_ledger_boundary_resumes_to_a_clean_record(tmp_path: Path,
                                                               crash_at: str) -> None:
    root = _project(tmp_path)
    killed = _cli(root, _run_args(root), crash_at=crash_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = _cli(root, ["resume", RUN_ID])
    if resumed.returncode != 0 and "run.started" in resumed.stderr:
        # Issue 9 allows either: completed from its recorded intent, or cleanly reusable.
        resumed = _cli(root, _run_args(root))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert _problems(root / "artifacts" / "runs" / RUN_ID) == []
    assert _leftovers() == []
