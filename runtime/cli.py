"""Command line: ``runtime VERB ...`` (DESIGN section 8). Thin: parse, call, print, exit.

Exit status: 0 when everything asked for succeeded, 1 when a run or check failed,
2 for invalid input. Errors print one message naming the file, field or node; never a
traceback (set RUNTIME_DEBUG=1 to get one).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import math
import os
import re
import shlex
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from runtime.errors import DagRuntimeError, InputError, UsageError
from runtime.plan.compile import plan_topology, write_plan
from runtime.plan.graph import to_dot, to_mermaid
from runtime.plan.manifest import read_manifest
from runtime.plan.topology import Topology
from runtime.plan.verify import diff_golden, golden_bytes, golden_of, read_golden, verify_plan_dir

EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_INTERRUPTED = 0, 1, 2, 130

Handler = Callable[[argparse.Namespace], int]


def _common(p: argparse.ArgumentParser, *, plans: bool) -> None:
    p.add_argument("--prompts", type=Path, default=Path("prompts"),
                   help="template root (default ./prompts)")
    p.add_argument("--artifacts", type=Path, default=Path("artifacts"),
                   help="output root (default ./artifacts)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    if plans:
        p.add_argument("--var", action="append", default=[], metavar="KEY=VALUE",
                       help="override a topology variable (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    """The ``runtime`` command line: every verb, its options and their help."""
    parser = argparse.ArgumentParser(
        prog="runtime",
        description="Plan security-analysis agent topologies into sealed, digest-addressed "
        "plans; run them with durable attempts and retry feedback; verify digests in CI.",
        epilog="Exit status: 0 all succeeded, 1 a run or check failed, 2 invalid input, "
        "130 interrupted. See README.md for the topology format.")
    parser.add_argument("-v", "--verbose", action="count", default=0)
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = sub.add_parser("plan", help="compile topologies into sealed plans")
    p.add_argument("topologies", nargs="+", type=Path, metavar="TOPOLOGY")
    p.add_argument("--golden-out", type=_file_path, metavar="FILE",
                   help="also write the golden digest file for `verify --golden`")
    _common(p, plans=True)
    p.set_defaults(handler=cmd_plan)

    p = sub.add_parser("verify", help="check a plan directory, or a topology against golden "
                       "digests")
    p.add_argument("target", type=Path, metavar="PLAN|TOPOLOGY")
    p.add_argument("--golden", type=Path, metavar="FILE")
    p.add_argument("--digest", metavar="HEX", help="the plan digest a PLAN must have")
    _common(p, plans=True)
    p.set_defaults(handler=cmd_verify)

    p = sub.add_parser("graph", help="print a topology's DAG")
    p.add_argument("target", type=Path, metavar="TOPOLOGY|PLAN")
    p.add_argument("--format", choices=["mermaid", "dot"], default="mermaid")
    _common(p, plans=True)
    p.set_defaults(handler=cmd_graph)

    p = sub.add_parser("run", help="plan (if needed) and run a topology or plan directory")
    p.add_argument("target", type=Path, metavar="TOPOLOGY|PLAN")
    _run_options(p)
    p.add_argument("--run-id", help="name the run (default: <topology>-<UTC time>-<random>)")
    _engine_options(p)
    _common(p, plans=True)
    p.set_defaults(handler=cmd_run)

    p = sub.add_parser("resume", help="finish an interrupted or crashed run")
    p.add_argument("run", metavar="RUN", help="run directory, or run id under --artifacts")
    _redact_options(p)
    p.add_argument("--deadline", type=float, metavar="SECONDS",
                   help="a new wall-clock limit for the rest of the run, from now")
    _engine_options(p)
    _common(p, plans=False)
    p.set_defaults(handler=cmd_resume)

    p = sub.add_parser("retry", help="re-run the failed, cancelled and skipped nodes of a "
                       "finished run in place, or of every run of a batch that did not succeed")
    p.add_argument("target", metavar="RUN|BATCH_ID",
                   help="run directory or run id, or batch id, under --artifacts")
    p.add_argument("--agent", metavar="PROFILE", help="run the retried nodes on this profile")
    p.add_argument("--set", action="append", default=[], dest="sets",
                   metavar="NODE.FIELD=VALUE", help="override retry settings for the retry")
    p.add_argument("--no-fallback", action="store_true", help="use only the primary profile")
    p.add_argument("--deadline", type=float, metavar="SECONDS",
                   help="a wall-clock limit for the retry, from now")
    _engine_options(p)
    _redact_options(p)
    _common(p, plans=False)
    p.set_defaults(handler=cmd_retry)

    p = sub.add_parser("batch", help="plan and run many topologies, with one summary")
    p.add_argument("paths", nargs="+", type=Path, metavar="PATH",
                   help="topology files, or directories of *.yaml")
    p.add_argument("--jobs", type=int, default=2, metavar="N", help="topologies at once")
    p.add_argument("--node-jobs", type=int, default=1, metavar="M",
                   help="parallel nodes within each topology")
    p.add_argument("--batch-id", help="name the batch; the same id again resumes it")
    p.add_argument("--no-progress", action="store_true", help="no live display")
    _override_options(p)
    _limit_options(p)
    _engine_options(p)
    _common(p, plans=True)
    p.set_defaults(handler=cmd_batch)

    p = sub.add_parser("show", help="per-node status, attempts, failures of a run")
    p.add_argument("run", metavar="RUN", help="run directory, or run id under --artifacts")
    _common(p, plans=False)
    p.set_defaults(handler=cmd_show)

    p = sub.add_parser("doctor", help="check the agent profiles plans would use: program, "
                       "version, login (the pre-flight of run and batch)")
    p.add_argument("targets", nargs="*", type=Path, metavar="TOPOLOGY|PLAN",
                   help="topology files, plan or topology directories (default: topologies/)")
    p.add_argument("--agent", metavar="PROFILE", help="check only this profile, as "
                   "`run --agent PROFILE` would use it")
    _common(p, plans=True)
    p.set_defaults(handler=cmd_doctor)

    p = sub.add_parser("findings", help="merge the SARIF findings of a run or batch")
    p.add_argument("target", metavar="RUN|BATCH_ID",
                   help="run or batch directory, or a run or batch id under --artifacts")
    p.add_argument("--format", choices=["sarif", "json", "table"], default=None,
                   help="sarif: one SARIF 2.1.0 log; json: flat findings with counts; "
                   "table (default)")
    p.add_argument("-o", "--output", type=_file_path, metavar="FILE",
                   help="write to FILE instead of stdout")
    _common(p, plans=False)
    p.set_defaults(handler=cmd_findings)

    p = sub.add_parser("schema", help="print the topology JSON Schema")
    _common(p, plans=False)
    p.set_defaults(handler=cmd_schema)
    return parser


def _override_options(p: argparse.ArgumentParser) -> None:
    """Options shared by `run` and `batch`: what runs, without touching prompt digests."""
    p.add_argument("--agent", metavar="PROFILE",
                   help="run every node on this profile (e.g. simulated); digests unchanged")
    p.add_argument("--set", action="append", default=[], dest="sets",
                   metavar="NODE.FIELD=VALUE",
                   help="override max_attempts, retry_feedback or retry_on for this run "
                   "(NODE may be '*'); prompt digests are unchanged")
    _redact_options(p)
    p.add_argument("--no-preflight", action="store_true",
                   help="skip the agent checks of `runtime doctor` before the first node")


def _redact_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redact-file", action="append", default=[], type=Path, metavar="FILE",
                   help="literals to redact from error text, one per line (repeatable; "
                   "also RUNTIME_REDACT, ':'-separated)")
    # Refused with an explanation (issue 8): a secret in argv is readable by every process.
    p.add_argument("--redact", action="append", default=[], help=argparse.SUPPRESS)


def _run_options(p: argparse.ArgumentParser) -> None:
    _override_options(p)
    p.add_argument("--jobs", type=int, default=1, metavar="N", help="parallel nodes (default 1)")
    _limit_options(p)


def _limit_options(p: argparse.ArgumentParser) -> None:
    """Run options `run` and `batch` share (a batch applies them to each run)."""
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="per-attempt timeout of every node (same as --set '*.timeout_s=V')")
    p.add_argument("--no-fallback", action="store_true",
                   help="never move a node to its fallback profiles")
    p.add_argument("--max-total-attempts", type=int, metavar="N",
                   help="attempt budget for the whole run (default: no limit beyond nodes')")
    p.add_argument("--deadline", type=float, metavar="SECONDS",
                   help="wall-clock limit for the run, from its start")
    p.add_argument("--operator-prompt", type=Path, metavar="FILE",
                   help="trusted operator text added to every attempt's prompt")


def parse_vars(pairs: Sequence[str]) -> dict[str, str]:
    """Parse ``--var KEY=VALUE`` pairs; a pair without ``=`` is a usage error naming it."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--var {pair!r}: expected KEY=VALUE")
        if not _is_utf8(pair):
            # Undecodable argv bytes arrive as lone surrogates, which cannot be rendered,
            # hashed or written (issue 9: a UnicodeEncodeError traceback).
            raise UsageError(f"--var {pair!a}: not valid UTF-8; pass UTF-8 text")
        out[key] = value
    return out


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# Bounds of the numeric options (issue 9: --jobs 300 and --max-total-attempts 0 were
# pydantic tracebacks, --deadline 0 or nan meant no deadline and -5 was accepted).
MAX_JOBS = 256
OPERATOR_PROMPT_MAX_BYTES = 1024 * 1024


