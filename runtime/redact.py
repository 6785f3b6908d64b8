"""Failure-text pipeline: sanitize -> redact -> bound (DESIGN section 6).

Sanitize strips ANSI escape sequences and control and format characters (newlines and
tabs stay). Redaction replaces known secret formats, the values of secret-looking
environment variables given to agents, and operator-declared literals with
``[REDACTED:<kind>]``; it runs before the cut, so a cut never exposes half a secret.
Bound keeps the head and the tail and says how many characters were dropped. Encoding
for the prompt is the preamble's job (``feedback.py``).

What must survive: git SHAs, content hashes, UUIDs, paths, and placeholders such as
``${TOKEN}``, ``<token>`` or ``changeme``.
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

_ANSI = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"           # CSI: colours, cursor movement
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"  # OSC: titles, hyperlinks
    r"|\x1b[PX^_][^\x1b]*(?:\x1b\\)?"     # DCS, SOS, PM, APC strings
    r"|\x1b[@-Z\\-_]"                     # two-character escapes
    r"|\x9b[0-?]*[ -/]*[@-~]"             # 8-bit CSI
)


# Every Cc (except tab and newline) and Cf code point as of Unicode 15, plus surrogates.
_INVISIBLE = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\xad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891"
    "\u08e2\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u206f\ufeff"
    "\ufff9-\ufffb\U000110bd\U000110cd\U00013430-\U0001343f\U0001bca0-\U0001bca3"
    "\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f\ud800-\udfff]"
)


def sanitize(text: str) -> str:
    """Remove ANSI escapes, control characters (except newline and tab) and Unicode
    format characters (bidi overrides, zero-width joiners), which can disguise text."""
    return _INVISIBLE.sub("", _ANSI.sub("", text.replace("\r\n", "\n")))


# (kind, pattern, group to replace: 0 = whole match). Order matters: specific first.
_PATTERNS: list[tuple[str, re.Pattern[str], int]] = [
    ("private_key", re.compile(
        r"-----BEGIN[A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?-----[\s\S]*?"
        r"(?:-----END[A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?-----|\Z)"), 0),
    ("jwt", re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"), 0),
    ("aws_access_key_id", re.compile(
        r"\b(?:AKIA|ASIA|ABIA|ACCA|AGPA|AIDA|AIPA|ANPA|ANVA|AROA|APKA)[A-Z0-9]{16}\b"), 0),
    ("aws_secret_access_key", re.compile(
        r"(?:aws|amazon)[\w.-]{0,30}?(?:secret|private)[\w.-]{0,30}?[\"']?\s*[:=]\s*"
        r"[\"']?([A-Za-z0-9/+]{40})(?![A-Za-z0-9/+])"), 1),
    ("github_token", re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{36,255}|github_pat_"
                                r"[A-Za-z0-9_]{22,255})\b"), 0),
    ("gitlab_token", re.compile(r"\bgl(?:pat|ptt|dt|rt|cbt|imt|agent|oas|soat|ft)-"
                                r"[A-Za-z0-9_-]{20,}"), 0),
    ("slack_webhook", re.compile(r"https://hooks\.slack\.com/(?:services|workflows|triggers)"
                                 r"/[A-Za-z0-9/_-]+"), 0),
    ("slack_token", re.compile(r"\bxox[abposre]-[A-Za-z0-9-]{10,}"), 0),
    ("google_api_key", re.compile(r"\bAIza[0-9A-Za-z_-]{35}(?![0-9A-Za-z_-])"), 0),
    ("google_oauth", re.compile(r"\b(?:ya29\.[0-9A-Za-z_-]{20,}|GOCSPX-[A-Za-z0-9_-]{28}|"
                                r"1//0[0-9A-Za-z_-]{40,})"), 0),
    ("stripe_key", re.compile(r"\b(?:sk|rk)_(?:live|test)_[0-9A-Za-z]{16,}\b|"
                              r"\bwhsec_[A-Za-z0-9]{24,}\b"), 0),
    ("anthropic_key", re.compile(r"\bsk-ant-[A-Za-z0-9]{3,8}\d{0,3}-[A-Za-z0-9_-]{20,}"), 0),
    ("openai_key", re.compile(r"\bsk-(?:proj-|svcacct-|admin-|None-)?[A-Za-z0-9_-]{20,}"), 0),
    ("huggingface_token", re.compile(r"\bhf_[A-Za-z0-9]{30,}\b"), 0),
    ("npm_token", re.compile(r"\bnpm_[A-Za-z0-9]{36}\b"), 0),
    ("pypi_token", re.compile(r"\bpypi-AgE[A-Za-z0-9_-]{50,}"), 0),
    ("sendgrid_key", re.compile(r"\bSG\.[A-Za-z0-9_-]{16,32}\.[A-Za-z0-9_-]{30,64}"), 0),
    ("twilio_key", re.compile(r"\b(?:SK|AC)[0-9a-f]{32}\b"), 0),
    ("telegram_bot_token", re.compile(r"(?<![0-9])\d{8,10}:AA[A-Za-z0-9_-]{33}"
                                      r"(?![A-Za-z0-9_-])"), 0),
    ("azure_storage_key", re.compile(
        r"(?:accountkey|sharedaccesskey|azure[\w.-]{0,30}?key)\s*[=:]\s*[\"']?"
        r"([A-Za-z0-9+/]{40,}={0,2})"), 1),
    ("authorization", re.compile(
        r"\b(?:authorization|proxy-authorization)\s*[:=]\s*[\"']?(?:bearer|basic|token|"
        r"digest|negotiate)\s+([^\s\"',;]+)"), 1),
    ("bearer_token", re.compile(r"\bbearer\s+([A-Za-z0-9._~+/-]{16,}=*)"), 1),
    ("url_credentials", re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s:/@\"']+:([^\s@/\"']+)@"),
     1),
]

# Literal substrings without which a pattern cannot match: a C-speed ``in`` test skips
# the pattern's scan (Python's re costs ~25 ns a character a pattern). Lower-case anchors
# are tested against the lower-cased text.
_ANCHORS: dict[str, tuple[str, ...]] = {
    "private_key": ("PRIVATE KEY",), "jwt": ("eyJ",),
    "aws_access_key_id": ("AKIA", "ASIA", "ABIA", "ACCA", "AGPA", "AIDA", "AIPA", "ANPA",
                          "ANVA", "AROA", "APKA"),
    "aws_secret_access_key": ("aws", "amazon"),
    "github_token": ("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_"),
    "gitlab_token": ("glpat-", "glptt-", "gldt-", "glrt-", "glcbt-", "glimt-", "glagent-",
                     "gloas-", "glsoat-", "glft-"),
    "slack_webhook": ("hooks.slack.com",), "slack_token": ("xox",),
    "google_api_key": ("AIza",), "google_oauth": ("ya29.", "GOCSPX-", "1//0"),
    "stripe_key": ("_live_", "_test_", "whsec_"), "anthropic_key": ("sk-ant-",),
    "openai_key": ("sk-",), "huggingface_token": ("hf_",), "npm_token": ("npm_",),
    "pypi_token": ("pypi-AgE",), "sendgrid_key": ("SG.",), "twilio_key": ("SK", "AC"),
    "telegram_bot_token": (":AA",), "azure_storage_key": ("accountkey", "sharedaccesskey", "azure"),
    "authorization": ("authorization",), "bearer_token": ("bearer",),
    "url_credentials": ("://",),
}
# These patterns are written in lower case and run on an ASCII-lowered copy of the text
# (same length, so spans map back): case-insensitive matching in Python's re is slow.
_FOLDED = {"aws_secret_access_key", "azure_storage_key", "authorization", "bearer_token"}

# Anchored at the keyword (matching from the key's start backtracked over every word);
# whatever precedes the keyword in the key stays as it is.
_ASSIGNMENT = re.compile(
    r"((?:password|passwd|passphrase|pwd|secret|token|api[_-]?key|apikey|access[_-]?key|"
    r"private[_-]?key|auth[_-]?token|credentials?|session[_-]?id|cookie)[\w.-]*)"
    r"([\"']?\s*(?::|=|=>|:=)\s*)([\"']?)([^\s\"',;&}<>]{4,})"
)
_ASSIGNMENT_ANCHORS = ("passw", "passphrase", "pwd", "secret", "token", "key", "credential",
                       "session", "cookie")
_PLACEHOLDER = re.compile(
    r"(?i)^(?:\$\{?[\w.-]+\}?|\{\{.*\}\}|<[^>]*>|%\(?[\w]+\)?s?|\[redacted[^\]]*\]|x{3,}|\*{3,}|"
    r"\.{3,}|changeme|change_me|example|sample|dummy|placeholder|your[_-]?\w*|none|null|"
    r"true|false|required|optional|undefined|redacted|secret|password|token|string|env|"
    r"test|\d+)$"
)
_SECRET_ENV_NAME = re.compile(
    r"(?i)(?:key|token|secret|passw|pwd|credential|auth|private|session|cookie|signature|"
    r"cert|dsn|webhook)")
MIN_LITERAL = 6


def _entropy(value: str) -> float:
    counts = Counter(value)
    return -sum(c / len(value) * math.log2(c / len(value)) for c in counts.values())


def looks_secret(value: str) -> bool:
    """Entropy and placeholder filter for ``key = value`` assignments."""
    if _PLACEHOLDER.match(value) or value.startswith(("/", "./", "~/", "http://", "https://")):
        return False
    if len(value) < 6:
        return False
    mixed = sum(bool(re.search(p, value)) for p in (r"[a-z]", r"[A-Z]", r"\d", r"[^\w]"))
    return mixed >= 2 or _entropy(value) >= 3.0


@dataclass(frozen=True)
class Redactor:
    """Redacts secret formats plus literal values: operator-declared ones and those of
    secret-looking environment variables given to agents."""

    literals: tuple[str, ...] = ()

    @classmethod
    def from_environment(cls, env: Mapping[str, str], declared: Iterable[str] = ()) -> Redactor:
        values = {v for k, v in env.items() if _SECRET_ENV_NAME.search(k)
                  and len(v) >= MIN_LITERAL and not _PLACEHOLDER.match(v)}
        values |= {v for v in declared if len(v) >= 4}
        return cls(tuple(sorted(values, key=len, reverse=True)))

    def redact(self, text: str) -> str:
        for value in self.literals:
            text = text.replace(value, "[REDACTED:literal]")
        lower = _ascii_lower(text)
        for kind, pattern, group in _PATTERNS:
            haystack = lower if kind in _FOLDED else text
            if any(anchor in haystack for anchor in _ANCHORS[kind]):
                text = _splice(text, pattern.finditer(haystack),
                               functools.partial(_replace_group, kind=kind, group=group))
                lower = _ascii_lower(text)
        if any(anchor in lower for anchor in _ASSIGNMENT_ANCHORS):
            text = _splice(text, _ASSIGNMENT.finditer(lower), _replace_assignment)
        return text

    def clean(self, text: str, limit: int) -> str:
        """The whole pipeline but encoding: sanitize, redact, then bound."""
        return bound(self.redact(sanitize(text)), limit)


def _ascii_lower(text: str) -> str:
    """Lower-case A-Z only, so the result has the same length as ``text``."""
    return text.lower() if text.isascii() else text.translate(_ASCII_LOWER)


_ASCII_LOWER = {c: c + 32 for c in range(ord("A"), ord("Z") + 1)}


def _splice(text: str, matches: Iterator[re.Match[str]],
            replace: Callable[[re.Match[str], str], str]) -> str:
    """Rebuild ``text`` with each match's span replaced; spans index ``text`` itself
    (matches may come from its ASCII-lowered copy)."""
    out, pos = [], 0
    for m in matches:
        out += [text[pos:m.start()], replace(m, text)]
        pos = m.end()
    if not out:
        return text
    out.append(text[pos:])
    return "".join(out)


def _span(text: str, m: re.Match[str], group: int) -> str:
    return text[m.start(group):m.end(group)]


def _replace_group(m: re.Match[str], text: str, *, kind: str, group: int) -> str:
    if group == 0:
        return f"[REDACTED:{kind}]"
    if _PLACEHOLDER.match(_span(text, m, group)):
        return _span(text, m, 0)  # "Authorization: Bearer $TOKEN" names a variable
    return (text[m.start():m.start(group)] + f"[REDACTED:{kind}]"
            + text[m.end(group):m.end()])


def _replace_assignment(m: re.Match[str], text: str) -> str:
    value = _span(text, m, 4)
    if not looks_secret(value) or value.startswith("[REDACTED"):
        return _span(text, m, 0)
    return text[m.start():m.start(4)] + "[REDACTED:assignment]"


def bound(text: str, limit: int) -> str:
    """Keep the head and tail of ``text`` within ``limit`` characters, marking the cut."""
    if len(text) <= limit:
        return text
    marker_room = 48
    keep = max(limit - marker_room, 0)
    head, tail = keep // 2, keep - keep // 2
    dropped = len(text) - head - tail
    return f"{text[:head]}\n[... {dropped} characters dropped ...]\n{text[len(text) - tail:]}"
