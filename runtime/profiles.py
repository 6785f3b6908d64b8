"""Agent profiles: how a node's agent is invoked. Frozen into the plan, never re-read.

A profile is a discriminated union on ``kind``. The built-in profile ``simulated`` is
always available, so ``--agent simulated`` runs any plan offline.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class _Profile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    timeout_s: float | None = Field(
        default=None, gt=0, description="Default per-attempt timeout for nodes on this profile."
    )


class CommandProfile(_Profile):
    """Run a subprocess. ``argv`` may use ``{prompt_file}``, ``{workspace}``, ``{node}``."""

    kind: Literal["command"]
    argv: list[str] = Field(min_length=1, description="Program and arguments.")
    prompt_via: Literal["stdin", "file"] = Field(
        default="stdin", description="Send the prompt on stdin, or only as {prompt_file}."
    )
    env: list[str] = Field(
        default_factory=list,
        description="Environment variable names passed through to the agent, beyond the "
        "allow-list (PATH, HOME, LANG, LC_*, TMPDIR, TERM) and RUNTIME_*.",
    )
    error_file: str | None = Field(
        default=None,
        description="Workspace-relative file whose presence after exit 0 means the agent "
        "reported a terminal error (contradictory_completion).",
    )
    result_json: bool = Field(
        default=False,
        description="stdout is a JSON result; exit 0 with is_error/error set is "
        "contradictory_completion (claude -p --output-format json style).",
    )

    @field_validator("env")
    @classmethod
    def _env_names(cls, names: list[str]) -> list[str]:
        bad = [n for n in names if not ENV_NAME.match(n)]
        if bad:
            raise ValueError(f"not environment variable names: {bad}")
        return names


class HttpProfile(_Profile):
    """An OpenAI-compatible chat-completions endpoint."""

    kind: Literal["http"]
    base_url: str = Field(description="Endpoint base URL, e.g. http://127.0.0.1:8000/v1")
    model: str
    api_key_env: str | None = Field(
        default=None, description="Name of the environment variable holding the API key."
    )
    max_retries: int = Field(default=3, ge=0, le=10, description="Retries on 429 and 5xx.")


class PythonProfile(_Profile):
    """A Python callable ``module:function`` (for tests and in-process agents)."""

    kind: Literal["python"]
    target: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class SimulatedMistake(BaseModel):
    """A deterministic mistake the simulated agent makes on a node."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["wrong_name", "exit_nonzero", "invalid_json", "invalid_sarif",
                  "report_error", "hang"] = Field(
        description="wrong_name: write the first artifact under a wrong name; exit_nonzero: "
        "exit 1; invalid_json: write broken JSON; invalid_sarif: write SARIF that parses "
        "but breaks the SARIF 2.1.0 schema; report_error: exit 0 but report an error; "
        "hang: sleep past the timeout."
    )
    attempts: list[int] | None = Field(
        default=None, description="Attempts on which to make it; default every attempt."
    )
    unless_feedback: bool = Field(
        default=False,
        description="Do not make the mistake when the prompt carries a retry preamble "
        "naming the prior failure (models an agent that learns from feedback).",
    )


class SimulatedProfile(_Profile):
    """Deterministic offline agent: writes each declared artifact from the prompt."""

    kind: Literal["simulated"]
    mistakes: dict[str, SimulatedMistake] = Field(
        default_factory=dict, description="Per node id: a scripted mistake."
    )


AgentProfile = Annotated[
    CommandProfile | HttpProfile | PythonProfile | SimulatedProfile,
    Field(discriminator="kind"),
]

BUILTIN_PROFILES: dict[str, CommandProfile | HttpProfile | PythonProfile | SimulatedProfile] = {
    "simulated": SimulatedProfile(kind="simulated"),
}
