"""Redaction quality and cost.

1. Recall and false positives of our redactor on tests/redaction_corpus.py, and of
   detect-secrets (if installed: pip install -e '.[bench]') on the same corpus, where
   detect-secrets "redacts" by removing every value it reports.
   recall = planted secrets fully removed / planted secrets;
   false positives = strings that must survive (hashes, UUIDs, paths, placeholders)
   that were altered / such strings.
2. Cost on a 100 MB stderr: a command agent writes 100 MB to stderr; we time the
   runtime's path (the agent supervisor, the bounded capture, the failure-text pipeline
   on its tail) against a bare loop draining the same pipe, in the same run. Also the
   throughput of the full pipeline over the whole 100 MB as text, against one regex
   scan of it (a lower bound for any scanner).

    python benchmarks/redaction.py [--mb 100]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.agents import Invocation, make_agent
from runtime.capture import BoundedCapture
from runtime.profiles import CommandProfile
from runtime.redact import Redactor
from tests.redaction_corpus import build


def score(redact: object) -> tuple[int, int, int, int]:
    found = total = kept_bad = kept = 0
    for case in build():
        out = redact(case)  # type: ignore[operator]
        total += len(case.secrets)
        found += sum(1 for s in case.secrets if s not in out)
        kept += len(case.keep)
        kept_bad += sum(1 for k in case.keep if k not in out)
    return found, total, kept_bad, kept


def ours(case: object) -> str:
    return Redactor.from_environment(case.env, case.declared).redact(case.text)  # type: ignore[attr-defined]


def detect_secrets_redact(case: object) -> str:
    from detect_secrets import SecretsCollection
    from detect_secrets.settings import default_settings

    text: str = case.text  # type: ignore[attr-defined]
    with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as fh:
        fh.write(text)
    collection = SecretsCollection()
    with default_settings():
        collection.scan_file(fh.name)
    Path(fh.name).unlink()
    values = {s.secret_value for _, s in collection if s.secret_value}
    for value in sorted(values, key=len, reverse=True):
        text = text.replace(value, "[REDACTED]")
    return text


def cost(mb: int) -> None:
    gen = ["sh", "-c", f"head -c {mb * 1024 * 1024} /dev/urandom | base64"]

    def drain(sink_factory: object) -> float:
        start = time.perf_counter()
        proc = subprocess.Popen(gen, stdout=subprocess.PIPE)
        assert proc.stdout is not None
        sink_factory(proc.stdout)  # type: ignore[operator]
        proc.wait()
        return time.perf_counter() - start

    def to_null(stream: object) -> None:
        while stream.read1(65536):  # type: ignore[attr-defined]
            pass

    def through_agent(tmp: Path) -> float:
        """The runtime's path: the command agent supervises the child, its stderr goes
        into a bounded capture, and the failure text is cleaned from the tail."""
        out, err = BoundedCapture(tmp / "stdout.log"), BoundedCapture(tmp / "stderr.log")
        inv = Invocation(run_id="r", node="n", attempt=1, max_attempts=1, prompt="",
                         prompt_file=tmp / "p.md", workspace=tmp, timeout_s=600, env={},
                         artifacts=(), stdout=out, stderr=err)
        agent = make_agent(CommandProfile(kind="command", prompt_via="file",
                                          argv=[*gen[:2], gen[2] + " >&2"]))
        start = time.perf_counter()
        agent.run(inv)
        out.close()
        err.close()
        Redactor.from_environment({}).clean(err.tail_text(4096), 4096)
        return time.perf_counter() - start

    with tempfile.TemporaryDirectory() as tmp:
        base = min(drain(to_null) for _ in range(3))
        ours_t = min(through_agent(Path(tmp)) for _ in range(3))
    print(f"{mb} MB stderr: agent supervisor + capture + pipeline {ours_t:.2f} s vs drain "
          f"to /dev/null {base:.2f} s: ratio {ours_t / base:.2f}x")
    text = subprocess.run(gen, capture_output=True, check=True).stdout.decode()
    start = time.perf_counter()
    Redactor().redact(text)
    full = time.perf_counter() - start
    import re

    start = time.perf_counter()
    re.compile(r"\bAKIA[A-Z0-9]{16}\b").findall(text)
    one = time.perf_counter() - start
    print(f"full pipeline over all {mb} MB as text: {full:.2f} s ({mb / full:.0f} MB/s); "
          f"one regex scan {one:.2f} s; ratio {full / one:.1f}x (for reference: the runtime "
          "only ever cleans the bounded tail)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=100)
    args = parser.parse_args()
    for name, fn in (("ours", ours), ("detect-secrets", detect_secrets_redact)):
        try:
            found, total, bad, kept = score(fn)
        except ImportError:
            print(f"{name}: not installed (pip install -e '.[bench]')")
            continue
        print(f"{name:>15}: recall {found}/{total} = {found / total:.0%}; "
              f"false positives {bad}/{kept} = {bad / kept:.0%}")
    cost(args.mb)


if __name__ == "__main__":
    main()