def _check_count(flag: str, value: int | None, low: int, high: int | None) -> None:
    if value is None:
        return
    if value < low or (high is not None and value > high):
        accepted = f"from {low} to {high}" if high is not None else f"at least {low}"
        raise UsageError(f"{flag} {value}: must be {accepted}")


def _check_deadline(seconds: float | None) -> None:
    """``--deadline SECONDS`` must be finite and positive; left out, there is none."""
    if seconds is not None and (not math.isfinite(seconds) or seconds <= 0):
        raise UsageError(f"--deadline {seconds:g}: must be a positive, finite number of "
                         "seconds (leave it out for no deadline)")


def _timeout_set(seconds: float | None) -> tuple[str, ...]:
    """``--timeout S`` as the ``--set`` it stands for (its range checked there)."""
    if seconds is None:
        return ()
    from runtime.run.overrides import parse_value

    # Checked here, so an error names --timeout as written, not the --set it becomes.
    parse_value("timeout_s", repr(seconds), f"--timeout {seconds:g}")
    return (f"*.timeout_s={seconds!r}",)


def _deadline_at(seconds: float | None) -> float | None:
    """A checked ``--deadline`` as a Unix time from now."""
    _check_deadline(seconds)
    return None if seconds is None else time.time() + seconds


def _check_output_paths(args: argparse.Namespace) -> None:
    """``--artifacts`` must be (or become) a directory, ``--golden-out`` a file.

    Checked before anything is written (issue 9: both were tracebacks, after a plan was
    written).
    """
    _check_path("--artifacts", args.artifacts, want_dir=True)
    golden_out = getattr(args, "golden_out", None)
    if golden_out is not None:
        _check_path("--golden-out", golden_out, want_dir=False)


