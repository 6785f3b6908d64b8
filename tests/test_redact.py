from __future__ import annotations

import json
import re
import unicodedata

import pytest

from runtime.assemble import PRIOR_FAILURE_CLOSE, PRIOR_FAILURE_OPEN
from runtime.failures import FailureClass
from runtime.feedback import fingerprint, render_preamble
from runtime.records import PriorFailure
from runtime.redact import Redactor, bound, looks_secret, sanitize
from tests.redaction_corpus import ESCAPES, Case, build

CORPUS = build()


@pytest.mark.parametrize("case", CORPUS, ids=[c.name for c in CORPUS])
def test_corpus_secrets_are_removed_and_the_rest_survives(case: Case) -> None:
    redacted = Redactor.from_environment(case.env, case.declared).redact(case.text)
    for secret in case.secrets:
        assert secret not in redacted, f"{case.name}: leaked {secret[:12]}..."
    for kept in case.keep:
        assert kept in redacted, f"{case.name}: destroyed {kept!r}"
    if case.secrets:
        assert "[REDACTED:" in redacted


def test_non_secret_environment_values_are_not_redacted() -> None:
    r = Redactor.from_environment({"HOME": "/home/runner", "GITHUB_TOKEN": "abcdef123456",
                                   "NODE_AUTH_TOKEN": "${NPM_TOKEN}"})
    assert r.literals == ("abcdef123456",)
    assert r.redact("cd /home/runner && use abcdef123456") == \
        "cd /home/runner && use [REDACTED:literal]"


@pytest.mark.parametrize(("value", "secret"), [
    ("Tr0ub4dor&3", True), ("kL9mN2pQ7x", True), ("changeme", False), ("${TOKEN}", False),
    ("required", False), ("<api-key>", False), ("123456", False), ("/etc/ssl/key.pem", False),
    ("abc", False), ("xxxxxxxx", False),
])
def test_assignment_filter(value: str, secret: bool) -> None:
    assert looks_secret(value) is secret


def test_sanitize_strips_ansi_and_controls_keeps_newlines_and_tabs() -> None:
    text = "\x1b[31mred\x1b[0m\tok\r\nnext\x00\x07\u202eevil\u200b\x1b]0;title\x07end"
    assert sanitize(text) == "red\tok\nnextevilend"


def test_bound_keeps_head_and_tail_and_counts() -> None:
    text = "H" * 100 + "M" * 1000 + "T" * 100
    out = bound(text, 300)
    assert len(out) <= 300
    assert out.startswith("H" * 100) and out.endswith("T" * 100)
    dropped = int(re.search(r"\[\.\.\. (\d+) characters dropped", out).group(1))  # type: ignore[union-attr]
    assert dropped == len(text) - len(out.replace(f"\n[... {dropped} characters dropped ...]\n",
                                                  ""))


def test_redaction_runs_before_the_cut() -> None:
    secret = "ghp_" + "Zq9" * 12
    text = "x" * 2000 + f"token {secret} " + "y" * 2000
    for limit in range(100, 4200, 97):
        out = Redactor().clean(text, limit)
        assert secret[:10] not in out and secret[-10:] not in out


@pytest.mark.parametrize("payload", ESCAPES, ids=range(len(ESCAPES)))
def test_boundary_escape_payloads_stay_inside_the_block(payload: str) -> None:
    error = Redactor().clean(payload, 4096)
    failure = PriorFailure(attempt=1, failure_class=FailureClass.AGENT_EXIT, exit_code=1,
                           unsatisfied=[Redactor().clean(payload, 512)], error=error,
                           fingerprint=fingerprint(FailureClass.AGENT_EXIT, error))
    text = render_preamble(2, 3, [failure], 8192)
    head, block = text.split(PRIOR_FAILURE_OPEN + "\n", 1)
    assert PRIOR_FAILURE_OPEN not in head and "prior-failure" not in head.lower()
    body, tail = block.rsplit("\n" + PRIOR_FAILURE_CLOSE, 1)
    assert tail == ""
    assert body.isascii() and all(32 <= ord(c) < 127 for c in body)
    assert "<" not in body and ">" not in body
    assert unicodedata.normalize("NFKC", body) == body
    assert json.loads(body)["failures"][0]["failure_class"] == "agent_exit"
    assert len(text.encode()) <= 8192
