"""The exception tree. Every error the runtime raises on purpose derives from one root.

    DagRuntimeError                 root; never raised itself
    ├── InputError                  the user's input is wrong: CLI exit status 2
    │   ├── TopologyError           a topology file with one or more Problems
    │   ├── TemplateError           a prompt template that cannot be planned
    │   ├── PlanFormatError         a plan directory or golden file that cannot be read
    │   ├── UsageError              a CLI argument that names nothing usable
    │   └── InUseError              a run or batch another live process is writing
    └── ExecutionError              a run could not go on: CLI exit status 1
        ├── PlanIntegrityError      a plan or run directory that does not verify
        ├── LedgerError             a run directory whose ledger cannot be folded
        ├── RecordError             a run record (attempt.json) that cannot be read
        └── FatalRunError           the run cannot record anything (disk full, I/O
                                    error): agents stopped, resumable once fixed

Errors carry their context as attributes (file, node, template, line) so callers can
act on them; ``str(err)`` is the complete human message. Library errors (yaml, jinja2,
pydantic) are translated at the boundary where they are raised.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class DagRuntimeError(Exception):
    """Root of every error the runtime raises on purpose."""


class InputError(DagRuntimeError):
    """The input is invalid; nothing was written. CLI exit status 2."""


@dataclass(frozen=True, order=True)
class Problem:
    """One validation problem, located as precisely as the input allows.

    Attributes:
        file: the file the problem is in (as given by the user).
        line: 1-based line in that file, or 0 when no line applies.
        where: dotted location of the field (``nodes[2].needs``) or a node id.
        message: what is wrong and what would be accepted.
    """

    file: str
    line: int
    where: str
    message: str

    def __str__(self) -> str:
        """``file:line: where: message``, as editors and CI logs link it."""
        loc = f"{self.file}:{self.line}" if self.line else self.file
        where = f" {self.where}:" if self.where else ""
        return f"{loc}:{where} {self.message}"


class TopologyError(InputError):
    """A topology has problems; all of them are listed, sorted, in one error."""

    def __init__(self, path: str | Path, problems: list[Problem]) -> None:
        self.path = str(path)
        self.problems = sorted(set(problems))
        count = len(self.problems)
        head = f"{self.path}: {count} problem{'s' if count != 1 else ''}"
        super().__init__("\n".join([head, *(f"  {p}" for p in self.problems)]))


class TemplateError(InputError):
    """A prompt template names something outside the allow-list, or fails to render."""

    # PLR0913: the context an error carries; all but the first three keyword-only.
    def __init__(  # noqa: PLR0913
        self,
        template: str,
        line: int,
        message: str,
        *,
        node: str | None = None,
        name: str | None = None,
        root: str = "prompts",
    ) -> None:
        self.template = template
        self.line = line
        self.bare = message
        self.node = node
        self.name = name
        self.root = root
        who = f" (node {node})" if node else ""
        super().__init__(f"{root}/{template}:{line}{who}: {message}")

    def under(self, root: str) -> TemplateError:
        """The same error, with its template named under ``root`` (the prompts root given)."""
        return TemplateError(self.template, self.line, self.bare, node=self.node,
                             name=self.name, root=root)


class PlanFormatError(InputError):
    """A plan directory, manifest or golden file that cannot be read as one."""

    def __init__(self, path: str | Path, message: str) -> None:
        self.path = str(path)
        super().__init__(f"{self.path}: {message}")


class UsageError(InputError):
    """A command-line argument that cannot be used as given."""


class ExecutionError(DagRuntimeError):
    """A run could not continue. CLI exit status 1."""


class PlanIntegrityError(ExecutionError):
    """A plan (or a run's copy of it) fails verification: it will not be run."""

    def __init__(self, path: str | Path, problems: list[str]) -> None:
        self.path = str(path)
        self.problems = problems
        super().__init__("\n".join([f"{self.path}: the plan does not verify; refusing to run",
                                    *(f"  {p}" for p in problems)]))


class LedgerError(ExecutionError):
    """A ledger that cannot be read or folded into a run state."""

    def __init__(self, path: str | Path, message: str) -> None:
        self.path = str(path)
        super().__init__(f"{self.path}: {message}")


class InUseError(InputError):
    """Another live process holds the run's (or batch's) lock: one writer per run."""

    def __init__(self, what: str, pid: int | None) -> None:
        self.what = what
        self.pid = pid
        holder = f"pid {pid}" if pid else "another process"
        super().__init__(f"{what} is in use by {holder}; wait for it to finish (or stop it) "
                         "and try again")


class RecordError(ExecutionError):
    """A run record that cannot be read (missing, not a regular file, too large, invalid)."""

    def __init__(self, path: str | Path, message: str) -> None:
        self.path = str(path)
        super().__init__(f"{self.path}: {message}")


class FatalRunError(ExecutionError):
    """The run can no longer write its records; it was stopped and stays resumable."""

    def __init__(self, path: str | Path, message: str) -> None:
        self.path = str(path)
        super().__init__(f"{self.path}: {message}; the run was stopped and can be resumed "
                         "with `runtime resume` once the cause is fixed")