def _check_path(flag: str, path: Path, *, want_dir: bool) -> None:
    if path.exists() and path.is_dir() != want_dir:
        kind = "is a directory; give a file path" if path.is_dir() else \
            "is not a directory; give a directory (it is created if missing)"
        raise UsageError(f"{flag} {path}: {kind}")
    for where in (path, *path.parents):
        if where.exists():
            if where != path and not where.is_dir():
                raise UsageError(f"{flag} {path}: {where} is not a directory")
            if not os.access(where if where.is_dir() else where.parent, os.W_OK):
                raise UsageError(f"{flag} {path}: {where} cannot be written (read-only, or "
                                 "not yours); give a path the runtime can write")
            break


def _file_path(text: str) -> Path:
    """An output file's path (argparse type): one ending in ``/`` names a directory."""
    if text.endswith("/"):
        raise argparse.ArgumentTypeError(f"{text} names a directory; give a file path")
    return Path(text)


def _read_operator_prompt(path: Path) -> str:
    from runtime.files import read_regular

    try:
        raw = read_regular(path, OPERATOR_PROMPT_MAX_BYTES)
    except OSError as exc:
        raise UsageError(f"--operator-prompt {path}: cannot read: {exc.strerror}") from None
    except ValueError as exc:
        raise UsageError(f"--operator-prompt {path}: {exc}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"--operator-prompt {path}: not UTF-8 (byte 0x{raw[exc.start]:02x} "
                         f"at offset {exc.start}); save it as UTF-8") from None


def _emit(args: argparse.Namespace, obj: dict[str, Any], text: str) -> None:
    if args.json:
        sys.stdout.write(json.dumps(obj, sort_keys=True) + "\n")
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")


def cmd_plan(args: argparse.Namespace) -> int:
    """``runtime plan``: compile topologies into sealed plan directories."""
    overrides = parse_vars(args.var)
    if args.golden_out and len(args.topologies) != 1:
        raise UsageError("--golden-out takes exactly one TOPOLOGY")
    _check_output_paths(args)
    # Compile everything before writing anything: one bad topology writes nothing.
    compiled = [(path, plan_topology(path, args.prompts, overrides)) for path in args.topologies]
    results, lines = [], []
    for path, plan in compiled:
        plan_dir = write_plan(plan, args.artifacts)
        m = plan.manifest
        results.append({"topology": m.topology.name, "source": str(path),
                        "plan_digest": plan.digest, "plan_dir": str(plan_dir),
                        "nodes": {n: v.prompt_digest for n, v in sorted(m.nodes.items())}})
        lines.append(f"{m.topology.name}: plan {plan.digest}\n  {plan_dir} "
                     f"({len(m.nodes)} nodes, {len(plan.prompts)} prompt files)")
        if args.golden_out:
            args.golden_out.parent.mkdir(parents=True, exist_ok=True)
            args.golden_out.write_bytes(golden_bytes(golden_of(plan, overrides)))
            lines.append(f"  golden digests written to {args.golden_out}")
    obj = results[0] if len(results) == 1 else {"plans": results}
    _emit(args, obj, "\n".join(lines))
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    """``runtime verify``: check a plan directory's digests, or a topology against its golden."""
    target: Path = args.target
    if args.digest is not None and not re.fullmatch(r"[0-9a-f]{64}", args.digest):
        raise UsageError(f"--digest {args.digest!r}: a plan digest is 64 lowercase hex "
                         "characters (plan.json's blake3, as `runtime plan` prints it)")
    if target.is_dir():
        if args.golden:
            raise UsageError("--golden checks a TOPOLOGY file, not a plan directory")
        problems = verify_plan_dir(target, expected_digest=args.digest)
        digest = None if problems else _plan_digest(target)
    elif target.is_file():
        if not args.golden:
            raise UsageError(f"{target}: verifying a topology needs --golden FILE "
                             "(written by `runtime plan TOPOLOGY --golden-out FILE`)")
        golden = read_golden(args.golden)
        overrides = {**golden.vars, **parse_vars(args.var)}
        plan = plan_topology(target, args.prompts, overrides)
        problems = diff_golden(golden, golden_of(plan, overrides))
        digest = plan.digest
        if problems and golden.topology == plan.manifest.topology.name:
            problems.append(f"if the change is intended, update the golden file: runtime plan "
                            f"{target} --golden-out {args.golden}")
    else:
        raise UsageError(f"{target}: no such plan directory or topology file")
    text = "\n".join(problems) if problems else f"OK {target}: plan {digest}"
    _emit(args, {"ok": not problems, "target": str(target), "plan_digest": digest,
                 "differences": problems}, text)
    return EXIT_FAILED if problems else EXIT_OK


def _plan_digest(plan_dir: Path) -> str:
    from runtime.digest import file_blake3
    from runtime.plan.manifest import MANIFEST_NAME

    return file_blake3(plan_dir / MANIFEST_NAME)


def cmd_graph(args: argparse.Namespace) -> int:
    """``runtime graph``: draw a topology or plan's DAG."""
    if args.target.is_dir():
        manifest = read_manifest(args.target)[0]
    else:
        manifest = plan_topology(args.target, args.prompts, parse_vars(args.var)).manifest
    text = to_dot(manifest) if args.format == "dot" else to_mermaid(manifest)
    _emit(args, {"format": args.format, "graph": text}, text)
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    """``runtime run``: plan (or verify) and execute one topology or plan directory."""
    from runtime.plan.manifest import PROMPTS_DIR
    from runtime.run.layout import check_run_id
    from runtime.run.overrides import parse_sets
    from runtime.run.records import RunSettings
    from runtime.run.start import check_settings, start_run

    redactor = _redactor(args)  # before planning: a refused option writes nothing
    target: Path = args.target
    _check_output_paths(args)
    _check_count("--jobs", args.jobs, 1, MAX_JOBS)
    _check_count("--max-total-attempts", args.max_total_attempts, 1, None)
    _check_deadline(args.deadline)
    if args.run_id is not None:
        check_run_id(args.run_id)
        if (args.artifacts / "runs" / args.run_id).exists():
            raise UsageError(f"run {args.run_id} already exists under {args.artifacts}/runs; "
                             f"continue it with `runtime resume {args.run_id}` or choose "
                             "another --run-id")
    operator_prompt = _read_operator_prompt(args.operator_prompt) \
        if args.operator_prompt else None
    compiled = None
    if target.is_dir() and (target / PROMPTS_DIR).is_dir():
        plan_dir, verified = target, False
        manifest = read_manifest(plan_dir)[0]
    elif target.is_file():
        compiled = plan_topology(target, args.prompts, parse_vars(args.var))
        manifest = compiled.manifest
    elif not target.exists():
        raise UsageError(f"{target}: no such file (give a topology file or a plan directory)")
    else:
        raise UsageError(f"{target}: not a topology file or plan directory")
    settings = RunSettings(
        agent=args.agent, jobs=args.jobs, no_fallback=args.no_fallback,
        max_total_attempts=args.max_total_attempts,
        overrides=parse_sets([*args.sets, *_timeout_set(args.timeout)], manifest),
        operator_prompt=operator_prompt)
    check_settings(manifest, settings)
    if not args.no_preflight:
        settings = _preflight(manifest, settings, redactor)
    # Before anything is written: an engine that cannot start (an unreachable
    # --ray-address) is a usage error that leaves no plan or run directory.
    engine = _engine(args)
    if compiled is not None:
        # Only now that every option is known good: write_plan verifies a plan
        # directory it reuses, and writes a new one itself.
        plan_dir, verified = write_plan(compiled, args.artifacts), True
    # The deadline counts from the run's start, not from before planning.
    settings = settings.model_copy(update={"deadline_at": _deadline_at(args.deadline)})
    with _cancel_on_signals() as cancel:
        result = start_run(plan_dir, args.artifacts, settings, run_id=args.run_id,
                           redactor=redactor, hooks=_hooks(cancel, args, engine),
                           verified=verified)
    return _report_run(args, result)


def _preflight(manifest: Any, settings: Any, redactor: Any) -> Any:
    """Refuse (exit 2) or skip the profiles that cannot run (runtime/preflight.py)."""
    from runtime.run.preflight import notes, preflight_run
    from runtime.run.start import check_settings

    check_settings(manifest, settings)
    settings, decision = preflight_run(manifest, settings, redactor=redactor)
    for line in notes(decision):
        sys.stderr.write(line + "\n")
    return settings


def cmd_doctor(args: argparse.Namespace) -> int:
    """``runtime doctor``: run the agent profiles' pre-flight checks, writing nothing."""
    from runtime.run.preflight import checks_json, doctor, load_manifests, render_checks

    targets = args.targets or [Path("topologies")]
    manifests = load_manifests(targets, args.prompts, parse_vars(args.var))
    checks, decisions = doctor(manifests, args.agent, redactor=_env_redactor([]))
    _emit(args, checks_json(checks, decisions), render_checks(checks, decisions))
    return EXIT_OK if all(c.ok for c in checks) else EXIT_FAILED


def cmd_batch(args: argparse.Namespace) -> int:
    """``runtime batch``: run many topologies, then write the summary, findings and report."""
    from rich.console import Console

    from runtime.batch import BatchOptions, expand, run_batch
    from runtime.progress import LineProgress, LiveProgress, summary_table
    from runtime.report.html import render_batch_report, render_run_report

    _check_count("--jobs", args.jobs, 1, MAX_JOBS)
    _check_count("--node-jobs", args.node_jobs, 1, MAX_JOBS)
    _check_output_paths(args)
    topologies = expand(args.paths)
    _check_count("--max-total-attempts", args.max_total_attempts, 1, None)
    _check_deadline(args.deadline)
    operator_prompt = _read_operator_prompt(args.operator_prompt) \
        if args.operator_prompt else None
    options = BatchOptions(prompts=args.prompts, artifacts=args.artifacts, jobs=args.jobs,
                           node_jobs=args.node_jobs, agent=args.agent,
                           sets=(*args.sets, *_timeout_set(args.timeout)),
                           batch_id=args.batch_id, redactor=_redactor(args),
                           preflight=not args.no_preflight, no_fallback=args.no_fallback,
                           max_total_attempts=args.max_total_attempts,
                           deadline_at=_deadline_at(args.deadline),
                           operator_prompt=operator_prompt, variables=parse_vars(args.var),
                           engine=_engine(args))
    console = Console(stderr=True)
    live = not args.no_progress and not args.json and console.is_terminal

    def with_report(entry: Any) -> Any:
        if entry.run_dir is None:
            return entry
        return entry.model_copy(update={"report": str(render_run_report(Path(entry.run_dir)))})

    with _cancel_on_signals() as cancel:
        if live:
            with LiveProgress(console, len(topologies)) as progress:
                summary = run_batch(topologies, options, progress, cancel, with_report)
        else:  # CI, a pipe: one line per node event, prefixed with the topology
            lines = None if args.json else LineProgress(sys.stderr)
            summary = run_batch(topologies, options, lines, cancel, with_report)
    batch_dir = args.artifacts / "batches" / summary.batch_id
    report = render_batch_report(summary, batch_dir)
    if args.json:
        sys.stdout.write(summary.model_dump_json() + "\n")
    else:
        # Piped output gets a fixed width rather than rich's 80-column default.
        Console(width=None if sys.stdout.isatty() else 120).print(summary_table(summary))
        for e in summary.entries:
            if e.error:
                sys.stdout.write(f"{e.source}: {e.error}\n")
        sys.stdout.write(f"findings: {_counts_text(summary.findings)} in "
                         f"{batch_dir / 'findings.sarif'}\n")
        sys.stdout.write(f"summary: {batch_dir / 'summary.json'}\nreport: {report}\n")
    if summary.status == "cancelled":
        # The same command (its --prompts and --var decide the plans, its other options
        # the runs not started yet), from the same directory, with the batch's id.
        again = ["runtime", *args.argv]
        if args.batch_id is None:
            again += ["--batch-id", summary.batch_id]
        sys.stderr.write(f"interrupted; the batch is resumable: cd {shlex.quote(os.getcwd())} "
                         f"&& {shlex.join(again)}\n")
    return _exit_for(summary.status)


def cmd_resume(args: argparse.Namespace) -> int:
    """``runtime resume``: continue an interrupted run."""
    from runtime.failures import RunStatus
    from runtime.run.read import resolve_run_dir
    from runtime.run.start import resume_run

    deadline_at = _deadline_at(args.deadline)
    redactor = _redactor(args)
    run_dir = resolve_run_dir(args.run, args.artifacts)
    with _cancel_on_signals() as cancel:
        result = resume_run(run_dir, redactor=redactor, hooks=_hooks(cancel, args),
                            deadline_at=deadline_at)
    if not result.resumed and result.status is not RunStatus.SUCCEEDED:
        sys.stderr.write(f"run {result.run_id} had already finished ({result.status}): "
                         f"nothing to resume; `runtime retry {run_dir}` re-runs its failed "
                         "and skipped nodes (`--deadline S` gives them a new limit)\n")
    return _report_run(args, result)


def cmd_retry(args: argparse.Namespace) -> int:
    """``runtime retry``: re-run the failed and skipped nodes of a run, or of a whole batch."""
    from runtime.run.read import resolve_run_dir
    from runtime.run.start import RetryRequest, retry_run

    deadline_at = _deadline_at(args.deadline)
    redactor = _redactor(args)
    request = RetryRequest(agent=args.agent, no_fallback=args.no_fallback,
                           sets=tuple(args.sets))
    from runtime.report.findings import resolve_target

    kind, path = resolve_target(args.target, args.artifacts)
    if kind == "batch":
        return _retry_batch(args, path, request, redactor, deadline_at)
    run_dir = resolve_run_dir(str(path), args.artifacts)
    with _cancel_on_signals() as cancel:
        result = retry_run(run_dir, request, redactor=redactor, hooks=_hooks(cancel, args),
                           deadline_at=deadline_at)
    return _report_run(args, result)


def _retry_batch(args: argparse.Namespace, batch_dir: Path, request: Any, redactor: Any,
                 deadline_at: float | None) -> int:
    """Every run of the batch that did not succeed, one after another, under the batch's lock.

    The summary, findings.sarif and report are then written again from all runs.
    """
    from runtime.batch import rewrite_summary
    from runtime.run.lock import hold
    from runtime.run.start import retry_run
    from runtime.run.summary import BatchSummary

    retried = 0
    with hold(batch_dir, f"batch {batch_dir.name}"), _cancel_on_signals() as cancel:
        summary = BatchSummary.model_validate_json((batch_dir / "summary.json").read_bytes())
        for entry in summary.entries:
            if entry.status == "succeeded" or entry.run_id is None or cancel.is_set():
                continue
            run_dir = batch_dir.parent.parent / "runs" / entry.run_id
            if not (run_dir / "ledger.jsonl").is_file():
                continue  # invalid before it ran: nothing to retry
            result = retry_run(run_dir, request, redactor=redactor,
                               hooks=_hooks(cancel, args, prefix=f"{entry.topology}: "),
                               deadline_at=deadline_at)
            retried += 1
            sys.stderr.write(f"{result.run_id}: {result.status.value}\n")
        final = rewrite_summary(batch_dir)
    _emit(args, final.model_dump(mode="json"),
          f"batch {final.batch_id}: {final.status} ({retried} "
          f"run{'' if retried == 1 else 's'} retried)\n")
    return EXIT_OK if final.status == "succeeded" else EXIT_FAILED


def cmd_show(args: argparse.Namespace) -> int:
    """``runtime show``: print a run's state, folded from its ledger."""
    from runtime.run.read import load_run, resolve_run_dir

    run_dir = resolve_run_dir(args.run, args.artifacts)
    state = load_run(run_dir)[1]
    if args.json:
        sys.stdout.write(state.model_dump_json() + "\n")
    else:
        sys.stdout.write(_describe(state, run_dir, verbose=True))
    return EXIT_OK if state.status == "succeeded" else EXIT_FAILED


def cmd_findings(args: argparse.Namespace) -> int:
    """``runtime findings``: merge the accepted SARIF artifacts of runs or a batch."""
    from runtime.report.findings import collect, json_bytes, sarif_bytes, table_text

    found = collect(args.target, args.artifacts)
    fmt = args.format or ("json" if args.json else "table")
    if fmt == "sarif":
        data = sarif_bytes(found)
    elif fmt == "json":
        data = json_bytes(found)
    else:
        wide = sys.stdout.isatty() and args.output is None
        data = table_text(found, shutil.get_terminal_size().columns if wide else 160).encode()
    counts = found.counts()
    if args.output is not None:
        from runtime.files import replace_atomically

        _check_path("-o", args.output, want_dir=False)
        args.output.parent.mkdir(parents=True, exist_ok=True)
        replace_atomically(args.output, data)
        _emit(args, {"output": str(args.output), "format": fmt, "counts": counts,
                     "problems": found.problems},
              f"{len(found.findings)} findings ({_counts_text(counts)}) written to "
              f"{args.output}")
    else:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    if fmt != "table" or args.output is not None:  # the table on stdout already lists them
        for problem in found.problems:
            sys.stderr.write(f"problem: {problem}\n")
    return EXIT_FAILED if found.problems else EXIT_OK


def _counts_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {level}" for level, n in counts.items() if n) or "none"


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: cannot read as UTF-8 text: {exc}") from None


def _redactor(args: argparse.Namespace) -> Any:
    """Literals to redact come from files and RUNTIME_REDACT, never from argv.

    The runtime's command line is readable by every process on the machine, agents included
    (/proc/<pid>/cmdline).
    """
    if args.redact:
        raise UsageError("--redact VALUE would put the secret in the runtime's command line, "
                         "which every process on the machine can read; write the literals "
                         "to a file, one per line, and pass --redact-file FILE, or set "
                         "RUNTIME_REDACT (':'-separated)")
    declared: list[str] = []
    for path in args.redact_file:
        declared += [line for line in _read_text(path).splitlines() if line.strip()]
    return _env_redactor(declared)


def _env_redactor(declared: list[str]) -> Any:
    from runtime.prompt.redact import Redactor

    extra = [v for v in os.environ.get("RUNTIME_REDACT", "").split(os.pathsep) if v]
    return Redactor.from_environment(os.environ, [*declared, *extra])


@contextmanager
def _cancel_on_signals() -> Iterator[threading.Event]:
    """While a run is in progress, SIGINT (Ctrl-C) and SIGTERM set its cancel event.

    The scheduler stops launching, agents are terminated, attempts recorded ``cancelled``.
    Raising KeyboardInterrupt instead would land wherever the main thread happens to be, for
    example inside a ledger append. A second Ctrl-C stops at once. The previous handlers
    come back when the run is over.
    """
    cancel = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        if signum == signal.SIGINT and cancel.is_set():
            raise KeyboardInterrupt
        cancel.set()

    if threading.current_thread() is not threading.main_thread():
        yield cancel
        return
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield cancel
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=("local", "ray"), default="local",
                   help="where attempts' agents run: this process (default) or a Ray cluster "
                   "(pip install -e '.[ray]')")
    p.add_argument("--ray-address", metavar="ADDR",
                   help="the Ray cluster to join: auto, ray://HOST:10001 or HOST:6379; one "
                   "that does not answer within ~20 s is exit 2; default: a local Ray "
                   "started for this run")


