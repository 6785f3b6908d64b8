"""Pre-flight: can each agent profile a plan would use run at all? (issue 10 item 4).

``runtime doctor`` prints the checks; ``run`` and ``batch`` make the same checks before
the first node. Per profile kind:

- ``command``: the program is on PATH (else ``launch_error``), its version (claude and
  codex only: ``--version`` on an unknown program could start real work), and the
  profile's ``preflight`` command (shipped: ``claude auth status``, ``codex login
  status``), run with the agent's own environment allow-list and read by the same
  recognisers as an attempt (``agents/recognise.py``): "Not logged in" is ``agent_auth``.
- ``http``: the key variable ``api_key_env`` is set, and the endpoint accepts a TCP
  connection.
- ``python``: the target module can be found. ``simulated``: always ready.

A failing profile is never tried: a node whose primary fails starts on the first
fallback that passes (``RunSettings.skip_profiles`` records which profiles were skipped
and why); a node with no usable profile refuses the whole run (``PreflightError``, exit
2) naming the profile, its reason and the fix. A codex that is not logged in then costs
a second, not a 30-minute timeout.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from runtime.agents import AnyProfile
from runtime.agents.command import agent_environment
from runtime.agents.recognise import AgentKind, kind_of, last_meaningful, read_preflight
from runtime.digest import blake3_hex, canonical_json
from runtime.errors import InputError, UsageError
from runtime.failures import FailureClass
from runtime.plan.manifest import Manifest
from runtime.plan.profiles import CommandProfile, HttpProfile, PythonProfile
from runtime.prompt.redact import Redactor
from runtime.run.records import RunSettings

PREFLIGHT_TIMEOUT_S = 30.0
VERSION_TIMEOUT_S = 15.0
CONNECT_TIMEOUT_S = 3.0
SUMMARY_LIMIT = 200
log = logging.getLogger(__name__)
INSTALL = {AgentKind.CLAUDE: "npm install -g @anthropic-ai/claude-code",
           AgentKind.CODEX: "npm install -g @openai/codex"}


class PreflightError(InputError):
    """Pre-flight found a node with no profile that can run. CLI exit status 2."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("pre-flight: " + "\n".join(problems)
                         + "\n(--no-preflight runs anyway)")


@dataclass(frozen=True)
class ProfileCheck:
    """One profile's pre-flight: what was found, and whether it can run."""

    profile: str
    kind: str  # claude, codex, command, http, python, simulated
    program: str | None = None  # the resolved path of argv[0]
    version: str | None = None
    preflight: tuple[str, ...] | None = None
    failure: FailureClass | None = None
    summary: str = ""
    fix: str | None = None
    seconds: float = 0.0
    used_by: tuple[str, ...] = ()  # "topology: node, node"

    @property
    def ok(self) -> bool:
        """Whether the check passed."""
        return self.failure is None

    def describe(self) -> str:
        """One line: the profile, its class and summary."""
        head = "ok" if self.ok else str(self.failure)
        return f"{self.profile}: {head}{': ' + self.summary if self.summary else ''}"


@dataclass(frozen=True)
class Decision:
    """What pre-flight changes for a run: profiles skipped (with why), nodes moved."""

    skip: dict[str, str] = field(default_factory=dict)
    moved: dict[str, str] = field(default_factory=dict)  # node -> profile it starts on
    problems: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------- which profiles


def profiles_in_use(manifest: Manifest, settings: RunSettings) -> dict[str, list[str]]:
    """Profile name -> the nodes that would use it (as primary or fallback)."""
    out: dict[str, list[str]] = {}
    for nid, node in manifest.nodes.items():
        for name in _chain(node.agent, node.fallback, settings):
            out.setdefault(name, []).append(nid)
    return out


def _chain(primary: str, fallback: Iterable[str], settings: RunSettings) -> list[str]:
    """A node's profiles in the order it would try them (as ``context.node_policy``)."""
    if settings.agent:
        return [settings.agent]
    return [primary, *([] if settings.no_fallback else fallback)]


# ---------------------------------------------------------------------------- checks


