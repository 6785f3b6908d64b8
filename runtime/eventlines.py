"""One human line per ledger event worth a line, safe for a terminal.

``runtime run`` prints these as its progress, and batch progress in logs prefixes them
with the topology. Kept apart from the live display so a run does not import rich.
"""

from __future__ import annotations

import time
from typing import Any


def event_line(ev: Any) -> str:
    """One human line for a ledger event that a person watching a run cares about."""
    stamp = time.strftime("%H:%M:%S", time.localtime(ev.ts)) if ev.ts else "--:--:--"
    match ev.event:
        case "attempt.started":
            wait = f" after waiting {ev.waited_s:g} s" if ev.waited_s else ""
            text = f"{ev.node}: attempt {ev.attempt} started on {ev.profile}{wait}"
        case "attempt.finished" if ev.outcome != "succeeded":
            why = f": {ev.summary}" if ev.summary else ""
            text = f"{ev.node}: attempt {ev.attempt} {ev.outcome}{why}"
        case "node.succeeded":
            text = f"{ev.node}: succeeded ({ev.attempts} attempt{'s' * (ev.attempts != 1)})"
        case "node.failed":
            text = f"{ev.node}: failed, {ev.failure}: {ev.reason}"
        case "node.skipped":
            text = f"{ev.node}: skipped ({skip_reason(ev.failed_ancestor, ev.reason)})"
        case _:
            return ""
    return f"[{stamp}] {_terminal_safe(text)}"


def skip_reason(failed_ancestor: str | None, reason: str) -> str:
    """Why a node was skipped, in words: its ancestor that failed or did not finish."""
    if not failed_ancestor:
        return reason
    return f"upstream {failed_ancestor} " + (f"not finished: {reason}" if reason
                                             else "failed")


def _terminal_safe(text: str) -> str:
    # Summaries are agent-authored: no escape sequence reaches the user's terminal.
    if text.isprintable():  # nearly every line: no per-character pass
        return text[:300]
    text = " ".join(text.split("\n"))  # a multi-line summary reads as one line
    return "".join(ch if ch.isprintable() else "?" for ch in text)[:300]