def _hooks(cancel: Any, args: argparse.Namespace, engine: Any = None, *,
           prefix: str = "") -> Any:
    """Build the run's hooks: cancellation, the engine, and per-node progress lines on stderr.

    The engine is ``engine``, else the one --engine names. One stderr line per node event
    as it happens: CI logs show progress; --json keeps stderr quiet for machines.
    ``prefix``: put before each line (the topology, when a batch's runs share stderr).
    """
    from runtime.run.start import Hooks

    printer = None if getattr(args, "json", False) else \
        functools.partial(_print_event, prefix=prefix)
    return Hooks(cancel=cancel, after_append=printer, engine=engine or _engine(args))


def _engine(args: argparse.Namespace) -> Any:
    """The engine --engine names (None: the local one)."""
    address = getattr(args, "ray_address", None)
    if getattr(args, "engine", "local") == "local":
        if address is not None:
            raise UsageError("--ray-address needs --engine ray")
        return None
    from runtime.run.ray_engine import RayEngine

    return RayEngine(address)


def _print_event(ev: Any, prefix: str = "") -> None:
    from runtime.eventlines import event_line

    line = event_line(ev)
    if line:
        sys.stderr.write(prefix + line + "\n")
        sys.stderr.flush()


def _report_run(args: argparse.Namespace, result: Any) -> int:
    from runtime.report.findings import Findings
    from runtime.report.html import report_run

    try:
        report: Path | None
        report, findings = report_run(result.run_dir)
    except OSError as exc:  # a full disk: the run itself is whole in its ledger
        sys.stderr.write(f"warning: the report was not written ({exc.strerror or exc}: "
                         f"{exc.filename}); `runtime resume {result.run_dir}` writes it "
                         "again\n")
        report, findings = None, Findings()
    state = result.state
    nodes = {nid: {"status": ns.status.value, "attempts": len(ns.attempts),
                   "failure": ns.failure.value if ns.failure else None,
                   "reason": ns.reason, "failed_ancestor": ns.failed_ancestor,
                   "summary": ns.last_failure.summary if ns.last_failure else None}
             for nid, ns in state.nodes.items()}
    counts = findings.counts()
    obj = {"run_id": result.run_id, "run_dir": str(result.run_dir),
           "status": result.status.value, "nodes": nodes,
           "report": str(report) if report is not None else None,
           "findings": counts}
    found = (f"findings: {_counts_text(counts)} (runtime findings {result.run_id})\n"
             if any(counts.values()) else "")
    _emit(args, obj, _describe(state, result.run_dir, verbose=False) + found
          + (f"report: {report}\n" if report is not None else ""))
    if result.status.value == "cancelled":
        sys.stderr.write(f"interrupted; the run is resumable: runtime resume {result.run_id} "
                         f"--artifacts {shlex.quote(str(args.artifacts))}\n")
    return _exit_for(result.status)