def check_profiles(profiles: Mapping[str, AnyProfile], *, env: Mapping[str, str] | None = None,
                   redactor: Redactor | None = None) -> dict[str, ProfileCheck]:
    """Check each profile once, in parallel (each check is mostly waiting)."""
    env = os.environ if env is None else env
    redactor = redactor or Redactor.from_environment(env)
    if not profiles:
        return {}
    with ThreadPoolExecutor(max_workers=min(8, len(profiles)),
                            thread_name_prefix="preflight") as pool:
        futures = {name: pool.submit(check_profile, name, p, env, redactor)
                   for name, p in profiles.items()}
        return {name: fut.result() for name, fut in futures.items()}


def check_profile(name: str, profile: AnyProfile, env: Mapping[str, str],
                  redactor: Redactor) -> ProfileCheck:
    """Check one profile as its agents will run, redacting what the check prints."""
    started = time.monotonic()
    match profile:
        case CommandProfile():
            check = _check_command(name, profile, env)
        case HttpProfile():
            check = _check_http(name, profile, env)
        case PythonProfile():
            check = _check_python(name, profile)
        case _:
            check = ProfileCheck(profile=name, kind=profile.kind, summary="built in")
    clean = redactor.clean(check.summary, SUMMARY_LIMIT) if check.summary else ""
    version = redactor.clean(check.version, SUMMARY_LIMIT) if check.version else None
    return ProfileCheck(**{**check.__dict__, "summary": clean, "version": version,
                           "seconds": round(time.monotonic() - started, 3)})


def _check_command(name: str, profile: CommandProfile, env: Mapping[str, str]) -> ProfileCheck:
    kind = kind_of(profile.argv[0])
    agent_env = agent_environment(profile.env, {}, env)
    program = shutil.which(profile.argv[0], path=agent_env.get("PATH"))
    base = ProfileCheck(profile=name, kind=kind.value, program=program,
                        preflight=tuple(profile.preflight) if profile.preflight else None)
    if program is None:
        return _with(base, FailureClass.LAUNCH_ERROR,
                     f"{profile.argv[0]}: not found on PATH", _fix(kind, profile,
                                                                    FailureClass.LAUNCH_ERROR))
    version = None
    if kind is not AgentKind.COMMAND:
        code, out, err = _call([program, "--version"], agent_env, VERSION_TIMEOUT_S)
        version = last_meaningful(out.decode("utf-8", "replace") + "\n" + err)
    base = _with(base, None, "", None, version=version)
    if not profile.preflight:
        return _with(base, None, "no preflight command", None)
    pre = profile.preflight
    if shutil.which(pre[0], path=agent_env.get("PATH")) is None:
        return _with(base, FailureClass.LAUNCH_ERROR, f"preflight {pre[0]}: not found on PATH",
                     _fix(kind_of(pre[0]), profile, FailureClass.LAUNCH_ERROR))
    code, out, err = _call(list(pre), agent_env, PREFLIGHT_TIMEOUT_S)
    reading = read_preflight(kind, code, out, err)
    if code is None:
        return _with(base, FailureClass.AGENT_TIMEOUT,
                     f"{' '.join(pre)} did not finish in {PREFLIGHT_TIMEOUT_S:g} s", None)
    summary = reading.summary or ("" if reading.failure is None else f"exit status {code}")
    if reading.failure is None and kind is AgentKind.CLAUDE:
        unreachable = _claude_endpoint(agent_env)
        if unreachable:  # logged in with a key, no way out: each attempt would wait ~190 s
            return _with(base, FailureClass.AGENT_UNREACHABLE, unreachable,
                         _fix(kind, profile, FailureClass.AGENT_UNREACHABLE))
    return _with(base, reading.failure, summary, _fix(kind, profile, reading.failure))


def _claude_endpoint(agent_env: Mapping[str, str]) -> str | None:
    """Tell whether claude can reach its API directly; the endpoint to probe, or None.

    Can claude reach its API directly, as it will run (the environment allow-list passes a
    proxy or another provider only when the profile lists it)? None: yes, or it goes another
    way we do not check. Measured: with a key and no network, claude -p reports ENOTFOUND
    after about 190 s.
    """
    if any(k.lower().endswith("_proxy") for k in agent_env) or any(
            k.startswith("CLAUDE_CODE_USE_") for k in agent_env):
        return None
    url = urlsplit(agent_env.get("ANTHROPIC_BASE_URL") or "https://api.anthropic.com")
    return _connect(url.hostname or "", url.port or (443 if url.scheme == "https" else 80))


