"""The ways the runtime writes files: in place through the creating descriptor, or replaced."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from runtime.files import create_read_only, rewrite_in_place

FIRST = b'{"attempt": 1}\n'
FINAL = b'{"attempt": 1, "outcome": "succeeded"}\n'


def test_a_record_is_rewritten_in_the_same_read_only_file(tmp_path: Path) -> None:
    path = tmp_path / "attempt.json"
    fd = create_read_only(path, FIRST)
    inode = path.stat().st_ino
    assert path.read_bytes() == FIRST
    rewrite_in_place(fd, path, FINAL)
    assert path.read_bytes() == FINAL
    assert path.stat().st_ino == inode  # no second file created
    assert stat.S_IMODE(path.stat().st_mode) == 0o444


def test_a_shorter_record_leaves_no_tail_of_the_longer_one(tmp_path: Path) -> None:
    path = tmp_path / "attempt.json"
    rewrite_in_place(create_read_only(path, FINAL), path, FIRST)
    assert path.read_bytes() == FIRST


def test_a_file_replaced_by_an_agent_is_replaced_again(tmp_path: Path) -> None:
    """An unsandboxed agent swapped the file: the path still ends with the runtime's record."""
    path = tmp_path / "attempt.json"
    fd = create_read_only(path, FIRST)
    forged = tmp_path / "forged"
    forged.write_bytes(b'{"outcome": "succeeded", "forged": true}\n')
    os.replace(forged, path)
    rewrite_in_place(fd, path, FINAL)
    assert path.read_bytes() == FINAL


def test_a_hard_link_made_by_an_agent_does_not_see_the_final_record(tmp_path: Path) -> None:
    """A link to the record would let its holder watch it: the path gets a new file."""
    path = tmp_path / "attempt.json"
    fd = create_read_only(path, FIRST)
    os.link(path, tmp_path / "kept")
    rewrite_in_place(fd, path, FINAL)
    assert path.read_bytes() == FINAL
    assert (tmp_path / "kept").read_bytes() == FIRST


def test_a_deleted_record_is_written_back(tmp_path: Path) -> None:
    path = tmp_path / "attempt.json"
    fd = create_read_only(path, FIRST)
    path.unlink()
    rewrite_in_place(fd, path, FINAL)
    assert path.read_bytes() == FINAL
