r"""The retry preamble: a trusted header plus one data block naming the prior failures.

    <trusted RETRY_HEADER, attempt k of N>
    <prior-failure-v1>
    {"attempt": k, ..., "failures": [...newest first...]}
    </prior-failure-v1>

The JSON is ASCII-only with ``<``, ``>``, ``&`` (and DEL) escaped as ``\u003c`` etc., so
the block is printable ASCII and the closing tag can only appear where the runtime
writes it; NFKC normalisation of ASCII is the identity, so no fullwidth or compatibility
character can turn into a bracket later. The whole preamble fits ``max_bytes`` after
encoding: error texts are shortened first, then the oldest failures dropped.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict

from runtime.digest import blake3_hex
from runtime.failures import FailureClass
from runtime.prompt.assemble import PRIOR_FAILURE_CLOSE, PRIOR_FAILURE_OPEN, RETRY_HEADER
from runtime.prompt.redact import bound

_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\x7f": "\\u007f"}
_ESCAPE_RE = re.compile("[<>&\x7f]")


def encode_block(data: Any) -> str:
    """JSON that is printable ASCII with no ``<``, ``>`` or ``&``."""
    text = json.dumps(data, ensure_ascii=True, sort_keys=True, separators=(",", ":"))
    return _ESCAPE_RE.sub(lambda m: _ESCAPES[m.group(0)], text)


def fingerprint(failure: FailureClass, error: str) -> str:
    """A failure's identity across attempts, stable under changing numbers and addresses.

    Its class and its error text with numbers, hex runs and white space normalised (timings
    and addresses differ between runs).
    """
    norm = re.sub(r"[0-9a-f]{7,}", "#", error.lower())
    norm = re.sub(r"\d+", "0", norm)
    norm = " ".join(norm.split())
    return blake3_hex(f"{failure.value}\n{norm}".encode())[:16]


def _block(attempt: int, max_attempts: int, failures: list[PriorFailure], limit: int) -> str:
    items = [{
        "attempt": f.attempt,
        "failure_class": f.failure_class.value,
        "exit_code": f.exit_code,
        "unsatisfied": [bound(u, limit) for u in f.unsatisfied],
        "error": bound(f.error, limit),
    } for f in failures]
    data = {"attempt": attempt, "max_attempts": max_attempts,
            "prior_attempt": failures[0].attempt, "trigger": "retry", "failures": items}
    header = RETRY_HEADER.format(attempt=attempt, max_attempts=max_attempts)
    return f"{header}\n{PRIOR_FAILURE_OPEN}\n{encode_block(data)}\n{PRIOR_FAILURE_CLOSE}"


def render_preamble(attempt: int, max_attempts: int, failures: list[PriorFailure],
                    max_bytes: int) -> str:
    """The preamble for attempt ``attempt``; ``failures`` newest first, non-empty."""
    if not failures:
        raise ValueError("a retry preamble needs at least one prior failure")
    kept = list(failures)
    while True:
        longest = max(max(len(f.error) for f in kept),
                      max((len(u) for f in kept for u in f.unsatisfied), default=0))
        lo, hi = 0, longest
        whole = _block(attempt, max_attempts, kept, hi)
        if len(whole) <= max_bytes:
            return whole
        while lo < hi:  # the largest error limit whose encoding fits
            mid = (lo + hi + 1) // 2
            if len(_block(attempt, max_attempts, kept, mid)) <= max_bytes:
                lo = mid
            else:
                hi = mid - 1
        text = _block(attempt, max_attempts, kept, lo)
        if len(text) <= max_bytes and (lo >= 256 or len(kept) == 1):
            return text
        if len(kept) == 1:
            # Even empty errors do not fit (a tiny bound): drop the unsatisfied items too.
            bare = [kept[0].model_copy(update={"unsatisfied": [], "error": ""})]
            return _block(attempt, max_attempts, bare, 0)
        kept = kept[:-1]  # drop the oldest failure and try again


class PriorFailure(BaseModel):
    """One earlier failed attempt, as the retry preamble reports it.

    Attributes:
        attempt: the failed attempt's number.
        failure_class: what the runtime classified the failure as.
        exit_code: the agent's exit status (None: stopped or never started).
        unsatisfied: artifact checks that failed.
        error: the redacted, bounded error text.
        fingerprint: the failure's identity, so repeated failures are reported once.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    attempt: int
    failure_class: FailureClass
    exit_code: int | None
    unsatisfied: list[str]
    error: str
    fingerprint: str
