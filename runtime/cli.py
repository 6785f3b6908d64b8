"""Command line: ``runtime VERB ...`` (DESIGN section 8). Thin: parse, call, print, exit.

Exit status: 0 when everything asked for succeeded, 1 when a run or check failed,
2 for invalid input. Errors print one message naming the file, field or node; never a
traceback (set RUNTIME_DEBUG=1 to get one).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .errors import DagRuntimeError, InputError, UsageError
from .graph import to_dot, to_mermaid
from .plan import plan_topology, read_manifest, write_plan
from .topology import Topology
from .verify import diff_golden, golden_bytes, golden_of, read_golden, verify_plan_dir

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2

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
    parser = argparse.ArgumentParser(prog="runtime", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="count", default=0)
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = sub.add_parser("plan", help="compile topologies into sealed plans")
    p.add_argument("topologies", nargs="+", type=Path, metavar="TOPOLOGY")
    p.add_argument("--golden-out", type=Path, metavar="FILE",
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

    p = sub.add_parser("schema", help="print the topology JSON Schema")
    _common(p, plans=False)
    p.set_defaults(handler=cmd_schema)
    return parser


def parse_vars(pairs: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--var {pair!r}: expected KEY=VALUE")
        out[key] = value
    return out


def _emit(args: argparse.Namespace, obj: dict[str, Any], text: str) -> None:
    if args.json:
        sys.stdout.write(json.dumps(obj, sort_keys=True) + "\n")
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")


def cmd_plan(args: argparse.Namespace) -> int:
    overrides = parse_vars(args.var)
    if args.golden_out and len(args.topologies) != 1:
        raise UsageError("--golden-out takes exactly one TOPOLOGY")
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
    target: Path = args.target
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
        if problems:
            problems.append(f"if the change is intended, update the golden file: runtime plan "
                            f"{target} --golden-out {args.golden}")
    else:
        raise UsageError(f"{target}: no such plan directory or topology file")
    text = "\n".join(problems) if problems else f"OK {target}: plan {digest}"
    _emit(args, {"ok": not problems, "target": str(target), "plan_digest": digest,
                 "differences": problems}, text)
    return EXIT_FAILED if problems else EXIT_OK


def _plan_digest(plan_dir: Path) -> str:
    from .digest import blake3_hex

    return blake3_hex(read_manifest(plan_dir)[1])


def cmd_graph(args: argparse.Namespace) -> int:
    if args.target.is_dir():
        manifest = read_manifest(args.target)[0]
    else:
        manifest = plan_topology(args.target, args.prompts, parse_vars(args.var)).manifest
    text = to_dot(manifest) if args.format == "dot" else to_mermaid(manifest)
    _emit(args, {"format": args.format, "graph": text}, text)
    return EXIT_OK


def cmd_schema(args: argparse.Namespace) -> int:
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
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2),
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    handler: Handler = args.handler
    try:
        return handler(args)
    except DagRuntimeError as exc:
        if os.environ.get("RUNTIME_DEBUG"):
            raise
        sys.stderr.write(f"error: {exc}\n")
        return EXIT_INVALID if isinstance(exc, InputError) else EXIT_FAILED
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130


def entry() -> None:
    """Console-script entry point."""
    sys.exit(main())