def _exit_for(status: str) -> int:
    """A run's or batch's status as the exit code (DESIGN section 8)."""
    if status == "succeeded":
        return EXIT_OK
    return EXIT_INTERRUPTED if status == "cancelled" else EXIT_FAILED


def _describe(state: Any, run_dir: Path, *, verbose: bool) -> str:
    from runtime.eventlines import skip_reason

    lines = [f"run {state.run_id} ({state.topology}): {state.status.value}", f"  {run_dir}"]
    for nid, ns in state.nodes.items():
        outcomes = ", ".join(f"{a.attempt}:{a.outcome or 'unfinished'}"
                             + (f"[{a.profile}]" if verbose else "") for a in ns.attempts)
        why = skip_reason(ns.failed_ancestor, ns.reason or "")
        extra = f" ({why})" if why else ""
        lines.append(f"  {nid:<24} {ns.status.value:<9} attempts {len(ns.attempts)}"
                     f"{': ' + outcomes if outcomes else ''}{extra}")
        last = ns.last_failure
        # A node that went on to succeed has no error left to show.
        if (verbose or ns.status == "failed") and ns.status != "succeeded" \
                and last is not None and (last.summary or last.error):
            # The agent's own reason when its adapter recognised one ("Not logged in").
            first = (last.summary or last.error).strip().splitlines()
            lines.append(f"  {'':<24} last error: {first[0][:160] if first else ''}")
    return "\n".join(lines) + "\n"


