from __future__ import annotations

import json
import random
import re
import unicodedata
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.agents.capture import BoundedCapture
from runtime.failures import FailureClass
from runtime.prompt.assemble import PRIOR_FAILURE_CLOSE, PRIOR_FAILURE_OPEN
from runtime.prompt.feedback import PriorFailure, fingerprint, render_preamble
from runtime.prompt.redact import Redactor, bound, looks_secret, sanitize
from tests import benign_corpus, secret_families
from tests.redaction_corpus import ESCAPES, Case, build
from tests.secret_families import NOT_SECRETS

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
    assert out.startswith("H" * 100)
    assert out.endswith("T" * 100)
    dropped = int(re.search(r"\[\.\.\. (\d+) characters dropped", out).group(1))  # type: ignore[union-attr]
    assert dropped == len(text) - len(out.replace(f"\n[... {dropped} characters dropped ...]\n",
                                                  ""))


def test_redaction_runs_before_the_cut() -> None:
    secret = "ghp_" + "Zq9" * 12
    text = "x" * 2000 + f"token {secret} " + "y" * 2000
    for limit in range(100, 4200, 97):
        out = Redactor().clean(text, limit)
        assert secret[:10] not in out
        assert secret[-10:] not in out


@pytest.mark.parametrize("payload", ESCAPES, ids=range(len(ESCAPES)))
def test_boundary_escape_payloads_stay_inside_the_block(payload: str) -> None:
    error = Redactor().clean(payload, 4096)
    failure = PriorFailure(attempt=1, failure_class=FailureClass.AGENT_EXIT, exit_code=1,
                           unsatisfied=[Redactor().clean(payload, 512)], error=error,
                           fingerprint=fingerprint(FailureClass.AGENT_EXIT, error))
    text = render_preamble(2, 3, [failure], 8192)
    head, block = text.split(PRIOR_FAILURE_OPEN + "\n", 1)
    assert PRIOR_FAILURE_OPEN not in head
    assert "prior-failure" not in head.lower()
    body, tail = block.rsplit("\n" + PRIOR_FAILURE_CLOSE, 1)
    assert tail == ""
    assert body.isascii()
    assert all(32 <= ord(c) < 127 for c in body)
    assert "<" not in body
    assert ">" not in body
    assert unicodedata.normalize("NFKC", body) == body
    assert json.loads(body)["failures"][0]["failure_class"] == "agent_exit"
    assert len(text.encode()) <= 8192


# -- issue 11: catalogue coverage, context rules, tail cuts, benign look-alikes --------

FAMILIES = secret_families.build()


@pytest.mark.parametrize("sample", [s for s in FAMILIES if s.family not in NOT_SECRETS],
                         ids=lambda s: s.family)
def test_every_catalogue_family_is_redacted(sample: secret_families.Sample) -> None:
    out = Redactor().redact(sample.line)
    leaked = [x for x in (*sample.secrets, *sample.fragments) if x in out]
    assert not leaked, f"{sample.family}: {out[:200]}"


def test_catalogue_families_not_redacted_are_identifiers_and_named_in_readme() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert set(NOT_SECRETS) <= {s.family for s in FAMILIES}
    assert "Not redacted, by design" in readme
    assert "NOT_SECRETS" in readme
    assert f"{len(NOT_SECRETS)} catalogue families" in readme


@pytest.mark.parametrize(("name", "text"), benign_corpus.build(), ids=lambda v: str(v)[:30])
def test_benign_look_alikes_survive_byte_for_byte(name: str, text: str) -> None:
    env = {"PWD": "/work/runs/r1", "OLDPWD": "/home/runner", "HOME": "/home/runner"}
    assert Redactor.from_environment(env).redact(text) == text


def test_working_directory_is_not_a_secret_because_of_its_variable_name() -> None:
    """Issue 10 item 7: PWD matched "pwd", so every path under the working directory
    came out as ``[REDACTED:literal]/artifacts/...``."""
    env = {"PWD": "/work/runs/r1", "OLDPWD": "/home/runner", "DB_PWD": "s3cr3t-pw",
           "TOKEN_DIR": "/run/secrets"}
    r = Redactor.from_environment(env)
    assert r.literals == ("s3cr3t-pw",)
    text = "workdir: /work/runs/r1/artifacts/x.json (was /home/runner); pw s3cr3t-pw"
    assert r.redact(text) == ("workdir: /work/runs/r1/artifacts/x.json (was /home/runner); "
                              "pw [REDACTED:literal]")


