"""Fenced file blocks of an http reply: parsing, names, and writing inside the workspace."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime.agents.http_files import (
    MAX_FILES,
    Parsed,
    name_problem,
    parse,
    write_blocks,
    write_inside,
)


def test_blocks_are_found_in_order_with_their_text() -> None:
    reply = ("Intro.\n```json file=a.json\n{}\n```\nmid\n```python\nx = 1\n```\n"
             "```md title file=dir/b.md extra\nline 1\n\nline 3\n```   \nend\n")
    parsed = parse(reply)
    assert [(b.path, b.text, b.line) for b in parsed.blocks] == [
        ("a.json", "{}\n", 2), ("dir/b.md", "line 1\n\nline 3\n", 9)]
    assert parsed.unclosed is None


def test_a_longer_fence_holds_shorter_ones() -> None:
    reply = "````md file=doc.md\n# T\n```sh\nls\n```\n````\n"
    assert [b.text for b in parse(reply).blocks] == ["# T\n```sh\nls\n```\n"]


def test_other_fences_are_prose_even_unclosed_or_stray() -> None:
    reply = ("```md file=R.md\n# x\n```bash\nls\n```\n```\n"  # nested: R.md is cut
             "```json file=findings.json\n{}\n```\n```python\nnever closed\n")
    parsed = parse(reply)
    assert [(b.path, b.text) for b in parsed.blocks] == [
        ("R.md", "# x\n```bash\nls\n"), ("findings.json", "{}\n")]


def test_an_unclosed_wide_block_leaves_narrower_ones_after_it() -> None:
    parsed = parse("````md file=a.md\nx\n```txt file=b.txt\ny\n```\n")
    assert [b.path for b in parsed.blocks] == ["b.txt"]
    assert parsed.unclosed is not None
    assert parsed.unclosed.path == "a.md"


def test_a_fence_wider_than_ten_backticks_opens_nothing() -> None:
    assert parse("`" * 11 + "txt file=a\nx\n" + "`" * 11 + "\n").blocks == []


def test_crlf_replies_close_their_blocks() -> None:
    assert [b.path for b in parse("```json file=a.json\r\n{}\r\n```\r\n").blocks] == ["a.json"]


def test_an_unclosed_block_is_reported_not_written() -> None:
    parsed = parse("```json file=a.json\n{}\n```\n```json file=b.json\n{\"cut\n")
    assert [b.path for b in parsed.blocks] == ["a.json"]
    assert parsed.unclosed is not None
    assert parsed.unclosed.path == "b.json"


@pytest.mark.parametrize("reply", [
    "```json file=a.json\n" * 30_000,
    "".join("`" * (10 - i % 8) + f"txt file=f{i}\n" for i in range(30_000)),
])
def test_many_unclosed_fences_parse_in_bounded_passes(reply: str) -> None:
    # Issue 8: 480 KB of these took 100 s with the old regex (timing: benchmarks/).
    parsed = parse(reply)
    assert parsed.blocks == []
    assert parsed.unclosed is not None
    assert parsed.unclosed.line == 1


def test_blocks_past_the_cap_are_counted_not_kept() -> None:
    reply = "".join(f"```txt file=f{i}.txt\n{i}\n```\n" for i in range(MAX_FILES + 5))
    parsed = parse(reply)
    assert len(parsed.blocks) == MAX_FILES
    assert parsed.total == MAX_FILES + 5


@pytest.mark.parametrize(("path", "problem"), [
    ("a\ud800.json", "lone surrogate"),
    ("a\x07.json", "control or format characters"),
    ("a\u202e.json", "control or format characters"),
    ("../escape.md", "'..' escapes the root"),
    ("/etc/passwd", "absolute paths are not allowed"),
    ("a\\b", "backslashes"),
    ("a/", "no trailing '/'"),
    ("a//b", "no empty or '.' parts"),
    ("./a", "no empty or '.' parts"),
    ("x" * 300, "longer than 255 bytes"),
    ("/".join(["d"] * 40), "too long"),
    ("/".join(["d" * 200] * 6), "too long"),
    ("inputs/up/a.json", "'inputs' is reserved"),
    ("reply.md", "'reply.md' is reserved"),
])
def test_names_that_cannot_be_written(path: str, problem: str) -> None:
    why = name_problem(path)
    assert why is not None
    assert problem in why


@pytest.mark.parametrize("path", ["a.json", "dir/sub/b.md", "é.txt", "x" * 255])
def test_names_that_can(path: str) -> None:
    assert name_problem(path) is None


def _blocks(*pairs: tuple[str, str]) -> Parsed:
    return parse("".join(f"```txt file={p}\n{t}\n```\n" for p, t in pairs))


def test_a_file_then_the_same_name_as_a_directory(tmp_path: Path) -> None:
    problems = write_blocks(tmp_path, _blocks(("a", "1"), ("a/", "2"), ("a/b", "3")))
    assert (tmp_path / "a").read_text() == "1\n"
    assert len(problems) == 2
    assert "file='a/' (line 4): must name a file" in problems[0]
    assert problems[1] == "file='a/b' (line 7): 'a' is not a directory"


def test_a_directory_then_the_same_name_as_a_file(tmp_path: Path) -> None:
    problems = write_blocks(tmp_path, _blocks(("d/x", "1"), ("d", "2")))
    assert problems == ["file='d' (line 4): is a directory"]


def test_a_lone_surrogate_in_the_text_is_a_problem(tmp_path: Path) -> None:
    problems = write_blocks(tmp_path, _blocks(("a.txt", "bad \ud800 text"), ("b.txt", "ok")))
    assert problems == ["file='a.txt' (line 1): its text holds a lone surrogate, which is "
                        "not valid Unicode"]
    assert not (tmp_path / "a.txt").exists()
    assert (tmp_path / "b.txt").exists()


def test_too_many_blocks_is_a_problem(tmp_path: Path) -> None:
    reply = "".join(f"```txt file=f{i}.txt\n{i}\n```\n" for i in range(MAX_FILES + 1))
    problems = write_blocks(tmp_path, parse(reply))
    assert problems == [f"the reply has {MAX_FILES + 1} file blocks; only the first "
                        f"{MAX_FILES} are written"]
    assert len(list(tmp_path.iterdir())) == MAX_FILES


def test_symlinked_directories_are_not_followed(tmp_path: Path) -> None:
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    ws.mkdir()
    outside.mkdir()
    (ws / "link").symlink_to(outside)
    assert write_inside(ws, "link/x.json", b"{}") == \
        "'link' is a symbolic link, which is not followed"
    assert list(outside.iterdir()) == []


def test_symlinks_and_hard_links_at_the_name_are_replaced_not_written_through(
        tmp_path: Path) -> None:
    ws, victim = tmp_path / "ws", tmp_path / "victim.txt"
    ws.mkdir()
    victim.write_text("original")
    (ws / "sym.txt").symlink_to(victim)
    os.link(victim, ws / "hard.txt")
    os.mkfifo(ws / "fifo.txt")
    for name in ("sym.txt", "hard.txt", "fifo.txt"):
        assert write_inside(ws, name, b"new") is None
        assert (ws / name).read_bytes() == b"new"
        assert not (ws / name).is_symlink()
    assert victim.read_text() == "original"


def test_a_missing_workspace_is_a_problem_not_an_exception(tmp_path: Path) -> None:
    assert write_inside(tmp_path / "missing", "a.txt", b"x") == \
        "the workspace cannot be opened: No such file or directory"
