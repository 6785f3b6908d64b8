from __future__ import annotations

import pytest

from runtime import yamlsafe
from runtime.yamlsafe import load_yaml

BOMB = b"""\
a: &a ["x","x","x","x","x","x","x","x","x"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


def test_alias_bomb_is_refused_before_expansion() -> None:
    loaded, problems = load_yaml(BOMB, "bomb.yaml")
    assert loaded is None
    assert len(problems) == 1
    assert "alias bomb" in problems[0].message
    assert problems[0].file == "bomb.yaml"


def test_small_aliases_are_fine() -> None:
    loaded, problems = load_yaml(b"base: &b {x: 1}\nother: *b\n", "f.yaml")
    assert problems == []
    assert loaded is not None and loaded.data == {"base": {"x": 1}, "other": {"x": 1}}


def test_recursive_alias_is_refused() -> None:
    loaded, problems = load_yaml(b"a: &a [1, *a]\n", "f.yaml")
    assert loaded is None
    assert "recursive YAML alias" in problems[0].message


def test_duplicate_keys_are_problems_with_lines() -> None:
    _, problems = load_yaml(b"name: a\nnodes: []\nname: b\n", "f.yaml")
    assert [(p.line, p.where) for p in problems] == [(3, "name")]
    assert "duplicate key" in problems[0].message


def test_non_utf8_names_offset_and_line() -> None:
    _, problems = load_yaml(b"name: ok\ndesc: \xff\xfe\n", "f.yaml")
    assert problems[0].line == 2
    assert "not UTF-8" in problems[0].message and "offset 15" in problems[0].message


def test_oversized_file_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(yamlsafe, "MAX_BYTES", 10)
    _, problems = load_yaml(b"name: abcdefghijk\n", "f.yaml")
    assert "at most 10" in problems[0].message


def test_syntax_error_has_line() -> None:
    _, problems = load_yaml(b"a: 1\nb: [1, 2\nc: 3\n", "f.yaml")
    assert problems[0].line >= 2
    assert problems[0].message.startswith("invalid YAML")


def test_unsafe_tags_are_not_constructed() -> None:
    _, problems = load_yaml(b"a: !!python/object/apply:os.system ['true']\n", "f.yaml")
    assert problems and "invalid YAML" in problems[0].message


def test_line_of_finds_nested_fields() -> None:
    loaded, _ = load_yaml(b"nodes:\n  - id: a\n    needs:\n      - b\n", "f.yaml")
    assert loaded is not None
    assert loaded.line_of(("nodes", 0, "needs", 0)) == 4
    assert loaded.line_of(("nodes", 0, "missing")) == 2


PAD = "".join(f"  - {{id: n{i:06d}, prompt: t.md.j2, needs: [n{i - 1:06d}], objective: check "
              f"n{i:06d}, weight: {i}.5}}\n" for i in range(1, 20))


@pytest.fixture
def fast_path_always(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(yamlsafe, "FAST_PATH_MIN_BYTES", 0)

SNIPPETS = [
    "plain: value", "quoted: 'it''s'", 'dq: "a \\" b"', "num: 12", "neg: -3", "float: 1.25",
    "t: true", "f: false", "n: null", "e:", "yes_word: yes", "cap: True", "tilde: ~",
    "oct: 012", "hex: 0x1f", "exp: 1e3", "under: 1_000", "plus: +3", "dot: .5",
    "inf: .inf", "sexa: 1:30", "date: 2024-01-02", "block: |\n  a\n  b", "folded: >\n  a\n  b",
    "anchor: &a {x: 1}\nalias: *a", "tag: !!str 123", "ctrl: \"\\x07\"", "uni: ünï €",
    "url: http://x.y/z?a=b#frag", "colon: 'a: b'", "list: [1, 'two', three]",
    "multi: first\n  second line", "key with spaces: v", "'quoted key': v",
    "exp2: 1.5e3", "clock: 12:30:00", "flow: {a: 1e3, b: [yes, 0x1f]}", "nospace: a:1e3",
    "stamp: 2001-12-14 21:59:43.10 -5", "neg_float: -0.5", "big: 123456789012345678901234567890",
]


@pytest.mark.usefixtures("fast_path_always")
@pytest.mark.parametrize("snippet", SNIPPETS)
def test_fast_path_agrees_with_pyyaml(snippet: str) -> None:
    """On large files rapidyaml may be used; the values must be PyYAML's, always."""
    import yaml

    text = f"{snippet}\nnodes:\n{PAD}"
    loaded, problems = load_yaml(text.encode(), "big.yaml")
    assert problems == [] and loaded is not None
    assert loaded.data == yaml.load(text, Loader=yaml.SafeLoader)


def test_fast_path_is_taken_for_plain_files() -> None:
    raw = f"name: x\nnodes:\n{PAD}".encode()
    assert yamlsafe._plain_enough(raw)
    assert yamlsafe._fast_load(raw) is not yamlsafe._FALLBACK


@pytest.mark.usefixtures("fast_path_always")
def test_fast_path_duplicate_keys_fall_back_and_are_reported() -> None:
    raw = f"name: x\nname: y\nnodes:\n{PAD}".encode()
    loaded, problems = load_yaml(raw, "big.yaml")
    assert loaded is None and [(p.line, p.where) for p in problems] == [(2, "name")]


@pytest.mark.usefixtures("fast_path_always")
def test_fast_path_lines_are_looked_up_lazily() -> None:
    loaded, _ = load_yaml(f"name: x\nnodes:\n{PAD}".encode(), "big.yaml")
    assert loaded is not None
    assert loaded.line_of(("nodes", 2, "needs")) == 5
