"""The two ways the runtime writes files (once and read-only, or replaced atomically),
and the one check that a path from a topology or an agent stays inside its root."""

from __future__ import annotations

import os
import threading
from pathlib import Path

READ_ONLY = 0o444


def write_read_only(path: Path, data: bytes) -> None:
    """Create ``path`` (its directory must exist) with mode 0444; never overwrite."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, READ_ONLY)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def replace_atomically(path: Path, data: bytes) -> None:
    """Write a sibling, then rename it over ``path``: readers see the old or the new
    file, never half of one. The temporary name is unique per process and thread."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def within(root: str | Path, path: str | Path) -> str | None:
    """The real path of ``path`` (a relative one is taken from ``root``) when it resolves
    inside ``root``'s real path; None otherwise. Symlinks and ``..`` cannot escape."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, path))
    return real if os.path.commonpath([real, real_root]) == real_root else None
