"""Files a model writes by reply: fenced blocks whose info string says ``file=<path>``.

Everything here is model-authored, so it is parsed in one pass over the lines (issue 8:
a regex took 100 s on 480 KB of unclosed fences), capped in count and name length, and
written without following any symlink or hard link already in the workspace. Whatever
cannot be written comes back as a problem naming the block, never as an exception.

A block opened by N backticks (3 to 10) closes at the first line of at least N backticks
and nothing else, as in CommonMark, so a Markdown file that holds ``` blocks can be sent
inside a ```` block.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

from runtime.plan.topology import check_relative_path

MAX_FILES = 256
MAX_NAME_BYTES = 1024  # a whole path, UTF-8
MAX_PART_BYTES = 255  # one path component: Linux NAME_MAX
MAX_DEPTH = 32
# inputs/ holds the read-only copies of upstream artifacts; reply.md is the whole reply.
RESERVED = ("inputs", "reply.md")

MAX_FENCE = 10  # backticks in an opening fence
_OPENER = re.compile(r"(`{3,10})(?!`)([^`\n]*)\Z")  # 10: MAX_FENCE
_FILE = re.compile(r"\bfile=([^\s`]+)")


@dataclass(frozen=True)
class Block:
    """One fenced block that names a file."""

    path: str
    text: str
    line: int  # 1-based line of the opening fence


@dataclass
class Parsed:
    """The file blocks of one reply, in order, at most ``MAX_FILES``."""

    blocks: list[Block] = field(default_factory=list)
    total: int = 0  # file blocks seen, including those past the cap
    unclosed: Block | None = None  # the first file block never closed (its text unkept)


def parse(reply: str) -> Parsed:
    """Every closed ``file=`` block of ``reply``, in a bounded number of passes over its lines.

    Other fences are prose: a stray or unclosed ```python cannot hide the file blocks after
    it.
    """
    parsed = Parsed()
    lines = reply.split("\n")
    # Openers at least this wide are known to have no closer below them: skipped at once,
    # so each of the at most 8 widths scans to the end at most once.
    unclosed_width = MAX_FENCE + 1
    i = 0
    while i < len(lines):
        opener = _OPENER.match(lines[i].rstrip("\r"))
        named = _FILE.search(opener.group(2)) if opener is not None else None
        if opener is None or named is None:
            i += 1
            continue
        width = len(opener.group(1))
        end = len(lines) if width >= unclosed_width else _closing(lines, i + 1, width)
        if end == len(lines):
            unclosed_width = min(unclosed_width, width)
            if parsed.unclosed is None:
                parsed.unclosed = Block(named.group(1), "", i + 1)
            i += 1
            continue
        parsed.total += 1
        if len(parsed.blocks) < MAX_FILES:
            parsed.blocks.append(Block(named.group(1), "\n".join(lines[i + 1:end]) + "\n",
                                       i + 1))
        i = end + 1
    return parsed


def _closing(lines: list[str], start: int, width: int) -> int:
    """Index of the line closing a fence of ``width`` backticks, or ``len(lines)``."""
    for j in range(start, len(lines)):
        bare = lines[j].rstrip(" \t\r")
        if len(bare) >= width and bare.count("`") == len(bare):
            return j
    return len(lines)


def name_problem(path: str) -> str | None:
    """Why ``path`` cannot name a file the agent writes, or None."""
    try:
        encoded = path.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid Unicode (it holds a lone surrogate)"
    if any(unicodedata.category(c) in ("Cc", "Cf") for c in path):
        return "holds control or format characters"
    try:
        check_relative_path(path)
    except ValueError as exc:
        return str(exc).replace(repr(path) + ": ", "")
    parts = path.split("/")
    if any(p in ("", ".") for p in parts):
        return "must name a file: no empty or '.' parts, no trailing '/'"
    if len(encoded) > MAX_NAME_BYTES or len(parts) > MAX_DEPTH:
        return f"is too long (at most {MAX_NAME_BYTES} bytes in {MAX_DEPTH} parts)"
    if any(len(p.encode("utf-8")) > MAX_PART_BYTES for p in parts):
        return f"has a part longer than {MAX_PART_BYTES} bytes"
    if parts[0] in RESERVED:
        return f"{parts[0]!r} is reserved (upstream inputs and the reply itself)"
    return None


def show(path: str, limit: int = 80) -> str:
    """A model-authored name for a message: ASCII, quoted, bounded."""
    text = ascii(path)
    return text if len(text) <= limit else text[: limit - 5] + "...'"


def write_blocks(workspace: Path, parsed: Parsed) -> list[str]:
    """Write each valid block; return one problem per block that was not written."""
    problems: list[str] = []
    for block in parsed.blocks:
        where = f"file={show(block.path)} (line {block.line})"
        why = name_problem(block.path)
        if why is None:
            try:
                data = block.text.encode("utf-8")
            except UnicodeEncodeError:
                why = "its text holds a lone surrogate, which is not valid Unicode"
        if why is None:
            why = write_inside(workspace, block.path, data)
        if why is not None:
            problems.append(f"{where}: {why}")
    if parsed.total > len(parsed.blocks):
        problems.append(f"the reply has {parsed.total} file blocks; only the first "
                        f"{MAX_FILES} are written")
    return problems


_REASONS = {errno.ELOOP: "is a symbolic link, which is not followed",
            errno.ENOTDIR: "is not a directory", errno.EISDIR: "is a directory",
            errno.EEXIST: "already exists"}


def write_inside(root: Path, rel: str, data: bytes) -> str | None:
    """Create ``root/rel`` anew, never following a symlink or writing through an existing inode.

    Create ``root/rel`` anew (replacing a file there) without following a symlink at any
    level and without writing through an existing inode; None, or why it failed.
    """
    parts = rel.split("/")
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    try:
        fd = os.open(root, flags)
    except OSError as exc:
        return f"the workspace cannot be opened: {exc.strerror}"
    try:
        for depth, name in enumerate(parts[:-1], 1):
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o755, dir_fd=fd)
            try:
                inner = os.open(name, flags | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                return f"{show('/'.join(parts[:depth]))} {_reason(exc, name, fd)}"
            os.close(fd)
            fd = inner
        # A fresh inode: an existing hard link or a FIFO there is replaced, not written.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(parts[-1], dir_fd=fd)
        out = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                      | os.O_CLOEXEC, 0o644, dir_fd=fd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(out, view):]
        finally:
            os.close(out)
    except OSError as exc:
        return _reason(exc)
    finally:
        os.close(fd)
    return None


def _reason(exc: OSError, name: str | None = None, dir_fd: int | None = None) -> str:
    if name is not None and exc.errno in (errno.ENOTDIR, errno.ELOOP):
        # Linux says ENOTDIR for O_DIRECTORY | O_NOFOLLOW on a symlink: say which.
        with contextlib.suppress(OSError):
            if stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                return _REASONS[errno.ELOOP]
    return _REASONS.get(exc.errno or 0, f"cannot be written: {exc.strerror}")
