"""BLAKE3 digests and canonical JSON: the byte-level rules every contract rests on.

Canonical JSON is sorted keys, no insignificant white space, UTF-8 (DESIGN section 4):
two machines that build the same object get the same bytes and so the same digest.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import blake3

DIGEST_HEX_LEN = 64
PLAN_DIR_PREFIX_LEN = 16


def blake3_hex(data: bytes) -> str:
    """Return the BLAKE3 hex digest (64 lowercase hex characters) of ``data``."""
    return blake3.blake3(data).hexdigest()


def file_blake3(path: Path, chunk: int = 1 << 20) -> str:
    """Return the BLAKE3 hex digest of a file's bytes, read in chunks."""
    hasher = blake3.blake3()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            hasher.update(block)
    return hasher.hexdigest()


def canonical_json(obj: Any) -> bytes:
    """Encode ``obj`` as canonical JSON bytes: sorted keys, compact separators, UTF-8."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def is_hex(text: str) -> bool:
    """True when ``text`` is lowercase hex digits (a digest or a prefix of one)."""
    return all(c in "0123456789abcdef" for c in text)


def is_digest(text: str) -> bool:
    """True when ``text`` looks like a BLAKE3 hex digest."""
    return len(text) == DIGEST_HEX_LEN and is_hex(text)
