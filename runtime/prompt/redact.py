"""Failure-text pipeline: sanitize -> redact -> bound (DESIGN section 6).

Sanitize strips ANSI escape sequences and control and format characters (newlines and
tabs stay). Redaction replaces credentials with ``[REDACTED:<kind>]``: operator-declared
literals and the values of secret-looking environment variables given to agents; private
keys (PEM, OpenSSH, PGP, PuTTY, JSON-escaped), also when only their tail is present;
about two hundred vendor token formats (``redact_formats.py``); JWTs and authorization
headers; and context a format scanner cannot see: credentials in URLs, ``name = value``
forms whose name says password/secret/token/key/auth, command-line flags, ``.netrc`` and
``.pgpass`` lines (issue 11). It runs before the cut, so a cut never exposes half a
secret. Bound keeps the head and the tail and says how many characters were dropped.
Encoding for the prompt is the preamble's job (``feedback.py``).

What must survive, byte for byte: git SHAs, content digests, UUIDs, paths, integrity
hashes, base64 data, vendors' documented example keys and placeholders such as
``${TOKEN}``, ``<token>`` or ``changeme`` (``tests/benign_corpus.py``).
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from runtime.prompt.redact_formats import ANCHORS, FORMATS

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
    """Remove escapes and invisible characters that can disguise text.

    Remove ANSI escapes, control characters (except newline and tab) and Unicode format
    characters (bidi overrides, zero-width joiners), which can disguise text.
    """
    return _INVISIBLE.sub("", _ANSI.sub("", text.replace("\r\n", "\n")))


# -- multi-line keys ------------------------------------------------------------------
# A key's body is recognised by its shape, not only by its BEGIN line: the error text is
# the tail of a bounded capture, which may start in the middle of a key (issue 11).
_KEY_LABEL = r"[A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?"
_BEGIN, _END = rf"-{{4,5}} ?BEGIN{_KEY_LABEL} ?-{{4,5}}", rf"-{{4,5}} ?END{_KEY_LABEL} ?-{{4,5}}"
_KEYS: list[tuple[str, re.Pattern[str]]] = [
    ("private_key", re.compile(
        rf"{_BEGIN}[\s\S]*?(?:{_END}|\Z)")),
    # Headless: whole lines of base64 (real or JSON-escaped newlines) ending in END.
    ("private_key", re.compile(rf"(?m)^(?:[A-Za-z0-9+/=]{{8,}}\n)+{_END}")),
    ("private_key", re.compile(rf"(?:[A-Za-z0-9+/=]{{8,}}\\n)+{_END}")),
    # A stream that stopped inside a key (an agent killed by its timeout mid-print):
    # full-width key lines (64 for PEM and PuTTY, 70 for OpenSSH) up to the very end.
    ("private_key", re.compile(
        r"(?m)^(?:[A-Za-z0-9+/]{64}\n|[A-Za-z0-9+/]{70}\n){2,}[A-Za-z0-9+/=]{0,70}\n?\Z")),
    # PuTTY: the private lines and the MAC, with or without their header.
    ("private_key", re.compile(
        r"(?m)(?:^Private-Lines: *\d+\n)?(?:^[A-Za-z0-9+/=]{8,}\n)*^Private-MAC: *[0-9a-fA-F]+")),
]
_KEY_ANCHORS = ("PRIVATE KEY", "PRIVATE KEY", "PRIVATE KEY", "", "Private-MAC")

# -- vendor formats -------------------------------------------------------------------
def _anchor(kind: str, pattern: str) -> str:
    """A literal every match contains, when the pattern does not start with one."""
    if kind == "facebook_token" and pattern.startswith("\\d"):
        return "|" if "|" in pattern else "%7C"
    return ANCHORS.get(kind, "") if pattern[0] in "\\[" else ""


_ALTERNATIVES = re.compile(r"\(\?:((?:[^()|\\[\]{}]|\\.)+(?:\|(?:[^()|\\[\]{}]|\\.)+)*)\)")


def _split(pattern: str) -> list[str]:
    """``(?:ab|cd)rest`` as ``abrest`` and ``cdrest``.

    A pattern that starts with a literal is searched for at C speed (sre's literal prefix
    scan), an alternation is tried at every position, about 30 times slower on log text.
    """
    m = _ALTERNATIVES.match(pattern)
    if m is None:
        return [pattern]
    return [alt + pattern[m.end():] for alt in m.group(1).split("|")]


@functools.cache
def _formats() -> list[tuple[str, re.Pattern[str], str]]:
    """The vendor formats, compiled on first use.

    About 25 ms of compiling that a run with no failure to redact, and every CLI verb that
    never redacts, would otherwise pay at start-up.
    """
    return [(kind, re.compile(one), _anchor(kind, p))
            for kind, p in FORMATS for one in _split(p)]


_WORDCHAR = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")
# Formats that sit inside a larger word by design (Telegram's ``/bot<token>/``).
_EMBEDDED = frozenset({"telegram_bot_token", "slack_webhook", "teams_webhook",
                       "azure_storage_key", "sidekiq_credentials", "gitlab_session"})

# -- headers, JWTs, URLs, .pgpass ----------------------------------------------------------
_STRUCTURED: list[tuple[str, re.Pattern[str], int, str]] = [
    # (kind, pattern, group to replace, literal that must be present; lower-case anchors
    # are looked for in the lower-cased text)
    ("jwt", re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"), 0,
     "eyJ"),
    ("authorization", re.compile(
        r"(?i)\b(?:authorization|proxy-authorization)\s*[:=]\s*[\"']?(?:bearer|basic|token|"
        r"digest|negotiate|apikey|api-key|sso-key)\s+([^\s\"',;]+)"), 1, "authorization"),
    ("bearer_token", re.compile(r"(?i)\bbearer\s+([A-Za-z0-9._~+/-]{16,}=*)"), 1, "bearer"),
    ("curl_user", re.compile(r"(?:\s-u|--user)[ =][\"']?[^\s:\"']+:([^\s\"']+)"), 1, ":"),
    ("nuget_password", re.compile(
        r"(?i)<add\s+key=\"[^\"]*(?:password|secret|token|apikey)[^\"]*\"\s+value=\"([^\"]+)\""), 1,
     "<add"),
    ("pgpass", re.compile(
        r"(?m)^(?:[A-Za-z*][\w.-]*|\d{1,3}(?:\.\d{1,3}){3}):(?:\d{1,5}|\*):[^:\s]+:[^:\s]+:"
        r"(\S+)$"), 1, ":"),
]


def _entropy(value: str) -> float:
    counts = Counter(value)
    return -sum(c / len(value) * math.log2(c / len(value)) for c in counts.values())


_PLACEHOLDER = re.compile(
    r"(?i)^(?:\$\{?[A-Za-z_][\w.-]{0,40}\}?|\$\{\{.*\}\}|\{\{.*\}\}|<[^>]*>|%\(?[\w]+\)?s?|%[\w]+%|"
    r"\[redacted[^\]]*\]|x{3,}|\*{3,}|\.{3,}|-+|_+|changeme|change_me|changeit|example|"
    r"sample|dummy|placeholder|(?:your|my)[_-]?[a-z_-]*|none|null|nil|true|false|yes|no|on|"
    r"off|enabled?|disabled?|required|optional|undefined|redacted|hidden|masked|secret|"
    r"password|token|string|str|env|test|basic|bearer|digest|oauth2?|jwt|\*+|"
    r"os\.environ.*|process\.env.*|getenv.*|\w+\(.*)$"
)


def is_placeholder(value: str) -> bool:
    """A value that names or stands for a secret rather than being one."""
    # Vendors document example keys with EXAMPLE in them (AKIAIOSFODNN7EXAMPLE); masked
    # ones end in a run of one character (ghp_xxxx..., sk_live_XXXX...).
    return bool(_PLACEHOLDER.match(value) or _MASKED.search(value)) or "EXAMPLE" in value


_MASKED = re.compile(r"(.)\1{11,}$")


def _is_path(value: str) -> bool:
    return value.startswith(("/", "~/", "./", "../")) or bool(re.match(r"[A-Za-z]:\\", value))


def looks_secret(value: str) -> bool:
    """Entropy and placeholder filter for values whose name does not say password."""
    if is_placeholder(value) or _is_path(value) or value.startswith(("http://", "https://")):
        return False
    if len(value) < 6 or value.isdigit():
        return False
    mixed = sum(bool(re.search(p, value)) for p in (r"[a-z]", r"[A-Z]", r"\d", r"[^\w]"))
    return mixed >= 2 or _entropy(value) >= 3.0


def _likely_secret(value: str) -> bool:
    """A stricter ``looks_secret``, for ambiguous names such as a bare ``key``.

    Stricter than ``looks_secret``, for names such as a bare ``key`` that often hold
    ordinary words (``key="ClearTextPassword"``, ``sort_key: createdAt``).
    """
    if not looks_secret(value):
        return False
    has_digit = any(c.isdigit() for c in value)
    return (has_digit and len(value) >= 8) or (len(value) >= 20 and _entropy(value) >= 3.5)


# -- name = value ---------------------------------------------------------------------
def _wordset(text: str) -> frozenset[str]:
    return frozenset(text.split())


_NAME_HIT = re.compile(r"pass|pwd|secret|token|key|credential|auth|cookie|sig")
_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")
_OPERATOR = re.compile(r"[\"']?[ \t]*(?::=|=>|=(?!=)|:(?![:/]))[ \t]*|[ \t]+")
# A name ending in one of these describes a secret without being one.
_NOT_VALUE = _wordset(
    "url uri urls file files path dir name names id ids type types count length len "
    "size hint policy reset expiry expires expiration ttl used format header field "
    "env var ref algorithm algo mode enabled required prompt label endpoint host "
    "hosts min max rotation version at date time timeout store manager provider "
    "source kind class limit limits method methods scheme prefix suffix index "
    "validity valid invalid lifetime duration location loc age fingerprint digest "
    "hash checksum bits strength level status changed change error errors message "
    "flow grant scope scopes audience issuer"
)
_QUALIFIED_KEY = _wordset(
    "api access secret private master signing encryption encrypt consumer account "
    "license client app service shared auth session admin deploy webhook subscription "
    "storage ssh gpg pgp x root write read sas ingest instrumentation"
)
_SEPARATORS = frozenset(" \t\n\"'`,;&<>")


def _secret_name(name: str) -> str | None:
    """Classify a name by how likely its values are credentials.

    'any' when every value is a secret, 'likely' when only a secret-looking one is, None
    when the name does not describe a credential.
    """
    words = [w.lower() for w in _WORDS.findall(name)]
    if not words or words[-1] in _NOT_VALUE:
        return None
    last = words[-1]
    if last == "pass" or any("passw" in w or w.endswith(("pwd", "passphrase")) or "secret" in w
                             or w.startswith("credential") for w in words):
        return "any"
    if "public" in words:
        return None
    if last.endswith(("token", "apikey", "auth")) or last in ("sig", "signature"):
        return "any"
    if last == "key" and any(w in _QUALIFIED_KEY for w in words[:-1]):
        return "any"
    if last.endswith("key") or last in ("cookie", "session", "sid"):
        return "likely"
    return None


# C901: One pass over the text with its states in one loop, as a scanner reads best.
def _assignments(text: str) -> list[tuple[int, int, str]]:  # noqa: C901
    """Spans of values whose name says they are secret."""
    lower, spans, seen = _ascii_lower(text), [], -1
    n = len(text)
    for hit in _NAME_HIT.finditer(lower):
        start = hit.start()
        if start < seen:
            continue
        while start > 0 and text[start - 1] in _NAME_CHARS:
            start -= 1
        end = hit.end()
        while end < n and text[end] in _NAME_CHARS:
            end += 1
        seen = end
        name = text[start:end].lstrip("-.")
        flag = text[start:start + 2] == "--"
        kind = _secret_name(name)
        if kind is None:
            continue
        op = _OPERATOR.match(text, end)
        if op is None:
            continue
        if not op.group().strip(" \t\"'"):  # whitespace only: flags and .netrc lines
            line_start = text.rfind("\n", 0, start) + 1
            netrc = name.lower() in ("password", "passwd") and (
                " login " in text[line_start:start] or text[line_start:start].startswith(
                    ("machine ", "default ")))
            if not (flag or netrc):
                continue
        span = _value_span(text, op.end(), cookie=name.lower().endswith("cookie"))
        if span is None:
            continue
        value = text[span[0]:span[1]]
        if value.startswith("[REDACTED") or is_placeholder(value) or _is_path(value):
            continue
        if kind == "likely" and not _likely_secret(value):
            continue
        spans.append((span[0], span[1], "assignment"))
        seen = span[1]
    return spans


def _value_span(text: str, pos: int, cookie: bool) -> tuple[int, int] | None:
    if pos >= len(text):
        return None
    if text.startswith(("${{", "{{"), pos):  # a template expression, spaces and all
        close = text.find("}}", pos)
        return (pos, close + 2) if close > 0 else None
    quote = text[pos]
    if quote in "\"'`":
        close = text.find(quote, pos + 1)
        eol = text.find("\n", pos + 1)
        if close < 0 or (0 <= eol < close) or close == pos + 1:
            return None
        return pos + 1, close
    end = pos
    stop = " \t\n\"'`<>" if cookie else _SEPARATORS
    while end < len(text) and text[end] not in stop:
        end += 1
    while end > pos and text[end - 1] in ",;.)}]":
        end -= 1
    return (pos, end) if end > pos else None


# -- credentials in URLs ---------------------------------------------------------------
# The password runs to the last '@' before the end of the token, so '@', '/' and '%'
# inside it are covered (issue 11).
_URL_USERINFO = re.compile(
    r"\b[a-zA-Z][a-zA-Z0-9+.-]{1,20}://([^\s:/?#@\"'<>]*):([^\s\"'<>]*)@[\w\[\]-]")


def _url_credentials(text: str) -> list[tuple[int, int, str]]:
    spans = []
    for m in _URL_USERINFO.finditer(text):
        password = m.group(2)
        if not password or re.match(r"\d{1,5}(?:/|$)", password) or password.startswith(
                "[REDACTED") or is_placeholder(password):
            continue  # host:port/path@..., or already redacted
        spans.append((m.start(2), m.end(2), "url_credentials"))
    return spans


@dataclass(frozen=True)
class Redactor:
    """Redacts secret formats plus literal values.

    Operator-declared ones and those of secret-looking environment variables given to
    agents.
    """

    literals: tuple[str, ...] = ()

    @classmethod
    def from_environment(cls, env: Mapping[str, str], declared: Iterable[str] = ()) -> Redactor:
        """Values of variables whose name says secret, except placeholders and paths.

        ``PWD``/``OLDPWD`` match "pwd" but hold the working directory (issue 10 item 7).
        """
        values = {v for k, v in env.items() if _env_secret(k, v)}
        values |= {v for v in declared if len(v) >= 4}
        return cls(tuple(sorted(values, key=len, reverse=True)))

    def redact(self, text: str) -> str:
        """Replace every recognised credential in ``text``."""
        if not text.strip():  # most attempts succeed silently: skip ~300 pattern probes
            return text
        for value in self.literals:
            text = text.replace(value, "[REDACTED:literal]")
        for (kind, pattern), anchor in zip(_KEYS, _KEY_ANCHORS, strict=True):
            if anchor in text:
                text = pattern.sub(f"[REDACTED:{kind}]", text)
        text = _apply(text, _format_spans(text))
        lower = _ascii_lower(text)
        for kind, pattern, group, anchor in _STRUCTURED:
            if anchor in (lower if anchor.islower() else text):
                text = _apply(text, [(m.start(group), m.end(group), kind)
                                     for m in pattern.finditer(text)
                                     if not is_placeholder(m.group(group))
                                     and not m.group(group).startswith("[REDACTED")])
        if "://" in text:
            text = _apply(text, _url_credentials(text))
        return _apply(text, _assignments(text))

    def clean(self, text: str, limit: int) -> str:
        """The whole pipeline but encoding: sanitize, redact, then bound."""
        return bound(self.redact(sanitize(text)), limit)


_PATH_NAMES = frozenset({"PWD", "OLDPWD", "HOME", "PATH", "TMPDIR", "SHELL"})


def _env_secret(name: str, value: str) -> bool:
    if name in _PATH_NAMES or len(value) < MIN_LITERAL or is_placeholder(value) \
            or _is_path(value):
        return False
    return _secret_name(name) is not None or bool(_ENV_HINT.search(name))


# Environment names are matched more broadly than assignments (a value given to an
# agent is a literal we know, so a false positive only hides our own configuration).
_ENV_HINT = re.compile(r"(?i)(?:key|token|secret|passw|credential|auth|private|session|"
                       r"cookie|signature|cert|dsn|webhook)")
MIN_LITERAL = 6


def _format_spans(text: str) -> list[tuple[int, int, str]]:
    spans = []
    for kind, pattern, anchor in _formats():
        if anchor and anchor not in text:
            continue
        for m in _search(pattern, text, anchor):
            start = m.start()
            if start and text[start - 1] in _WORDCHAR and kind not in _EMBEDDED:
                continue
            if is_placeholder(m.group()):
                continue
            spans.append((start, m.end(), kind))
    return spans


def _search(pattern: re.Pattern[str], text: str, anchor: str) -> Iterator[re.Match[str]]:
    """Matches of a pattern that does not start with a literal.

    Only around each occurrence of its anchor, from the start of the token the anchor is in
    (a scan of the whole text costs ~20 ns a character).
    """
    if not anchor:
        yield from pattern.finditer(text)
        return
    pos = 0
    while (i := text.find(anchor, pos)) >= 0:
        low = max(0, i - 256)
        start = max(low, pos, *(text.rfind(c, low, i) + 1 for c in " \t\n\"'`"))
        end = min(len(text), i + 1024)
        for m in pattern.finditer(text, start, end):
            yield m
            pos = max(pos, m.end())
        pos = max(pos, i + len(anchor))


def _apply(text: str, spans: list[tuple[int, int, str]]) -> str:
    """Replace non-overlapping spans (earliest, then longest, wins)."""
    if not spans:
        return text
    out, pos = [], 0
    for start, end, kind in sorted(spans, key=lambda s: (s[0], -s[1])):
        if start < pos:
            if end > pos:  # overlapping match reaching further: extend the redaction
                pos = end
            continue
        out += [text[pos:start], f"[REDACTED:{kind}]"]
        pos = end
    out.append(text[pos:])
    return "".join(out)


def _ascii_lower(text: str) -> str:
    """Lower-case A-Z only, so the result has the same length as ``text``."""
    return text.lower() if text.isascii() else text.translate(_ASCII_LOWER)


_ASCII_LOWER = {c: c + 32 for c in range(ord("A"), ord("Z") + 1)}


def bound(text: str, limit: int) -> str:
    """Keep the head and tail of ``text`` within ``limit`` characters, marking the cut."""
    if len(text) <= limit:
        return text
    marker_room = 48
    keep = max(limit - marker_room, 0)
    head, tail = keep // 2, keep - keep // 2
    dropped = len(text) - head - tail
    return f"{text[:head]}\n[... {dropped} characters dropped ...]\n{text[len(text) - tail:]}"