@pytest.mark.parametrize(("text", "secret"), [
    ("postgresql://app:pa/ss@w0rd@db:5432/x", "pa/ss@w0rd"),
    ("redis://:hunter2@cache:6379/0", "hunter2"),
    ("amqp://guest:gu%40st%2Fpw@mq/", "gu%40st%2Fpw"),
    ("DB_PASS=Zx8!qq\n", "Zx8!qq"),
    ("password: letmein\n", "letmein"),
    ("PGPASSWORD=postgres psql -h db", "postgres"),
    ("mysql --password hunter2 -h db", "hunter2"),
    ("mysql --password=hunter2 -h db", "hunter2"),
    ("machine api.acme.io login deploy password hunter2", "hunter2"),
    ("db.internal:5432:billing:billing:pgpw123", "pgpw123"),
    ('{"auths": {"r.io": {"auth": "ZGVwbG95OnB3"}}}', "ZGVwbG95OnB3"),
    ("GET /c/x?sv=2022-11-02&sig=abcDEF123%2Bxyz%3D&sp=r", "abcDEF123%2Bxyz%3D"),
    ("X-API-Key: 9f8e7d6c", "9f8e7d6c"),
    ('password: "correct horse battery"', "correct horse battery"),
    ("Cookie: session=abc123def; theme=dark", "session=abc123def"),
    ("client_secret=s3cr3t&grant_type=client_credentials", "s3cr3t"),
    ("curl -u admin:Adm1nPw https://ci/api", "Adm1nPw"),
    ("pin: 4711\npassword: 123456", "123456"),
])
def test_context_rules(text: str, secret: str) -> None:
    out = Redactor().redact(text)
    assert secret not in out, out
    assert "[REDACTED:" in out, out


KEY_SHAPES = {
    "rsa": lambda rng, n: secret_families.private_key_block(rng, "RSA PRIVATE KEY", n),
    "openssh": lambda rng, n: secret_families.private_key_block(rng, "OPENSSH PRIVATE KEY", n, 70),
    "pgp": lambda rng, n: secret_families.private_key_block(rng, "PGP PRIVATE KEY BLOCK", n),
    "putty": lambda rng, n: secret_families.putty_key(rng, n // 48),
}


@pytest.mark.parametrize("shape", sorted(KEY_SHAPES))
@pytest.mark.parametrize("key_bytes", [1200, 3300, 12_000, 200_000])
def test_key_cut_at_the_capture_tail_is_fully_redacted(
        tmp_path: Path, shape: str, key_bytes: int) -> None:
    """The runtime cleans the last 4 KiB of a 64 KiB head + 64 KiB tail capture: a key
    longer than the tail arrives without its BEGIN line (issue 11)."""
    rng = random.Random(key_bytes)
    key, body = KEY_SHAPES[shape](rng, key_bytes)
    capture = BoundedCapture(tmp_path / "stderr.log")
    capture.write(b"x" * 70_000 + b"\nloading key\n")
    capture.write(key.encode() + b"\nerror: key rejected\n")
    capture.close()
    error = "exit status 1\n" + capture.tail_text(4096)
    out = Redactor().clean(error, 4096)
    assert not [line for line in body if line[:16] in out], out[:400]
    assert out.endswith("error: key rejected\n")


def test_json_escaped_key_body_without_its_begin_is_redacted() -> None:
    rng = random.Random(3)
    key, body = secret_families.private_key_block(rng, "PRIVATE KEY")
    escaped = key.replace("\n", "\\n")
    tail = escaped[escaped.index(body[3]):]  # the capture cut inside the JSON string
    out = Redactor().redact(f'{tail}\\n", "client_email": "ci@x.iam"}}')
    assert not [line for line in body[3:] if line in out]
    assert "client_email" in out


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(codec="ascii", exclude_characters="\r"), max_size=200),
       st.text(alphabet=st.characters(codec="ascii", exclude_characters="\r"), max_size=200),
       st.sampled_from([s for s in FAMILIES if s.family not in NOT_SECRETS
                        and "\n" not in s.line]))
def test_a_sample_stays_redacted_whatever_surrounds_it(
        before: str, after: str, sample: secret_families.Sample) -> None:
    out = Redactor().redact(f"{before}\n{sample.line}\n{after}")
    assert not [x for x in (*sample.secrets, *sample.fragments) if x in out]


@pytest.mark.parametrize("width", [64, 70])
def test_key_whose_stream_stopped_mid_body_is_redacted(width: int) -> None:
    """An agent killed by its timeout while printing a key: no BEGIN (cut by the tail)
    and no END (never written)."""
    rng = random.Random(width)
    _, body = secret_families.private_key_block(rng, "OPENSSH PRIVATE KEY", 4000, width)
    out = Redactor().clean("timed out after 30 s\n" + "\n".join(body[10:40]), 4096)
    assert not [line for line in body[10:40] if line in out]
    assert out.startswith("timed out after 30 s\n")
