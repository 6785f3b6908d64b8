"""The two ways the runtime writes files: once and read-only, or replaced atomically."""

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