def _connect(host: str, port: int) -> str | None:
    """None when ``host:port`` accepts a TCP connection, else why not."""
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            return None
    except OSError as exc:
        return f"cannot connect to {host}:{port}: {exc.strerror or exc}"


def _check_http(name: str, profile: HttpProfile, env: Mapping[str, str]) -> ProfileCheck:
    base = ProfileCheck(profile=name, kind="http", program=profile.base_url)
    if profile.api_key_env and not env.get(profile.api_key_env):
        return _with(base, FailureClass.AGENT_AUTH, f"{profile.api_key_env} is not set",
                     f"set {profile.api_key_env}")
    url = urlsplit(profile.base_url)
    port = url.port or (443 if url.scheme == "https" else 80)
    unreachable = _connect(url.hostname or "", port)
    if unreachable:
        return _with(base, FailureClass.AGENT_UNREACHABLE, unreachable,
                     f"start the server at {profile.base_url} or fix base_url")
    return _with(base, None, f"{url.hostname}:{port} accepts connections", None)


def _check_python(name: str, profile: PythonProfile) -> ProfileCheck:
    module = profile.target.split(":", 1)[0]
    base = ProfileCheck(profile=name, kind="python", program=profile.target)
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return _with(base, FailureClass.LAUNCH_ERROR, f"module {module} not found",
                     f"install {module} or fix target")
    return base


def _with(check: ProfileCheck, failure: FailureClass | None, summary: str, fix: str | None,
          **extra: object) -> ProfileCheck:
    return ProfileCheck(**{**check.__dict__, "failure": failure, "summary": summary,
                           "fix": fix, **extra})


def _fix(kind: AgentKind, profile: CommandProfile, failure: FailureClass | None) -> str | None:
    """What the user can do about a failing profile, when we know."""
    program = profile.argv[0]
    if failure is FailureClass.LAUNCH_ERROR:
        return f"install it: {INSTALL[kind]}" if kind in INSTALL else \
            f"install {program} or fix the profile's argv"
    if failure is FailureClass.AGENT_AUTH and kind is AgentKind.CLAUDE:
        listed = "" if "ANTHROPIC_API_KEY" in profile.env else \
            " and list it under the profile's env"
        return f"run `claude auth login`, or set ANTHROPIC_API_KEY{listed}"
    if failure is FailureClass.AGENT_AUTH and kind is AgentKind.CODEX:
        return ("run `codex login` (headless: `printenv OPENAI_API_KEY | codex login "
                "--with-api-key`)")
    if failure is FailureClass.AGENT_UNREACHABLE:
        return "check this machine's network, DNS and proxy settings for the provider"
    if failure is FailureClass.AGENT_REJECTED:
        return f"check the profile's argv against `{program} --help`"
    return None


