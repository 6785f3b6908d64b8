"""Per-kind recognisers: what an agent left behind -> a failure class and its own reason.

A command agent's exit status says little (claude exits 1 for "not logged in" and for a
crash alike; codex loops on "Reconnecting..." until the timeout). Each recogniser reads
the evidence its kind leaves and returns a ``Reading``: a failure class when the
evidence names one (DESIGN section 10: ``agent_auth``, ``agent_unreachable``,
``agent_rejected``, ``rate_limited``), and a one-line summary of the agent's own words.

Kinds, told apart by the program name (``argv[0]``'s base name):

- ``claude``: the result JSON of ``--output-format json`` whatever the exit code
  (``is_error``, ``result``, ``api_error_status``), else claude's own stderr.
- ``codex``: codex's own error lines on stderr (``ERROR: ...``, ``error: ...``, its log
  lines), never the transcript of tools it ran, which also goes to stderr.
- anything else: no class (its conventions are unknown), the last meaningful stderr line
  as the summary.

The same readings serve a profile's ``preflight`` command (``claude auth status``,
``codex login status``): ``read_preflight``. Agents echo their prompt (codex prints it
whole to stderr): lines of the attempt's own prompt are removed before anything is
read or bounded (``strip_echo``, ``error_tail``), so the error budget is spent on the
agent's words, not on trusted prompt text (issue 10 item 7).

Summaries are not redacted here: the runtime redacts and bounds every summary where it
records one (``attempt.summarize``, ``preflight``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import StrEnum
from pathlib import PurePath
from typing import Any

from runtime.agents.capture import DEFAULT_HEAD, DEFAULT_TAIL, BoundedCapture
from runtime.failures import FailureClass


class AgentKind(StrEnum):
    """Which conventions an agent's output follows, so that its own failure reasons are read."""
    CLAUDE = "claude"
    CODEX = "codex"
    COMMAND = "command"  # any other program: no known conventions


def kind_of(argv0: str) -> AgentKind:
    """The recogniser for a command profile, from its program's base name."""
    name = PurePath(argv0).name
    for kind in (AgentKind.CLAUDE, AgentKind.CODEX):
        if name == kind.value:
            return kind
    return AgentKind.COMMAND


@dataclass(frozen=True)
class Reading:
    """What a recogniser found: a failure class and a line in the agent's own words.

    A class (None: nothing it recognises) and one line in the agent's own words (None:
    nothing worth showing).
    """

    failure: FailureClass | None = None
    summary: str | None = None


# Evidence -> class. Checked in this order on text that is already known to be an error
# message (claude's error result, one of codex's own error lines, a CLI usage error):
# billing before rate limits (a 429 "insufficient_quota" is not fixed by waiting).
_PATTERNS: tuple[tuple[FailureClass, re.Pattern[str]], ...] = (
    (FailureClass.AGENT_AUTH, re.compile(
        r"not logged in|please run /login|invalid[ _-]?(x-)?api[ _-]?key|incorrect api key"
        r"|authentication[ _]error|unauthori[sz]ed|\b401\b|\b403\b|forbidden"
        r"|(oauth|access) token (has )?(expired|been revoked)|missing bearer", re.I)),
    (FailureClass.AGENT_REJECTED, re.compile(
        r"credit balance is too low|insufficient_quota|exceeded your current quota", re.I)),
    (FailureClass.RATE_LIMITED, re.compile(
        r"rate[ _-]?limit|too many requests|\b429\b|overloaded|\b529\b", re.I)),
    (FailureClass.AGENT_UNREACHABLE, re.compile(
        r"can't reach the api|connection refused|econnrefused|enotfound|eai_again"
        r"|getaddrinfo|failed to lookup address|name does not resolve"
        r"|name or service not known|temporary failure in name resolution"
        r"|network is unreachable|no route to host|waiting for network|unable to connect"
        r"|connection error|fetch failed|etimedout|econnreset", re.I)),
    (FailureClass.AGENT_REJECTED, re.compile(
        r"unknown option|unexpected argument|unrecognized (option|subcommand|argument)"
        r"|invalid model|model[ _]not[ _]found|not_found_error|invalid_request_error"
        r"|does not exist or you do not have access|bad request|\b400\b|\b404\b|\b422\b",
        re.I)),
)


def classify_text(text: str) -> FailureClass | None:
    """The availability class an error message names, if any."""
    for failure, pattern in _PATTERNS:
        if pattern.search(text):
            return failure
    return None


def classify_status(status: int) -> FailureClass | None:
    """An HTTP status a provider answered with, as a class (5xx: None, retried as usual)."""
    if status in (401, 403):
        return FailureClass.AGENT_AUTH
    if status in (429, 529):  # 529: Anthropic's "overloaded"
        return FailureClass.RATE_LIMITED
    if 400 <= status < 500:
        return FailureClass.AGENT_REJECTED
    return None


# ---------------------------------------------------------------------------- text


def strip_echo(text: str, prompt: str) -> str:
    """``text`` without the lines that are lines of ``prompt`` (compared stripped).

    An agent that echoes its prompt (codex prints it whole to stderr) would otherwise fill
    the error budget with trusted prompt text inside the untrusted block.
    """
    if not prompt:
        return text
    echoed = {ln.strip() for ln in prompt.splitlines()}
    echoed.discard("")
    return "\n".join(ln for ln in text.splitlines() if ln.strip() not in echoed)


def error_tail(capture: BoundedCapture, prompt: str, limit: int) -> str:
    """Give a capture's last ``limit`` bytes, measured after the prompt's echoed lines are removed.

    Cut as ``BoundedCapture.tail_text`` cuts (at a line boundary).
    """
    text = strip_echo(capture.tail_text(DEFAULT_HEAD + DEFAULT_TAIL), prompt)
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    data = data[-limit:]
    newline = data.find(b"\n")  # start at a line boundary, as tail_text does
    return data[newline + 1:].decode("utf-8", "replace") if newline >= 0 else ""


