"""One writer per run and per batch: an exclusive ``flock`` held for the whole command.

The lock file sits beside the run directory (``runs/.<id>.lock``), not inside it, so it
exists before the run does and a sandboxed agent (which sees an empty artifacts root)
cannot reach it. The kernel drops the lock when its holder dies, ``kill -9`` included,
so a crashed run is never locked out of ``resume``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

from runtime.errors import InUseError, UsageError

HOLDER_READS = 20  # 0.2 s at most to learn who holds a lock


def lock_path(directory: Path) -> Path:
    """The lock file of a run or batch directory, by its real path.

    A run reached through a symlink to it (or a symlinked parent) takes the same lock: a
    second lock would let two writers interleave the ledger.
    """
    real = Path(os.path.realpath(directory))
    return real.with_name(f".{real.name}.lock")


@contextlib.contextmanager
def hold(directory: Path, what: str) -> Iterator[None]:
    """Hold ``directory``'s lock, or raise ``InUseError`` naming the live holder's pid."""
    path = lock_path(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as exc:  # a link planted in its place, a read-only file system
        raise UsageError(f"{path}: cannot open the lock of {what} ({exc.strerror}); "
                         "it must be a regular file the runtime can write") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InUseError(what, _holder(fd)) from None
        mine = f"{os.getpid()}\n".encode()
        os.pwrite(fd, mine, 0)  # then cut: the file is never empty while we hold it
        os.ftruncate(fd, len(mine))
        yield
    finally:
        os.close(fd)  # releases the lock; the file stays (removing it would race)


def _holder(fd: int) -> int | None:
    """The holder's pid; it may have taken the lock a moment before writing it: re-read."""
    for _ in range(HOLDER_READS):
        with contextlib.suppress(OSError, ValueError):
            pid = int(os.pread(fd, 32, 0).decode().strip() or "0")
            if pid:
                return pid
        time.sleep(0.01)
    return None
