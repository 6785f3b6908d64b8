"""Recognisers against what the real CLIs printed (tests/fixtures/agents, recorded by
record.py from the versions .ci/agent-clis pins), then the text rules on their own."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from runtime.agents.capture import BoundedCapture
from runtime.agents.recognise import (
    AgentKind,
    classify_status,
    classify_text,
    error_tail,
    kind_of,
    last_meaningful,
    read_command,
    read_preflight,
    strip_echo,
)
from runtime.failures import FailureClass as F

FIXTURES = Path(__file__).parent / "fixtures" / "agents"
PROMPT = (FIXTURES / "prompt.md").read_text()


def recorded(case: str) -> tuple[int | None, bytes, str]:
    meta = json.loads((FIXTURES / case / "meta.json").read_text())
    return (meta["exit_code"], (FIXTURES / case / "stdout").read_bytes(),
            (FIXTURES / case / "stderr").read_text())


# Attempts: (case, class, summary) as the runtime would record them.
ATTEMPTS = [
    ("claude-not-logged-in", F.AGENT_AUTH, "Not logged in · Please run /login"),
    ("claude-unknown-option", F.AGENT_REJECTED, "error: unknown option '--no-such-option'"),
    ("claude-api-key-offline", F.AGENT_UNREACHABLE,
     "API Error: Can't reach the API server — check your internet or DNS (ENOTFOUND)"),
    ("codex-unknown-option", F.AGENT_REJECTED,
     "error: unexpected argument '--no-such-option' found"),
    ("codex-exec-not-logged-in", F.AGENT_UNREACHABLE,
     "warning: Falling back from WebSockets to HTTPS transport. stream disconnected before "
     "completion: failed to lookup address information: Name does not resolve"),
]


@pytest.mark.parametrize(("case", "failure", "summary"), ATTEMPTS)
def test_attempt_outputs_of_the_real_clis(case: str, failure: F, summary: str) -> None:
    code, out, err = recorded(case)
    kind = kind_of(json.loads((FIXTURES / case / "meta.json").read_text())["argv"][0])
    reading = read_command(kind, code, out, err, prompt=PROMPT)
    assert (reading.failure, reading.summary) == (failure, summary)


def test_claude_json_is_read_whatever_the_exit_code() -> None:
    """The incident: exit 1 with the reason only in the result JSON on stdout."""
    code, out, err = recorded("claude-not-logged-in")
    assert code == 1
    assert err == ""
    assert read_command(AgentKind.CLAUDE, 0, out, err).failure is F.AGENT_AUTH


def test_codex_echoed_prompt_is_not_read_as_codex_s_own_error() -> None:
    """The recorded prompt holds "ERROR: 401 Unauthorized"; codex echoed it to stderr.
    Read without the prompt, the echo would be taken for an auth failure."""
    _code, out, err = recorded("codex-exec-not-logged-in")
    assert "ERROR: 401 Unauthorized (this line is part of the prompt)" in err
    echo_only = "\n".join(ln for ln in err.splitlines()
                          if ln.strip() in PROMPT or not ln.strip())
    assert read_command(AgentKind.CODEX, None, out, echo_only).failure is F.AGENT_AUTH
    assert read_command(AgentKind.CODEX, None, out, echo_only, prompt=PROMPT).failure is None


# Pre-flight commands: (case, class, summary).
PREFLIGHTS = [
    ("claude-auth-status", F.AGENT_AUTH, "Not logged in"),
    ("claude-auth-status-api-key", None, "logged in (ANTHROPIC_API_KEY)"),
    ("codex-login-status", F.AGENT_AUTH, "Not logged in"),
]


@pytest.mark.parametrize(("case", "failure", "summary"), PREFLIGHTS)
def test_preflight_outputs_of_the_real_clis(case: str, failure: F | None, summary: str) -> None:
    code, out, err = recorded(case)
    kind = kind_of(json.loads((FIXTURES / case / "meta.json").read_text())["argv"][0])
    reading = read_preflight(kind, code, out, err)
    assert (reading.failure, reading.summary) == (failure, summary)


@pytest.mark.parametrize(("code", "out", "err", "failure", "summary"), [
    (0, b"", "", None, None),
    (3, b"", "Traceback ...\nValueError: bad input\n", F.AGENT_EXIT, "ValueError: bad input"),
    (1, b"", "connection refused\n", F.AGENT_UNREACHABLE, "connection refused"),
    (None, b"", "", F.AGENT_EXIT, "timed out"),
    (4, b"", "", F.AGENT_EXIT, "exit status 4"),
])
def test_preflight_of_other_programs(code: int | None, out: bytes, err: str,
                                     failure: F | None, summary: str | None) -> None:
    reading = read_preflight(AgentKind.COMMAND, code, out, err)
    assert (reading.failure, reading.summary) == (failure, summary)


@pytest.mark.parametrize(("argv0", "kind"), [
    ("claude", AgentKind.CLAUDE), ("/usr/local/bin/codex", AgentKind.CODEX),
    ("claude-wrapper", AgentKind.COMMAND), (sys.executable, AgentKind.COMMAND),
])
def test_kind_is_the_program_name(argv0: str, kind: AgentKind) -> None:
    assert kind_of(argv0) is kind


@pytest.mark.parametrize(("text", "failure"), [
    ("Invalid API key · Please run /login", F.AGENT_AUTH),
    ("API Error: 401 {\"type\":\"authentication_error\"}", F.AGENT_AUTH),
    ("OAuth token has expired", F.AGENT_AUTH),
    ("API Error: 429 rate_limit_error", F.RATE_LIMITED),
    ("API Error: Repeated 529 Overloaded errors", F.RATE_LIMITED),
    ("You exceeded your current quota (insufficient_quota)", F.AGENT_REJECTED),
    ("Credit balance is too low", F.AGENT_REJECTED),
    ("connect ECONNREFUSED 127.0.0.1:443", F.AGENT_UNREACHABLE),
    ("API Error: 400 model: no-such-model not_found_error", F.AGENT_REJECTED),
    ("the handler panicked", None),
])
def test_error_messages_name_a_class(text: str, failure: F | None) -> None:
    assert classify_text(text) is failure


@pytest.mark.parametrize(("status", "failure"), [
    (401, F.AGENT_AUTH), (403, F.AGENT_AUTH), (429, F.RATE_LIMITED), (529, F.RATE_LIMITED),
    (400, F.AGENT_REJECTED), (404, F.AGENT_REJECTED), (500, None), (503, None),
])
def test_http_status_names_a_class(status: int, failure: F | None) -> None:
    assert classify_status(status) is failure


def test_claude_result_without_error_on_exit_0_is_nothing() -> None:
    out = json.dumps({"type": "result", "is_error": False, "result": "done"}).encode()
    assert read_command(AgentKind.CLAUDE, 0, out, "").failure is None
    assert read_command(AgentKind.CLAUDE, 0, out, "").summary is None


def test_claude_api_error_status_wins_over_the_text() -> None:
    out = json.dumps({"type": "result", "is_error": True, "api_error_status": 429,
                      "result": "API Error: something"}).encode()
    assert read_command(AgentKind.CLAUDE, 1, out, "").failure is F.RATE_LIMITED


def test_claude_error_nobody_recognises_keeps_its_words() -> None:
    """No class (the runtime's agent_exit/contradictory_completion apply), but the
    summary is still the agent's own reason, not "exit status 1"."""
    out = json.dumps({"type": "result", "is_error": True,
                      "result": "Tool crashed\nwhile writing"}).encode()
    reading = read_command(AgentKind.CLAUDE, 1, out, "")
    assert (reading.failure, reading.summary) == (None, "Tool crashed while writing")


def test_other_programs_get_their_last_meaningful_stderr_line_and_no_class() -> None:
    err = "starting\nerror: 401 from upstream\n----\n}\n\n"
    reading = read_command(AgentKind.COMMAND, 1, b"", err)
    assert (reading.failure, reading.summary) == (None, "error: 401 from upstream")
    assert read_command(AgentKind.COMMAND, 0, b"", err).summary is None


def test_codex_on_exit_0_is_never_a_failure() -> None:
    """Tool output codex relays may say anything; a run that ended well is not read."""
    assert read_command(AgentKind.CODEX, 0, b"", "ERROR: 401 Unauthorized\n").failure is None


def test_last_meaningful_prefers_a_non_warning_line() -> None:
    assert last_meaningful("WARNING: x y z\nNot logged in\n") == "Not logged in"
    assert last_meaningful("WARNING: only this\n") == "WARNING: only this"
    assert last_meaningful("--\n\n") is None


def test_strip_echo_removes_prompt_lines_only() -> None:
    prompt = "Task line one\n  indented line\n\n"
    text = "header\nTask line one\nindented line\n\nreal error\n"
    assert strip_echo(text, prompt) == "header\n\nreal error"
    assert strip_echo(text, "") == text


def test_error_tail_bounds_after_removing_the_echo(tmp_path: Path) -> None:
    prompt = "".join(f"prompt line {i} with some words\n" for i in range(500))
    cap = BoundedCapture(tmp_path / "err.log")
    cap.write("codex banner\n" + prompt + "ERROR: the real reason\n")
    try:
        assert error_tail(cap, prompt, 4096) == "codex banner\nERROR: the real reason"
        assert error_tail(cap, prompt, 30) == "ERROR: the real reason"
        assert "prompt line" in cap.tail_text(4096)  # what the runtime kept before
    finally:
        cap.close()