def _meaningful(line: str) -> bool:
    """Whether a line is worth showing to a user.

    At least three letters or digits (not a rule, a box drawing or a lone brace).
    """
    return sum(ch.isalnum() for ch in line) >= 3


def _one_line(text: str) -> str:
    return " ".join(text.split())


def last_meaningful(text: str) -> str | None:
    """The last meaningful line; a ``WARNING`` line only when there is nothing else."""
    lines = [ln.strip() for ln in text.splitlines() if _meaningful(ln)]
    plain = [ln for ln in lines if not ln.upper().startswith("WARNING")]
    pick = plain or lines
    return _one_line(pick[-1]) if pick else None


# ---------------------------------------------------------------------------- claude


def _json_object(stdout: bytes) -> dict[str, Any] | None:
    """Stdout as one JSON object, or its last line as one (a CLI may print more)."""
    text = stdout.decode("utf-8", "replace").strip()
    for candidate in (text, text.rsplit("\n", 1)[-1]):
        try:
            value = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        return value if isinstance(value, dict) else None
    return None


def _read_claude(exit_code: int | None, stdout: bytes, stderr: str) -> Reading:
    result = _json_object(stdout)
    if result is not None and result.get("type", "result") == "result":
        if result.get("is_error") is not True and not result.get("error"):
            return Reading() if exit_code == 0 else _read_stderr(stderr, classify=True)
        text = _one_line(str(result.get("result") or result.get("error")
                             or result.get("subtype") or "is_error"))
        status = result.get("api_error_status")
        failure = classify_status(status) if isinstance(status, int) else None
        return Reading(failure or classify_text(text), text or None)
    if exit_code == 0:
        return Reading()
    return _read_stderr(stderr, classify=True)  # e.g. "error: unknown option '--x'"


def _read_stderr(stderr: str, *, classify: bool) -> Reading:
    line = last_meaningful(stderr)
    if line is None:
        return Reading()
    return Reading(classify_text(line) if classify else None, line)


# ---------------------------------------------------------------------------- codex

# codex's own messages: "ERROR: Reconnecting...", clap's "error: unexpected argument",
# "warning: Falling back ...", and its log lines "2026-...Z ERROR codex_api::...: msg".
# Tool output it relays is indented or plain text and never matches.
_CODEX_OWN = re.compile(
    r"^(?:(?:ERROR|error|warning|WARN)\b:?\s*"
    r"|\d{4}-\d\d-\d\dT[\d:.]+Z\s+(?:ERROR|WARN)\s+\S+:\s*)(?P<msg>.*)$")


def _read_codex(exit_code: int | None, stderr: str) -> Reading:
    """Read a codex failure from its own error lines, newest first.

    The timeout it loops into is read the same way; the first line naming a class wins.
    """
    if exit_code == 0:
        return Reading()
    own = [m.group(0).strip() for ln in stderr.splitlines()
           if (m := _CODEX_OWN.match(ln.strip())) and _meaningful(m.group("msg"))]
    own = [ln for ln in own if not ln.startswith("WARNING: proceeding")]  # PATH aliases
    # Newest first, but "Reconnecting..." last: the line that says why it reconnects
    # ("failed to lookup address information") is the one a user can act on.
    order = sorted(reversed(own), key=lambda ln: "Reconnecting" in ln)
    for line in order:
        failure = classify_text(line)
        if failure is not None:
            return Reading(failure, _codex_line(line))
    if own:
        return Reading(None, _codex_line(own[-1]))
    return _read_stderr(stderr, classify=False)


def _codex_line(line: str) -> str:
    """Drop a log line's time stamp and module path: the message is what a user reads."""
    match = _CODEX_OWN.match(line)
    if match and line[:1].isdigit():
        return _one_line(match.group("msg"))
    return _one_line(line)


# ---------------------------------------------------------------------------- entry points


def read_command(kind: AgentKind, exit_code: int | None, stdout: bytes, stderr: str, *,
                 prompt: str = "") -> Reading:
    """Read what a command agent left: its exit code, output head and error tail.

    ``exit_code`` None means it was stopped (timed out); ``stdout`` is the head of its
    output (claude's result JSON), ``stderr`` the tail of its error output. The prompt's
    echoed lines are removed first.
    """
    stderr = strip_echo(stderr, prompt)
    if kind is AgentKind.CLAUDE:
        return _read_claude(exit_code, stdout, stderr)
    if kind is AgentKind.CODEX:
        return _read_codex(exit_code, stderr)
    if exit_code == 0:
        return Reading()
    return _read_stderr(stderr, classify=False)


def read_preflight(kind: AgentKind, exit_code: int | None, stdout: bytes,
                   stderr: str) -> Reading:
    """Read a profile's ``preflight`` command.

    A failure with no recognised class is ``agent_exit``; success may carry a summary (how
    the agent is logged in).
    """
    if kind is AgentKind.CLAUDE:
        status = _json_object(stdout)
        if status is not None and "loggedIn" in status:  # claude auth status
            if status["loggedIn"] is True:
                how = status.get("apiKeySource") or status.get("authMethod")
                return Reading(None, f"logged in ({how})" if how else "logged in")
            return Reading(FailureClass.AGENT_AUTH, "Not logged in")
    text = stdout.decode("utf-8", "replace") + "\n" + stderr
    if exit_code == 0:
        return Reading(None, last_meaningful(text))
    line = last_meaningful(text) or (f"exit status {exit_code}" if exit_code is not None
                                     else "timed out")
    return Reading(classify_text(line) or classify_text(text) or FailureClass.AGENT_EXIT, line)
