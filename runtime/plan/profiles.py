"""Agent profiles: how a node's agent is invoked. Frozen into the plan, never re-read.

A profile is a discriminated union on ``kind``. The built-in profile ``simulated`` is
always available, so ``--agent simulated`` runs any plan offline.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
)
from pydantic_core import PydanticCustomError

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
PLACEHOLDER = re.compile(r"\{(prompt_file|workspace|node)\}")
# Ray's own resources, requested through other task options (each attempt takes 1 CPU).
RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
RESOURCE_MIN = 0.0001  # Ray's resolution of a fractional quantity


def _resource_error(message: str) -> PydanticCustomError:
    # A custom error: the topology problem reads as the message alone, without
    # pydantic's "Value error, " prefix.
    return PydanticCustomError("profile_resources", message)


class _Profile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    timeout_s: float | None = Field(
        default=None, gt=0, description="Default per-attempt timeout for nodes on this profile."
    )
    resources: dict[str, float] | None = Field(
        default=None,
        description="--engine ray: Ray custom resources each attempt on this profile "
        "requests (e.g. {claude: 1}), so it runs only on workers started with them "
        "(`ray start --resources`) and no more run at once than the cluster has. Ignored "
        "by the local engine.")

    @field_validator("resources", mode="before")
    @classmethod
    def _resource_quantities(cls, value: object) -> object:
        """Checked here, not by Ray at submission: a bad quantity is a topology error."""
        if value is None:
            return None
        if not isinstance(value, dict) or not value:
            raise _resource_error("expected a non-empty mapping of resource name to "
                                  "quantity, e.g. {claude: 1}")
        for name, qty in value.items():
            if not isinstance(name, str) or not name.strip():
                raise _resource_error(f"resource name {name!r}: expected a non-empty string")
            if name in RAY_BUILTIN_RESOURCES:
                raise _resource_error(f"resource {name!r} is Ray's own; name a custom "
                                      f"resource (not {', '.join(RAY_BUILTIN_RESOURCES)})")
            if isinstance(qty, bool) or not isinstance(qty, (int, float)) \
                    or not math.isfinite(qty) or qty < RESOURCE_MIN:
                raise _resource_error(f"resource {name!r}: quantity {qty!r} must be a number "
                                      f"of at least {RESOURCE_MIN} (e.g. 1, or 0.5)")
        return value

    @model_serializer(mode="wrap")
    def _omit_unset_resources(self, handler: SerializerFunctionWrapHandler,
                              ) -> dict[str, object]:
        # Unset is left out of the topology and plan digests: a profile that does not use
        # resources digests as it did before the field existed.
        data: dict[str, object] = handler(self)
        if data.get("resources", 0) is None:
            del data["resources"]
        return data


class SandboxSettings(BaseModel):
    """How a ``command`` agent is contained (bubblewrap).

    The default ``{}`` sandboxes it with the network allowed; ``sandbox: false`` on the
    profile opts out.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    network: bool = Field(
        default=True, description="Allow network access (false: a new network namespace "
        "with only loopback).")
    writable: list[str] = Field(
        default_factory=list,
        description="Host paths the agent may write besides its workspace, absolute or "
        "~/-relative (state a CLI keeps, e.g. ~/.claude/). A trailing / marks a directory, "
        "created when missing; other paths that do not exist are skipped.")

    private: list[str] = Field(
        default_factory=list,
        description="Host paths the agent gets its own copy of for one attempt, discarded "
        "when it ends, absolute or ~/-relative (a CLI's state: ~/.claude/, ~/.claude.json). "
        "A directory (trailing /) starts empty and is created on the host when missing; a "
        "file starts as a copy of the host's (none when missing). Nothing an agent writes "
        "there (memory files, settings, hooks) reaches another attempt or the user's own "
        "CLI. A writable path inside one is the host's, and persists (a credentials file).")

    @field_validator("writable", "private")
    @classmethod
    def _host_paths(cls, paths: list[str], info: ValidationInfo) -> list[str]:
        bad = [p for p in paths if not (p.startswith("/") or p.startswith("~/"))
               or ".." in p.split("/") or "\0" in p or p.rstrip("/") in ("", "~")]
        if bad:
            raise ValueError(f"{info.field_name} paths must be absolute or start with ~/, "
                             f"without '..', and not / or ~ itself: {bad}")
        return paths


def _sandbox_problem(err: Any) -> str:
    where = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown key (accepted: network, writable, private)"
    return f"{where}: {err['msg'].removeprefix('Value error, ')}"


class CommandProfile(_Profile):
    """Run a subprocess. ``argv`` may use ``{prompt_file}``, ``{workspace}``, ``{node}``."""

    kind: Literal["command"]
    argv: list[str] = Field(min_length=1, description="Program and arguments.")
    preflight: list[str] | None = Field(
        default=None, min_length=1,
        description="A command that exits 0 when the agent can run (e.g. [claude, auth, "
        "status]); run by `runtime doctor` and before `run`/`batch`, its failure read like "
        "an attempt's. No placeholders.",
    )
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

    @field_validator("preflight")
    @classmethod
    def _no_placeholders(cls, argv: list[str] | None) -> list[str] | None:
        bad = [a for a in argv or [] if PLACEHOLDER.search(a)]
        if bad:
            raise ValueError(f"preflight runs before any node: no placeholders ({bad})")
        return argv

    sandbox: SandboxSettings | Literal[False] = Field(
        default_factory=SandboxSettings,
        description="Containment: {} (default) runs the agent under bubblewrap with the "
        "network allowed; {network: false, writable: [...]} tunes it; false opts out.")

    @field_validator("sandbox", mode="before")
    @classmethod
    def _sandbox_value(cls, value: object) -> object:
        """One clear message instead of one per member of the union."""
        if value is False or isinstance(value, SandboxSettings):
            return value
        if not isinstance(value, dict):
            raise ValueError("expected a mapping ({}, {network: false}, {writable: [...]}) or "
                             "false to opt out of the sandbox")
        try:
            return SandboxSettings.model_validate(value)
        except ValidationError as exc:
            raise ValueError("; ".join(_sandbox_problem(e) for e in exc.errors())) from None

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
    max_retries: int = Field(
        default=3, ge=0, le=10,
        description="Retries within one attempt on a 5xx, a 408 or a dropped connection, "
        "0.25 to 2 s apart. A 429 is never retried here: it ends the attempt as "
        "rate_limited, with the provider's Retry-After, for the executor to wait out.")


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