def cmd_schema(args: argparse.Namespace) -> int:
    """``runtime schema``: print the topology file's JSON Schema (for editors and linters)."""
    schema = Topology.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    sys.stdout.write(json.dumps(schema, indent=2, sort_keys=True) + "\n")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the exit status instead of exiting."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed the usage error
        return EXIT_INVALID if exc.code else EXIT_OK
    args.argv = list(sys.argv[1:] if argv is None else argv)  # to print a resume command
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2),
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    handler: Handler = args.handler
    try:
        return handler(args)
    except DagRuntimeError as exc:
        if os.environ.get("RUNTIME_DEBUG"):
            raise
        return _error(args, str(exc), EXIT_INVALID if isinstance(exc, InputError)
                      else EXIT_FAILED)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader went away (`| head`): nothing left to tell it
        with contextlib.suppress(OSError):  # and no second error when Python flushes
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
    except OSError as exc:  # the environment: a path the runtime was told to use
        if os.environ.get("RUNTIME_DEBUG"):
            raise
        where = f"{exc.filename}: " if exc.filename else ""
        return _error(args, f"{where}{exc.strerror or exc}", EXIT_INVALID)


def _error(args: argparse.Namespace, message: str, code: int) -> int:
    """Report an error on stderr, and with ``--json`` as JSON on stdout too (for scripts)."""
    sys.stderr.write(f"error: {message}\n")
    if getattr(args, "json", False):
        with contextlib.suppress(OSError):  # stdout itself may be what failed (a full disk)
            sys.stdout.write(json.dumps({"error": message, "exit_code": code}) + "\n")
            sys.stdout.flush()
    return code


def entry() -> None:
    """Console-script entry point."""
    sys.exit(main())
