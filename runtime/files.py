"""How the runtime writes files, and the check that a path stays inside its root.

The ways the runtime writes files (once and read-only; replaced atomically; or created
read-only and later rewritten in place through the descriptor that created it), and the
one check that a path from a topology or an agent stays inside its root.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from pathlib import Path

READ_ONLY = 0o444


def write_read_only(path: Path, data: bytes) -> None:
    """Create ``path`` (its directory must exist) with mode 0444; never overwrite."""
    os.close(create_read_only(path, data))


def create_read_only(path: Path, data: bytes) -> int:
    """Create ``path`` with mode 0444 holding ``data``; return the still writable descriptor.

    The caller may later ``rewrite_in_place`` through it, and must close it.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, READ_ONLY)
    try:
        _write_all(fd, data, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def rewrite_in_place(fd: int, path: Path, data: bytes) -> None:
    """Replace the content of the file ``create_read_only`` made, then close ``fd``.

    One write to the same inode: no second file to create and no old inode to free, which
    on ext4 is most of what replacing a small file costs. Only while ``path`` is still that
    inode, with no other name: if anything replaced or linked it (an unsandboxed agent
    can), the file is replaced atomically instead, so ``path`` ends with ``data`` either
    way. A crash in the middle can leave the file torn (a reader must cope, as with any
    record an agent could touch); a kill between the write and the truncate cannot matter
    when the content only grows.
    """
    try:
        mine, now = os.fstat(fd), os.lstat(path)
        if (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino) and mine.st_nlink == 1:
            _write_all(fd, data, 0)
            os.ftruncate(fd, len(data))
            return
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)
    replace_atomically(path, data)


def _write_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:  # a regular file may take a write in parts (a signal, a full quota)
        offset += (n := os.pwrite(fd, view, offset))
        view = view[n:]


def replace_atomically(path: Path, data: bytes) -> None:
    """Write a sibling, then rename it over ``path``.

    Readers see the old or the new file, never half of one. The temporary name is unique per
    process and thread.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):  # a full disk, a directory in the way: no litter
            tmp.unlink()
        raise


def within(root: str | Path, path: str | Path) -> str | None:
    """Resolve ``path`` inside ``root``, or None when it would escape.

    The real path of ``path`` (a relative one is taken from ``root``) when it resolves
    inside ``root``'s real path; None otherwise. Symlinks and ``..`` cannot escape.
    """
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, path))
    return real if os.path.commonpath([real, real_root]) == real_root else None


class UnsafeFileError(OSError):
    """A file an agent could have planted is not a plain regular file, or too large."""


def open_no_follow(path: str | Path, dir_fd: int | None = None) -> int:
    """Open a regular file read-only without following a symlink in its last component.

    Refuse FIFOs, devices and directories (an agent may plant any of them).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                 dir_fd=dir_fd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnsafeFileError(f"{path}: not a regular file")
    return fd


def read_capped(path: str | Path, limit: int, dir_fd: int | None = None) -> bytes:
    """Read a regular file that is at most ``limit`` bytes, without following links."""
    fd = open_no_follow(path, dir_fd)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise UnsafeFileError(f"{path}: {size} bytes, more than the {limit} allowed")
        data = _read_bounded(fd, limit)
        if data is None:  # grew after fstat
            raise UnsafeFileError(f"{path}: more than the {limit} bytes allowed")
        return data
    finally:
        os.close(fd)


def _read_bounded(fd: int, limit: int) -> bytes | None:
    """Read all of ``fd``, or None once it holds more than ``limit`` bytes.

    All of ``fd``, or None once it holds more than ``limit`` bytes (reading stops one byte
    past the bound, whatever the file claims its size is).
    """
    chunks, total = [], 0
    while total <= limit and (chunk := os.read(fd, min(1 << 20, limit + 1 - total))):
        chunks.append(chunk)
        total += len(chunk)
    return None if total > limit else b"".join(chunks)


def read_regular(path: str | Path, max_bytes: int) -> bytes:
    """The bytes of ``path``, which must be a regular file of at most ``max_bytes``.

    The type and size are checked on the open descriptor before anything is read, and
    the read stops one byte past the bound: ``/dev/zero``, a FIFO or a huge file cost
    nothing (issue 9: ``runtime plan /dev/zero`` read until out of memory). Raises
    OSError when the file cannot be opened, ValueError (the message says why) when it
    is not a regular file or too large.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block the open
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            raise ValueError(f"{kind}; expected a regular file")
        if info.st_size > max_bytes:
            raise ValueError(f"file is {info.st_size} bytes; at most {max_bytes}")
        data = _read_bounded(fd, max_bytes)
    finally:
        os.close(fd)
    if data is None:
        raise ValueError(f"file grew past {max_bytes} bytes while being read")
    return data


def fsync_dir(path: str | Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
