"""The run directory (DESIGN section 5): where each file of a run lives, and the two
workspace operations done before every attempt (empty it; place upstream inputs)."""

from __future__ import annotations

import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from .errors import UsageError
from .files import READ_ONLY, within

RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_run_id(run_id: str) -> str:
    if not RUN_ID.match(run_id):
        raise UsageError(f"--run-id {run_id!r}: use 1-128 of [A-Za-z0-9_.-], starting with a "
                         "letter or digit")
    return run_id


@dataclass(frozen=True)
class RunLayout:
    root: Path

    @property
    def plan_json(self) -> Path:
        return self.root / "plan.json"

    @property
    def ledger(self) -> Path:
        return self.root / "ledger.jsonl"

    @property
    def state(self) -> Path:
        return self.root / "state.json"

    def node_dir(self, node: str) -> Path:
        return self.root / "nodes" / node

    def prompt_rendered(self, node: str) -> Path:
        return self.node_dir(node) / "prompt.rendered.md"

    def workspace(self, node: str) -> Path:
        return self.node_dir(node) / "workspace"

    def attempt_dir(self, node: str, attempt: int) -> Path:
        return self.node_dir(node) / "attempts" / str(attempt)

    def reset_workspace(self, node: str) -> Path:
        """Empty the workspace: a retry must not resume the broken state it left."""
        ws = self.workspace(node)
        try:
            with os.scandir(ws) as entries:
                empty = next(entries, None) is None
        except FileNotFoundError:
            ws.mkdir(parents=True)
            return ws
        if not empty:  # creating directories is slow on some file systems: skip if clean
            shutil.rmtree(ws, onerror=_make_writable_and_retry)
            ws.mkdir()
        return ws

    def place_inputs(self, node: str, upstream: dict[str, list[str]]) -> list[str]:
        """Copy each upstream node's declared artifacts, read-only, to
        ``workspace/inputs/<upstream>/<path>``; return the relative paths placed."""
        ws = self.workspace(node)
        placed = []
        for up, paths in upstream.items():
            for rel in paths:
                src = within(self.workspace(up), rel)
                if src is None or not os.path.isfile(src):
                    continue  # optional and absent, or refused by the upstream contract
                dst = ws / "inputs" / up / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)
                os.chmod(dst, READ_ONLY)
                placed.append(f"inputs/{up}/{rel}")
        return placed


def _make_writable_and_retry(func: object, path: str, exc_info: object) -> None:
    """Inputs are read-only (and an agent may chmod things): make writable, retry once."""
    parent = os.path.dirname(path)
    os.chmod(parent, os.stat(parent).st_mode | stat.S_IWUSR | stat.S_IXUSR)
    if os.path.isdir(path) and not os.path.islink(path):
        os.chmod(path, stat.S_IRWXU)
        shutil.rmtree(path, onerror=_make_writable_and_retry)
    else:
        os.unlink(path)