def _call(argv: list[str], env: Mapping[str, str], timeout: float,
          ) -> tuple[int | None, bytes, str]:
    """Run a check command in an empty directory, its own process group killed on timeout.

    Exit code None: it did not finish.
    """
    with tempfile.TemporaryDirectory(prefix="runtime-preflight-") as cwd:
        try:
            proc = subprocess.Popen(argv, cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
        except OSError as exc:
            return 127, b"", f"{argv[0]}: {exc.strerror or exc}"
        try:
            out, err = proc.communicate(timeout=timeout)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            code = None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # nothing it started outlives the check
    return code, out, err.decode("utf-8", "replace")


# ---------------------------------------------------------------------------- decisions


def decide(manifest: Manifest, settings: RunSettings,
           checks: Mapping[str, ProfileCheck]) -> Decision:
    """Decide which profiles a run skips, where nodes start, and which nodes cannot start.

    Nodes with no profile left are problems: the run is refused.
    """
    skip = {n: c.describe() for n, c in checks.items() if not c.ok}
    moved: dict[str, str] = {}
    blocked: dict[str, list[str]] = {}
    for nid, node in manifest.nodes.items():
        chain = _chain(node.agent, node.fallback, settings)
        usable = [p for p in chain if p not in skip]
        if not usable:
            blocked.setdefault(chain[0], []).append(nid)
        elif usable[0] != chain[0]:
            moved[nid] = usable[0]
    problems = []
    for profile, nodes in blocked.items():
        check = checks[profile]
        problems.append(f"profile {profile} cannot run ({check.failure}: {check.summary}); "
                        f"nodes with no fallback that can: {', '.join(nodes)}"
                        + (f"\n  fix: {check.fix}" if check.fix else ""))
    return Decision(skip=skip, moved=moved, problems=problems)


def profile_key(profile: AnyProfile) -> str:
    """The identity of a profile's check, so that each distinct check runs once.

    What a check reads of a profile (a batch's topologies may share a profile, differ only
    in its timeout, or give different profiles one name).
    """
    data = profile.model_dump(mode="json")
    if isinstance(profile, CommandProfile):
        data = {"program": profile.argv[0], "preflight": profile.preflight, "env": profile.env}
    elif isinstance(profile, HttpProfile):
        data = {"base_url": profile.base_url, "api_key_env": profile.api_key_env}
    return blake3_hex(canonical_json(data))


def preflight_plans(plans: Mapping[str, tuple[Manifest, RunSettings]], *,
                    env: Mapping[str, str] | None = None, redactor: Redactor | None = None,
                    ) -> tuple[dict[str, Decision], list[ProfileCheck]]:
    """Check every profile the plans would use, each distinct one once.

    Decide per plan. Returns the decisions by plan key and the checks (with ``used_by``).
    """
    wanted: dict[str, AnyProfile] = {}
    names: dict[str, list[str]] = {}
    used: dict[str, list[str]] = {}
    for manifest, settings in plans.values():
        for name, nodes in profiles_in_use(manifest, settings).items():
            pkey = profile_key(manifest.agents[name])
            wanted[pkey] = manifest.agents[name]
            if name not in names.setdefault(pkey, []):
                names[pkey].append(name)
            used.setdefault(pkey, []).append(f"{manifest.topology.name}: {', '.join(nodes)}"
                                             f" ({name})")
    checked = check_profiles(wanted, env=env, redactor=redactor)
    # Profiles that one check covers (the same endpoint and key, models apart) are named
    # together: each name a user looks for is there.
    checks = {pkey: ProfileCheck(**{**c.__dict__, "profile": ", ".join(sorted(names[pkey])),
                                    "used_by": tuple(used[pkey])})
              for pkey, c in checked.items()}
    decisions = {}
    for key, (manifest, settings) in plans.items():
        mine = {name: checks[profile_key(manifest.agents[name])]
                for name in profiles_in_use(manifest, settings)}
        decisions[key] = decide(manifest, settings, mine)
    return decisions, sorted(checks.values(), key=lambda c: c.profile)


def preflight_run(manifest: Manifest, settings: RunSettings, *,
                  env: Mapping[str, str] | None = None, redactor: Redactor | None = None,
                  ) -> tuple[RunSettings, Decision]:
    """Check a run's profiles.

    Refuse (``PreflightError``) or return its settings with the failing profiles to skip.
    """
    decisions, _ = preflight_plans({"run": (manifest, settings)}, env=env, redactor=redactor)
    decision = decisions["run"]
    if decision.problems:
        raise PreflightError(decision.problems)
    return apply(settings, decision), decision


def preflight_batch(plans: Mapping[str, tuple[Manifest, RunSettings]], *,
                    redactor: Redactor | None = None) -> dict[str, Decision]:
    """A batch's pre-flight: each distinct profile checked once, the batch refused as a whole.

    Every distinct profile checked once; any topology left with a node that cannot start
    refuses the whole batch, before anything runs.
    """
    decisions, _ = preflight_plans(plans, redactor=redactor)
    problems = [f"{plans[key][0].topology.name}: {p}" for key, d in decisions.items()
                for p in d.problems]
    if problems:
        raise PreflightError(problems)
    for d in decisions.values():
        for line in notes(d):
            log.warning("%s", line)
    return decisions


def apply(settings: RunSettings, decision: Decision) -> RunSettings:
    """The run's settings with the failing profiles to skip (``skip_profiles``)."""
    if not decision.skip:
        return settings
    # model_copy, not a dump round trip: the operator prompt is excluded from dumps.
    return settings.model_copy(update={"skip_profiles": dict(decision.skip)})


def notes(decision: Decision) -> list[str]:
    """What pre-flight changed, for the user."""
    out = [f"pre-flight: skipping {why}" for why in decision.skip.values()]
    if decision.moved:
        out.append("pre-flight: starting on a fallback: " + ", ".join(
            f"{n} on {p}" for n, p in sorted(decision.moved.items())))
    return out


# ---------------------------------------------------------------------------- doctor


def doctor(manifests: list[Manifest], agent: str | None, *,
           env: Mapping[str, str] | None = None, redactor: Redactor | None = None,
           ) -> tuple[list[ProfileCheck], dict[str, Decision]]:
    """``runtime doctor``: every profile the manifests would use, checked once."""
    from runtime.run.start import check_settings

    plans = {}
    for manifest in manifests:
        settings = RunSettings(agent=agent)
        check_settings(manifest, settings)
        plans[manifest.topology.name] = (manifest, settings)
    decisions, checks = preflight_plans(plans, env=env, redactor=redactor)
    return checks, decisions


def render_checks(checks: list[ProfileCheck], decisions: Mapping[str, Decision]) -> str:
    """The doctor's human output: one block per profile, then what runs would do."""
    lines = []
    for c in checks:
        lines.append(f"ok    {c.profile}: {c.summary or 'ready'}" if c.ok
                     else f"FAIL  {c.describe()}")
        if c.program:
            lines.append(f"      program   {c.program}"
                         + (f"  ({c.version})" if c.version else ""))
        if c.preflight:
            lines.append(f"      preflight {' '.join(c.preflight)}")
        if c.fix:
            lines.append(f"      fix       {c.fix}")
        lines.extend(f"      used by   {u}" for u in c.used_by)
    for name, d in decisions.items():
        if d.problems:
            lines.append(f"{name}: `run` would refuse: " + "; ".join(
                p.splitlines()[0] for p in d.problems))
        elif d.moved:
            lines.append(f"{name}: `run` would start " + ", ".join(
                f"{n} on {p}" for n, p in sorted(d.moved.items())))
    return "\n".join(lines) + "\n"


def checks_json(checks: list[ProfileCheck], decisions: Mapping[str, Decision],
                ) -> dict[str, object]:
    """The checks and per-plan decisions as JSON, for ``runtime doctor --json``."""
    return {
        "ok": all(c.ok for c in checks),
        "profiles": [{**c.__dict__, "failure": c.failure.value if c.failure else None,
                      "ok": c.ok} for c in checks],
        "topologies": {name: {"refused": d.problems, "moved": d.moved, "skip": d.skip}
                       for name, d in decisions.items()},
    }


def load_manifests(targets: Iterable[Path], prompts: Path,
                   variables: Mapping[str, str]) -> list[Manifest]:
    """Plan topology files, directories or plan directories into manifests, in memory.

    Directories are searched for ``*.yaml``; the doctor writes nothing.
    """
    from runtime.plan.compile import plan_topology
    from runtime.plan.manifest import PROMPTS_DIR, read_manifest

    out: list[Manifest] = []
    for target in targets:
        if target.is_dir() and (target / PROMPTS_DIR).is_dir():
            out.append(read_manifest(target)[0])
        elif target.is_dir() and sorted(target.glob("*.yaml")):
            out += [plan_topology(p, prompts, dict(variables)).manifest
                    for p in sorted(target.glob("*.yaml"))]
        elif target.is_file():
            out.append(plan_topology(target, prompts, dict(variables)).manifest)
        else:
            raise UsageError(f"{target}: not a topology file, a directory of *.yaml or a "
                             "plan directory")
    return out
