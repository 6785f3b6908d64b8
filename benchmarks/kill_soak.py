"""Kill-9 soak: SIGKILL `runtime run` / `runtime resume` at random moments, then check
the ledger says exactly what happened, once (issue 9).

A seeded DAG of --nodes `command` nodes (fan-out and fan-in; every 7th node fails its
first attempt, so the run has retries) runs sandboxed with `--jobs 2`. Each agent sleeps
a random 0-200 ms and writes `out.txt`: its node id plus a checksum of its inputs, so
every artifact's digest is the same in every run of the same DAG.

1. A clean run (no kills) gives the expected statuses and artifact digests.
2. `runtime run ... --run-id soak` in a new session is SIGKILL'd (``os.killpg``) at a
   random moment; then `runtime resume soak` is, again and again, --kills times in all.
   The moment is random but tied to progress, so the kills spread over the whole run
   rather than all landing in interpreter start-up: a third of the rounds kill at a
   uniform moment in the first 1.5 s (start-up, the crash windows before and around
   `run.started`); the rest wait for the process's `run.started` and 0 to k more
   ledger events (k = the clean run's events / --kills - 2, at least 0), then a uniform
   0 to 50 ms. A process that ends before its moment is not killed. Each kill
   of a running attempt never makes its node's third `lost` in a row (see `fair`),
   so a node absorbs at most two kills while it runs (a kill that finds the moment
   unfair lets the runtime go on to its next event and tries again). Kills still owed
   once the run has finished go to resumes of the finished run, during their start-up
   (the window after `run.finished`). The summary says where the kills landed; with
   the defaults, all 50 land mid-run (seeds 1 and 2: about 60-90 s in all, 35-37 lost).
3. A last `runtime resume soak` runs to the end. Then, from the ledger
   (``runtime.ledger.read_events``), the attempt directories, the workspaces and
   ``/proc``: the run succeeded with the clean run's statuses; every node has exactly one
   `node.succeeded` and at most one succeeded attempt (no succeeded node re-run); no
   attempt started after its node's `node.succeeded`; `seq` strictly increasing; every
   `attempt.started` has exactly one `attempt.finished` (terminal; never two) and no
   `attempt.finished` lacks its start; no attempt number started twice; every
   attempt directory's `attempt.json` names its own number; every accepted artifact on
   disk matches the digest in `node.succeeded` and the clean run's; `state.json` agrees;
   no agent process (found by a token in its command line or environment) is left;
   every process that was not killed exited 0.

Prints kills, attempts, lost attempts, wall time and each invariant; exit 1 on any
violation (the work directory is then kept and printed).

    python benchmarks/kill_soak.py [--kills 50] [--nodes 30] [--seed 1] [--keep]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from runtime.digest import file_blake3
from runtime.errors import LedgerError
from runtime.run.events import (
    AttemptFinished,
    AttemptStarted,
    Event,
    NodeFailed,
    NodeSkipped,
    NodeSucceeded,
    RunFinished,
    RunStarted,
    read_events,
)

JOBS = 2
FLAKY_EVERY = 7
ARTIFACT = "out.txt"
FINAL_TIMEOUT_S = 300.0
STARTUP_S = 1.5  # about how long `runtime resume` takes to write run.started here
# $0 is the soak's token (so a leftover process can be found by its command line),
# $1 the node id. Inputs are read in glob order, which is sorted: deterministic content.
AGENT = r"""
ms=$(od -An -N1 -tu1 /dev/urandom); ms=$((ms * 200 / 255))
sleep "$(printf '0.%03d' "$ms")"
{ echo "node $1"; for f in inputs/*/out.txt; do [ -f "$f" ] && cat "$f"; done | cksum; } > out.txt
"""
FLAKY = r"""
if grep -q '"trigger": *"initial"' "$RUNTIME_ATTEMPT_CONTEXT"; then
  echo "flaky: first attempt fails on purpose" >&2; exit 3
fi
""" + AGENT


def topology(nodes: int, rng: random.Random, token: str) -> str:
    """A seeded DAG: a few roots, each later node needing 1-3 of the 8 before it, and a
    final node needing every sink (fan-in)."""
    lines = ["schema_version: 1", "name: kill-soak", "agents:"]
    for name, script in (("cmd", AGENT), ("flaky", FLAKY)):
        argv = ["sh", "-c", script, token, "{node}"]
        lines.append(f"  {name}: {{kind: command, argv: {json.dumps(argv)}, "
                     "prompt_via: file, env: [SOAK_TOKEN]}")
    lines += ["defaults: {agent: cmd, max_attempts: 3}", "nodes:"]
    needs: dict[int, list[int]] = {}
    for i in range(nodes):
        if i < 3 or i == nodes - 1:
            needs[i] = []
        else:
            window = list(range(max(0, i - 8), i))
            needs[i] = sorted(rng.sample(window, min(len(window), rng.choice([1, 1, 2, 3]))))
    if nodes > 1:
        used = {n for deps in needs.values() for n in deps}
        needs[nodes - 1] = [i for i in range(nodes - 1) if i not in used]
    for i in range(nodes):
        agent = ", agent: flaky" if i % FLAKY_EVERY == FLAKY_EVERY - 1 else ""
        deps = ", ".join(f"n{d:02d}" for d in needs[i])
        lines.append(f"  - {{id: n{i:02d}, prompt: t.md.j2, needs: [{deps}]{agent}, "
                     f"artifacts: [{{path: {ARTIFACT}}}]}}")
    return "\n".join(lines) + "\n"


@dataclass
class Project:
    root: Path
    token: str

    @property
    def artifacts(self) -> Path:
        return self.root / "artifacts"

    def run_dir(self, run_id: str) -> Path:
        return self.artifacts / "runs" / run_id

    def argv(self, verb: str, run_id: str) -> list[str]:
        common = ["--prompts", str(self.root / "prompts"), "--artifacts", str(self.artifacts)]
        if verb == "run":
            return [sys.executable, "-m", "runtime", "run", str(self.root / "topology.yaml"),
                    *common, "--jobs", str(JOBS), "--run-id", run_id]
        return [sys.executable, "-m", "runtime", "resume", run_id, *common]

    def start(self, verb: str, run_id: str) -> subprocess.Popen[bytes]:
        env = dict(os.environ, SOAK_TOKEN=self.token)
        return subprocess.Popen(self.argv(verb, run_id), cwd=self.root, env=env,
                                start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)


def make_project(base: Path, nodes: int, seed: int) -> Project:
    token = f"killsoak-{secrets.token_hex(6)}"
    (base / "prompts").mkdir(parents=True)
    (base / "prompts" / "t.md.j2").write_text("Run node {{ node.id }}.\n")
    (base / "topology.yaml").write_text(topology(nodes, random.Random(seed), token))
    return Project(base, token)


def progress(path: Path) -> int:
    """Ledger events that are progress: `run.started` and what follows it, except the
    `lost` records a resume writes first."""
    return sum(1 for e in events_of(path)
               if not (isinstance(e, AttemptFinished) and e.outcome == "lost"))


def fair(path: Path) -> bool:
    """Whether killing now leaves every node short of a third `lost` in a row, which the
    runtime's documented policy (LOST_STREAK_LIMIT, 3) turns into a failed node: the soak
    tests crash consistency, not that rule. Read while the runtime is stopped, so the
    ledger is exactly what the kill would leave: each unfinished attempt becomes lost."""
    streak: Counter[str] = Counter()
    running: set[tuple[str, int]] = set()
    done: set[str] = set()
    for e in events_of(path):
        if isinstance(e, AttemptStarted):
            running.add((e.node, e.attempt))
        elif isinstance(e, AttemptFinished):
            running.discard((e.node, e.attempt))
            streak[e.node] = streak[e.node] + 1 if e.outcome == "lost" else 0
        elif isinstance(e, NodeSucceeded | NodeFailed | NodeSkipped):
            done.add(e.node)
    for node, _ in running:
        streak[node] += 1
    return all(n in done or count < 3 for n, count in streak.items())


def events_of(path: Path) -> list[Event]:
    try:
        return read_events(path)
    except (LedgerError, FileNotFoundError):
        return []


@dataclass
class Round:
    verb: str
    killed: bool
    rc: int
    seconds: float
    stderr: str
    written: int = 0  # ledger events this process appended
    after_finish: bool = False  # the run had finished before this process started


def kill_round(project: Project, verb: str, run_id: str, rng: random.Random,
               spread: int) -> Round:
    """Start one process and SIGKILL its whole session at a random, progress-tied moment."""
    ledger = project.run_dir(run_id) / "ledger.jsonl"
    before = progress(ledger)
    old = events_of(ledger)
    after_finish = any(isinstance(e, RunFinished) for e in old)
    start = time.monotonic()
    proc = project.start(verb, run_id)
    # A finished run's resume writes nothing to wait for: a moment in its start-up.
    if after_finish or rng.random() < 1 / 3:
        deadline: float | None = start + rng.uniform(0.0, STARTUP_S)
        events = 0
    else:
        # This process's run.started, then 0 to `spread` more.
        deadline, events = None, 1 + rng.randint(0, spread)
    while proc.poll() is None:
        now = time.monotonic()
        if deadline is None:
            if progress(ledger) - before >= events:
                deadline = now + rng.uniform(0.0, 0.05)
        elif now >= deadline:
            # Freeze the runtime (its agents run in sessions of their own) so the ledger
            # cannot move between judging the moment and killing at it.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGSTOP)
                if fair(ledger):
                    os.killpg(proc.pid, signal.SIGKILL)
                    break
                os.killpg(proc.pid, signal.SIGCONT)
            deadline = None  # unfair now: a moment after the next progress instead
            before, events = progress(ledger), 1
        time.sleep(0.005)
    _, err = proc.communicate()
    killed = proc.returncode == -signal.SIGKILL
    return Round(verb, killed, proc.returncode, time.monotonic() - start,
                 err.decode(errors="replace")[-1500:], len(events_of(ledger)) - len(old),
                 after_finish)


def finish(project: Project, verb: str, run_id: str) -> Round:
    start = time.monotonic()
    proc = project.start(verb, run_id)
    try:
        _, err = proc.communicate(timeout=FINAL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
    return Round(verb, False, proc.returncode, time.monotonic() - start,
                 err.decode(errors="replace")[-1500:])


def leftover_processes(token: str) -> list[str]:
    """Processes whose command line or environment carries the soak's token."""
    marker, found = token.encode(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue  # gone, or not ours to read
        if marker in cmdline or marker in environ:
            shown = cmdline.replace(b"\0", b" ").decode(errors="replace")[:120]
            found.append(f"pid {entry.name}: {shown}")
    return found


@dataclass
class Checks:
    results: dict[str, list[str]] = field(default_factory=dict)

    def check(self, name: str, problems: list[str]) -> None:
        self.results[name] = problems

    @property
    def ok(self) -> bool:
        return not any(self.results.values())


def node_digests(run_dir: Path) -> dict[str, dict[str, str]]:
    return {e.node: dict(e.artifacts or {}) for e in read_events(run_dir / "ledger.jsonl")
            if isinstance(e, NodeSucceeded)}


def final_status(events: list[Event]) -> str:
    finished = [e for e in events if isinstance(e, RunFinished)]
    return str(finished[-1].status) if finished else "no run.finished"


def check_ledger(events: list[Event], nodes: list[str], clean: dict[str, dict[str, str]],
                 checks: Checks) -> None:
    status = final_status(events)
    checks.check("run succeeded", [] if status == "succeeded" else [f"status {status}"])
    succeeded = Counter(e.node for e in events if isinstance(e, NodeSucceeded))
    checks.check("statuses match the clean run",
                 [f"{n}: not succeeded" for n in nodes if n in clean and not succeeded[n]])
    checks.check("exactly one node.succeeded per node",
                 [f"{n}: {succeeded[n]}" for n in nodes if succeeded[n] != 1])
    seqs = [e.seq for e in events]
    checks.check("seq strictly increasing",
                 [f"seq {b} after {a}" for a, b in itertools.pairwise(seqs) if b <= a])
    done_at: dict[str, int] = {}
    late, starts = [], Counter[tuple[str, int]]()
    finishes: dict[tuple[str, int], list[AttemptFinished]] = defaultdict(list)
    for e in events:
        if isinstance(e, NodeSucceeded):
            done_at.setdefault(e.node, e.seq)
        elif isinstance(e, AttemptStarted):
            starts[(e.node, e.attempt)] += 1
            if e.node in done_at:
                late.append(f"{e.node} attempt {e.attempt} started at seq {e.seq}, after "
                            f"node.succeeded at seq {done_at[e.node]}")
        elif isinstance(e, AttemptFinished):
            finishes[(e.node, e.attempt)].append(e)
    checks.check("no attempt after node.succeeded", late)
    checks.check("no attempt number started twice",
                 [f"{n} attempt {a}: {c} starts" for (n, a), c in starts.items() if c > 1])
    checks.check("at most one attempt.finished per attempt",
                 [f"{n} attempt {a}: {len(f)}" for (n, a), f in finishes.items() if len(f) > 1])
    checks.check("every attempt terminal",
                 [f"{n} attempt {a}: no attempt.finished" for (n, a) in starts
                  if not finishes.get((n, a))]
                 + [f"{n} attempt {a}: attempt.finished without attempt.started"
                    for (n, a) in finishes if (n, a) not in starts])
    won = Counter(n for (n, _), fs in finishes.items() for f in fs if f.outcome == "succeeded")
    checks.check("no succeeded node re-run (one succeeded attempt per node)",
                 [f"{n}: {c} succeeded attempts" for n, c in won.items() if c > 1])


def check_disk(run_dir: Path, events: list[Event], clean: dict[str, dict[str, str]],
               checks: Checks) -> None:
    problems = []
    for node_dir in sorted((run_dir / "nodes").iterdir()):
        for adir in sorted((node_dir / "attempts").glob("*")):
            try:
                number = json.loads((adir / "attempt.json").read_bytes())["attempt"]
            except (OSError, ValueError, KeyError) as exc:
                # A crash between claiming the directory and writing attempt.json.
                started = any(isinstance(e, AttemptStarted) and e.node == node_dir.name
                              and str(e.attempt) == adir.name for e in events)
                if started:
                    problems.append(f"{adir}: started but unreadable: {exc}")
                continue
            if str(number) != adir.name:
                problems.append(f"{adir}: attempt.json says attempt {number}")
    checks.check("attempt directories hold their own number", problems)
    problems = []
    for e in events:
        if not isinstance(e, NodeSucceeded):
            continue
        for path, digest in (e.artifacts or {}).items():
            on_disk = run_dir / "nodes" / e.node / "workspace" / path
            actual = file_blake3(on_disk) if on_disk.is_file() else "missing"
            if actual != digest:
                problems.append(f"{e.node}/{path}: disk {actual[:12]} != ledger {digest[:12]}")
            if clean.get(e.node, {}).get(path) != digest:
                problems.append(f"{e.node}/{path}: ledger {digest[:12]} != clean run")
        if e.artifacts is None:
            problems.append(f"{e.node}: node.succeeded records no artifacts")
    checks.check("accepted artifacts match node.succeeded and the clean run", problems)
    try:
        state = json.loads((run_dir / "state.json").read_bytes())["status"]
    except (OSError, ValueError, KeyError) as exc:
        state = f"unreadable ({exc})"
    checks.check("state.json agrees", [] if state == final_status(events) else
                 [f"state.json {state}, ledger {final_status(events)}"])


def soak(args: argparse.Namespace, work: Path) -> int:
    rng = random.Random(args.seed)
    project = make_project(work, args.nodes, args.seed)
    nodes = [f"n{i:02d}" for i in range(args.nodes)]
    t0 = time.monotonic()
    clean_round = finish(project, "run", "clean")
    clean_s = time.monotonic() - t0
    if clean_round.rc != 0:
        print(f"clean run failed ({clean_round.rc}):\n{clean_round.stderr}")
        return 1
    clean = node_digests(project.run_dir("clean"))
    clean_events = read_events(project.run_dir("clean") / "ledger.jsonl")
    clean_attempts = sum(isinstance(e, AttemptStarted) for e in clean_events)
    # Spread the kills over the whole run: about len(clean_events) / kills events a round.
    spread = max(0, round(len(clean_events) / max(args.kills, 1)) - 2)

    soak_start = time.monotonic()
    rounds: list[Round] = []
    while sum(r.killed for r in rounds) < args.kills and len(rounds) < 3 * args.kills:
        # What an operator would do: `run` until the run directory exists, then `resume`.
        verb = "resume" if project.run_dir("soak").exists() else "run"
        rounds.append(kill_round(project, verb, "soak", rng, spread))
    verb = "resume" if project.run_dir("soak").exists() else "run"
    rounds.append(finish(project, verb, "soak"))
    soak_s = time.monotonic() - soak_start

    run_dir = project.run_dir("soak")
    events = read_events(run_dir / "ledger.jsonl")
    checks = Checks()
    check_ledger(events, nodes, clean, checks)
    check_disk(run_dir, events, clean, checks)
    checks.check("no agent process left", leftover_processes(project.token))
    checks.check("every process not killed exited 0",
                 [f"round {i} ({r.verb}): exit {r.rc}: {r.stderr.strip()[-300:]}"
                  for i, r in enumerate(rounds) if not r.killed and r.rc != 0])

    started = [e for e in events if isinstance(e, AttemptStarted)]
    outcomes = Counter(str(e.outcome) for e in events if isinstance(e, AttemptFinished))
    resumes = sum(1 for e in events if isinstance(e, RunStarted) and e.resumed)
    killed = [r for r in rounds if r.killed]
    where = Counter("after run.finished" if r.after_finish else
                    "before the process wrote an event" if r.written == 0 else
                    "after it wrote 1-3 events" if r.written <= 3 else
                    "after it wrote 4 or more" for r in killed)
    print(f"kill soak: {args.nodes} nodes, --jobs {JOBS}, seed {args.seed}, sandboxed")
    print(f"clean run: {clean_s:.2f} s, {clean_attempts} attempts")
    print(f"kills: {len(killed)} of {args.kills} asked ({len(rounds)} processes, the last a "
          f"resume to the end in {rounds[-1].seconds:.2f} s; {resumes} resumes reached "
          f"run.started); killed {dict(where)}")
    print(f"attempts: {len(started)} total ({clean_attempts} in the clean run), lost "
          f"{outcomes.get('lost', 0)}, outcomes {dict(sorted(outcomes.items()))}")
    print(f"wall time: {soak_s:.1f} s soak + {clean_s:.1f} s clean run")
    for name, problems in checks.results.items():
        print(f"  {'ok  ' if not problems else 'FAIL'} {name}")
        for p in problems[:10]:
            print(f"         {p}")
        if len(problems) > 10:
            print(f"         ... {len(problems) - 10} more")
    return 0 if checks.ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--nodes", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    if args.kills < 0 or args.nodes < 2:
        parser.error("--kills must be >= 0 and --nodes >= 2")
    work = Path(tempfile.mkdtemp(prefix="kill-soak-"))
    code = 1
    try:
        code = soak(args, work)
    finally:
        if code == 0 and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"work directory kept: {work}")
    return code


if __name__ == "__main__":
    sys.exit(main())
