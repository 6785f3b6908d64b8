"""The run directory (DESIGN section 5).

Where each file of a run lives, and the two workspace operations done before every attempt
(empty it; place upstream inputs).
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from runtime.digest import blake3_hex
from runtime.errors import UsageError
from runtime.files import open_no_follow, read_capped, write_read_only

RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
ATTEMPT_NAME = re.compile(r"^[0-9]{1,9}\Z")
INPUT_MAX_BYTES = 1 << 30


def check_run_id(run_id: str, flag: str = "--run-id") -> str:
    """Return ``run_id`` when it is a safe directory name; a usage error naming it otherwise."""
    if not RUN_ID.match(run_id):
        raise UsageError(f"{flag} {run_id!r}: use 1-128 of [A-Za-z0-9_.-], starting with a "
                         "letter or digit")
    return run_id


@dataclass(frozen=True)
class RunLayout:
    """Where each file of the run at ``root`` lives (DESIGN section 5)."""
    root: Path
    # node -> its directory: a run asks for each node's paths a dozen times per attempt,
    # and building a Path is a noticeable share of a short attempt's cost.
    _node_dirs: dict[str, Path] = field(default_factory=dict, init=False, repr=False,
                                        compare=False)
    _absolute: list[RunLayout] = field(default_factory=list, init=False, repr=False,
                                       compare=False)

    def absolute(self) -> RunLayout:
        """This layout with an absolute root, for the paths agents are given; built once.

        ``Path.absolute`` re-parses the whole path each time: three calls cost a tenth of
        a short attempt's preparation.
        """
        if self.root.is_absolute():
            return self
        if not self._absolute:
            self._absolute.append(RunLayout(self.root.absolute()))
        return self._absolute[0]

    @property
    def plan_json(self) -> Path:
        """The sealed plan the run executes."""
        return self.root / "plan.json"

    @property
    def ledger(self) -> Path:
        """The append-only event log, the run's source of truth."""
        return self.root / "ledger.jsonl"

    @property
    def operator_prompt(self) -> Path:
        """``--operator-prompt`` text of the run (the ledger holds only its digest)."""
        return self.root / "operator-prompt.md"

    @property
    def state(self) -> Path:
        """The state folded from the ledger, rewritten as the run goes (a cache, not the truth)."""
        return self.root / "state.json"

    @property
    def leaders(self) -> Path:
        """The log of every started agent's leader, for killing leftovers after a crash.

        Every started agent's leader (pid, start time, boot): a resume after a crash kills
        what is left of them (``agents/procs.py``).
        """
        return self.root / "leaders.jsonl"

    def node_dir(self, node: str) -> Path:
        """Everything of one node."""
        found = self._node_dirs.get(node)
        if found is None:
            found = self._node_dirs[node] = self.root / "nodes" / node
        return found

    def prompt_rendered(self, node: str) -> Path:
        """The node's prompt as planned, before any retry preamble."""
        return self.node_dir(node) / "prompt.rendered.md"

    def workspace(self, node: str) -> Path:
        """The node's working directory, emptied before each attempt."""
        return self.node_dir(node) / "workspace"

    def attempt_dir(self, node: str, attempt: int) -> Path:
        """One attempt's records: ``attempt.json``, the prompt it was given, its logs."""
        return self.node_dir(node) / "attempts" / str(attempt)

    def claim_attempt(self, node: str, at_least: int) -> int:
        """Create the next attempt directory and return its number.

        At least ``at_least``, above every number already on disk. A crash can leave a
        directory whose ``attempt.started`` never reached the ledger; numbers never repeat.
        Only names of ASCII digits count (an agent may have created ``²`` or ``1e9``).
        """
        root = self.node_dir(node) / "attempts"
        root.mkdir(parents=True, exist_ok=True)  # an agent may have removed it
        with os.scandir(root) as entries:
            on_disk = [int(e.name) for e in entries if ATTEMPT_NAME.match(e.name)]
        number = max([at_least - 1, *on_disk]) + 1
        while True:
            try:
                os.mkdir(root / str(number))
                return number
            except FileExistsError:
                number += 1

    def reset_workspace(self, node: str) -> Path:
        """Empty the workspace.

        A retry must not resume the broken state it left. Works on any tree an agent can
        leave: deep nesting, read-only directories, symlinks (never followed), FIFOs.
        """
        ws = self.workspace(node)
        if os.path.islink(ws) or (os.path.lexists(ws) and not os.path.isdir(ws)):
            os.unlink(ws)
        try:
            with os.scandir(ws) as entries:
                empty = next(entries, None) is None
        except FileNotFoundError:
            ws.mkdir(parents=True)
            return ws
        if not empty:  # creating directories is slow on some file systems: skip if clean
            remove_tree(ws)
            ws.mkdir()
        return ws

    def place_inputs(self, node: str, upstream: Mapping[str, Mapping[str, str]]) -> list[str]:
        """Copy each upstream's accepted artifacts into the workspace, re-checking their digests.

        Copy each upstream node's accepted artifacts, read-only, to
        ``workspace/inputs/<upstream>/<path>``, each re-hashed against the digest recorded
        when the upstream succeeded (an empty digest: recorded by an older runtime, copied
        unchecked); return the relative paths placed.

        Raises:
            InputMismatch: an artifact is gone or no longer hashes to its record.
        """
        ws = self.workspace(node)
        placed = []
        for up, accepted in upstream.items():
            for rel, digest in sorted(accepted.items()):
                src = self.workspace(up) / rel
                if not digest and not os.path.lexists(src):
                    continue  # unrecorded (older run) and optional: nothing to place
                try:
                    data = read_capped(src, INPUT_MAX_BYTES) if _no_links(self.workspace(up),
                                                                         rel) else None
                except OSError:
                    data = None
                if data is None:
                    raise InputMismatch(f"input {up}/{rel}: the accepted artifact is gone or "
                                        "replaced by a link or special file")
                actual = blake3_hex(data)
                if digest and actual != digest:
                    raise InputMismatch(f"input {up}/{rel}: hashes to {actual}, accepted as "
                                        f"{digest}: changed after {up} succeeded")
                dst = ws / "inputs" / up / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                write_read_only(dst, data)  # a copy, never a link
                placed.append(f"inputs/{up}/{rel}")
        return placed

    def artifact_digests(self, node: str, paths: list[str]) -> tuple[dict[str, str], str]:
        """blake3 of each present declared artifact, read without following links.

        A problem when one is a link, a special file or hard-linked from elsewhere.
        """
        ws = self.workspace(node)
        out: dict[str, str] = {}
        for rel in paths:
            if not os.path.lexists(ws / rel):
                continue  # optional and absent: the contract already decided
            if not _no_links(ws, rel):
                return {}, f"{rel}: a symlink; artifacts must be regular files"
            try:
                fd = open_no_follow(ws / rel)
            except OSError as exc:
                return {}, f"{rel}: {exc.strerror or exc}"
            try:
                if os.fstat(fd).st_nlink > 1:
                    return {}, (f"{rel}: hard-linked ({os.fstat(fd).st_nlink} links); an "
                                "artifact must be a file the agent wrote")
            finally:
                os.close(fd)
            out[rel] = blake3_hex(read_capped(ws / rel, INPUT_MAX_BYTES))
        return out, ""


class InputMismatch(Exception):
    """An upstream artifact no longer matches what was accepted."""


def _no_links(root: Path, rel: str) -> bool:
    """No component of ``root/rel`` below ``root`` is a symlink."""
    path = root
    for part in Path(rel).parts:
        path = path / part
        if os.path.islink(path):
            return False
    return True


def remove_tree(root: Path) -> None:
    """Delete ``root`` and everything below it, safely against any tree an agent can leave.

    Iterative (an agent can nest deeper than Python's recursion limit), never following a
    symlink, making read-only directories writable as it goes.
    """
    stack = [str(root)]
    while stack:
        top = stack[-1]
        with contextlib.suppress(OSError):
            os.chmod(top, stat.S_IRWXU)
        pushed = False
        with os.scandir(top) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                    pushed = True
                else:
                    os.unlink(entry.path)
        if not pushed:
            os.rmdir(top)
            stack.pop()
