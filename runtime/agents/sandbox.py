"""bubblewrap containment for ``command`` agents: detection, version, and the argv.

Inside the sandbox an agent sees (DESIGN section 10, issue 8):

- the host read-only (``--ro-bind / /``);
- its workspace read-write at the fixed path ``/mnt/workspace`` (its working
  directory), with ``/mnt/workspace/inputs`` (upstream artifacts) read-only on top;
- the attempt's ``prompt.md`` and ``attempt.json`` read-only under ``/mnt/attempt``;
- a private ``/tmp`` and ``/var/tmp``, its own ``/proc`` and a minimal ``/dev``;
- no host Unix socket that ``/proc/net/unix`` lists: a read-only root does not stop
  ``connect()``, and a socket is a door out of the sandbox (``docker.sock`` is root on
  the host). An empty ``/run`` (where daemons put theirs; files ``/etc`` links into it,
  such as ``resolv.conf``, are bound back) and ``/dev/null`` over every other listed
  socket at its real path (see ``host_sockets`` for what the list cannot show);
- its own copy of each ``private`` path (a CLI's state directory starts empty, a state
  file as a copy), discarded when the attempt ends, so an agent that follows instructions
  planted in its target cannot leave a memory file, a setting or a hook for the next
  agent or for the user's own CLI; ``writable`` paths are the host's and persist;
- none of the artifacts root (ledger, ``state.json``, plans, other nodes' workspaces):
  an empty read-only tmpfs is mounted over it;
- a new PID namespace (the runtime's ``/proc/<pid>/environ`` does not exist in it),
  IPC, UTS and cgroup namespaces, and a network namespace when ``network: false``;
- no capabilities (``--cap-drop ALL``: a root runtime would otherwise hand the agent
  CAP_SYS_ADMIN, enough to remount the read-only binds), ``--new-session`` (no
  TIOCSTI into a terminal), ``--die-with-parent`` (the runtime's death kills it).

Why under ``/mnt``: the fixed paths need a directory that exists on the host (nothing
can be created in a read-only root), and ``/mnt`` is the FHS place for temporary
mounts; the host's own ``/mnt`` is hidden by a tmpfs. Binding each top-level entry of
``/`` onto a tmpfs root instead (so that ``/workspace`` could be created) cost 4 ms
more per attempt here (bubblewrap's cost is its mounts, not its namespaces), so that
is only the fallback for a host without ``/mnt``.

Running as root, as the tests do in CI: bubblewrap needs no setuid bit and no
unprivileged user namespaces then; ``--unshare-all`` still tries a user namespace and
goes on without one where that is refused.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import stat
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from runtime.errors import UsageError

MOUNTS = PurePosixPath("/mnt")
WORKSPACE = MOUNTS / "workspace"
ATTEMPT = MOUNTS / "attempt"
PROMPT_FILE = ATTEMPT / "prompt.md"
ATTEMPT_CONTEXT = ATTEMPT / "attempt.json"
# Mounted separately: never bound from the host's root listing (fallback layout).
_OWN_MOUNTS = frozenset({"proc", "dev", "tmp", MOUNTS.name})
FIX = "install it (`apt-get install bubblewrap`) or opt the profile out with `sandbox: false`"


@dataclass(frozen=True)
class Bubblewrap:
    """The ``bwrap`` found on PATH and its version (recorded in every ``attempt.json``)."""
    path: str
    version: str


@functools.lru_cache(maxsize=1)
def find_bubblewrap() -> Bubblewrap | None:
    """The ``bwrap`` on PATH and its version, or None.

    Looked up once per process: the version goes into every ``attempt.json``, and a
    per-attempt ``bwrap --version`` would cost a process spawn.
    """
    path = shutil.which("bwrap")
    if path is None:
        return None
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True,
                             timeout=10, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return Bubblewrap(path=path, version=out.removeprefix("bubblewrap").strip() or "unknown")


def sandboxed_profiles(agents: Mapping[str, object], used: Iterable[str]) -> list[str]:
    """Which of the profiles a run will use are sandboxed ``command`` profiles."""
    from runtime.plan.profiles import CommandProfile

    return sorted({name for name in used if isinstance(agents.get(name), CommandProfile)
                   and agents[name].sandbox is not False})  # type: ignore[attr-defined]


def require_bubblewrap(profiles: Iterable[str]) -> None:
    """Refuse to start when a sandboxed profile will be used and bubblewrap is missing.

    Refuse to start (exit 2, before any node runs) when a sandboxed profile will be used and
    bubblewrap is missing. ``profiles``: names of those profiles.
    """
    names = sorted(set(profiles))
    if names and find_bubblewrap() is None:
        raise UsageError(f"bubblewrap (bwrap) is not installed, and agent profile(s) "
                         f"{', '.join(names)} run sandboxed by default: {FIX}")


@dataclass(frozen=True)
class SandboxSpec:
    """What one attempt's sandbox binds. Host paths are absolute."""

    workspace: Path
    prompt_file: Path | None = None
    attempt_context: Path | None = None
    hide: tuple[Path, ...] = ()
    network: bool = True
    writable: tuple[str, ...] = ()
    private: tuple[str, ...] = ()
    home: str = field(default_factory=lambda: os.path.expanduser("~"))
    # Host directories under a private root the agent needs read-only (its program, its
    # PATH: a checkout or venv under /tmp), shown again over the empty one: (the path
    # in the sandbox, the host path it shows; they differ where a link is involved).
    expose: tuple[tuple[Path, Path], ...] = ()


# Host directories the sandbox replaces with its own empty ones: the world-writable ones
# (anyone on the host could put a socket there, or swap one as an attempt starts) and
# /run, where daemons keep theirs. By real path: /var/run is usually a link to /run, and a
# /var/tmp that links elsewhere must not leave that elsewhere in sight.
PRIVATE_ROOTS = ("/tmp", "/var/tmp", "/run", "/var/run")
_RUN_ROOTS = ("/run", "/var/run")  # where only the exact PATH directory is shown again


@functools.lru_cache(maxsize=1)
def _private_roots(roots: tuple[str, ...]) -> tuple[Path, ...]:
    reals: list[Path] = []
    for root in roots:
        real = Path(os.path.realpath(root))
        if real.is_dir() and real != Path("/") and real not in reals:
            reals.append(real)
    return tuple(r for r in reals if not any(o != r and _under(r, o) for o in reals))


@functools.lru_cache(maxsize=16)
def _real(root: str) -> Path:
    """A private root's real path, resolved once per process."""
    return Path(os.path.realpath(root))


def private_roots() -> list[Path]:
    """The real directories behind ``PRIVATE_ROOTS``, none inside another.

    Resolved once per process (every attempt needs them; a host does not move /tmp).
    """
    return list(_private_roots(PRIVATE_ROOTS))


def tmp_roots(paths: Iterable[str]) -> tuple[tuple[Path, Path], ...]:
    """What to show again, read-only, of ``paths`` (the program, ``PATH``) under a private root.

    ``(path in the sandbox, host path)`` pairs. Under ``/tmp`` and ``/var/tmp`` the
    top-level directory (a checkout or a venv needs its ``lib`` beside its ``bin``);
    under ``/run`` only the directory itself (NixOS's ``/run/current-system/sw/bin``;
    ``/run/user/<uid>`` holds a user's sockets). The root is taken by its real path (in
    the sandbox ``/var/run/x`` is reached through the link to ``/run``); the rest as
    given, since ``PATH`` names it so (bubblewrap follows a link in the host path).
    """
    out: list[tuple[Path, Path]] = []
    for raw in paths:
        if not raw:
            continue
        path = os.path.abspath(raw)
        for root in PRIVATE_ROOTS:
            if path == root or not _under(path, root):
                continue
            rel = path[len(root) + 1:]
            kept = rel if root in _RUN_ROOTS else rel.split("/", 1)[0]
            pair = (_real(root) / kept, Path(root, kept))
            if pair not in out and pair[1].is_dir():
                out.append(pair)
            break
    return tuple(out)


def expand_writable(paths: Iterable[str], home: str) -> list[str]:
    """Host paths, ``~/`` expanded against ``home``; a trailing ``/`` is kept."""
    return [os.path.join(home, p[2:]) if p.startswith("~/") else p for p in paths]


def create_writable_dirs(spec: SandboxSpec) -> str | None:
    """Entries written with a trailing ``/`` are directories, created (0700) when missing.

    A CLI that cannot create its state directory in a read-only home fails (codex does),
    and a private directory needs a mount point. Other missing entries are skipped, since
    whether they would be a file or a directory is unknown (claude runs without
    ``~/.claude.json``). Returns why a directory could not be created, or None.
    """
    for path in expand_writable((*spec.writable, *spec.private), spec.home):
        if path.endswith("/"):
            try:
                os.makedirs(path, mode=0o700, exist_ok=True)
            except OSError as exc:
                return (f"sandbox: cannot create the writable directory {path}: "
                        f"{exc.strerror or exc}")
    return None


PRIVATE_FILE_MAX = 64 << 20  # a CLI's state file; a larger one is refused, not copied


def open_private_files(spec: SandboxSpec) -> dict[str, int] | str:
    """An open descriptor of each private file that exists, to copy into the sandbox.

    Real path -> descriptor: the copy is mounted at the real path, where a link to it
    leads (bubblewrap's ``--bind-data`` reads the descriptor, so the copy lives in the
    sandbox's memory and is gone when it ends; the caller closes them). A link is
    followed (dotfile managers keep ``~/.claude.json`` as one): the runtime reads with
    the agent's own rights, so a link can show it nothing it could not read itself. Only a
    regular file is copied (a FIFO would block). Returns why a file cannot be copied
    instead (and closes what it opened).
    """
    from runtime.files import UnsafeFileError, open_no_follow

    fds: dict[str, int] = {}
    for path in expand_writable(spec.private, spec.home):
        if path.endswith("/") or not os.path.exists(path):
            continue
        try:
            real = os.path.realpath(path)  # once: the file read is the one mounted
            fd = open_no_follow(real)
            fds[real] = fd
            if os.fstat(fd).st_size > PRIVATE_FILE_MAX:
                raise UnsafeFileError(f"larger than {PRIVATE_FILE_MAX} bytes")
        except OSError as exc:
            for opened in fds.values():
                os.close(opened)
            return f"sandbox: cannot copy the private file {path}: {exc.strerror or exc}"
    return fds


def bwrap_argv(bwrap: str, spec: SandboxSpec, command: list[str],
               private_fds: Mapping[str, int] | None = None) -> list[str]:
    """The whole argv: bubblewrap's options, then ``--``, then the agent's command.

    ``private_fds``: ``open_private_files``'s descriptors, passed on to bubblewrap.
    """
    argv = [bwrap, "--unshare-all", "--die-with-parent", "--new-session",
            "--cap-drop", "ALL"]
    if spec.network:
        argv.append("--share-net")
    if os.path.isdir(MOUNTS):
        argv += ["--ro-bind", "/", "/"]
    else:
        argv += ["--tmpfs", "/", *_host_root()]
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", str(MOUNTS), *_empty_roots()]
    argv += _host_binds(spec, private_fds or {}) + _attempt_binds(spec)
    argv += ["--remount-ro", str(MOUNTS), "--remount-ro", "/", "--chdir", str(WORKSPACE),
             "--", *command]
    return argv


def _host_binds(spec: SandboxSpec, private_fds: Mapping[str, int]) -> list[str]:
    """What of the host is shown again, replaced by a private copy, made writable, or hidden.

    Private and writable paths are mounted outermost first (by the path mounted on), so
    the inner one wins whichever list it is in (a writable credentials file inside a
    private directory).
    """
    argv: list[str] = []
    for inside, host in spec.expose:
        argv += ["--ro-bind", str(host), str(inside)]
    writable = [p.rstrip("/") for p in expand_writable(spec.writable, spec.home)]
    private_dirs = [p.rstrip("/") for p in expand_writable(spec.private, spec.home)
                    if p.endswith("/")]
    mounts = [(p, ["--bind-try", p, p]) for p in writable] + \
        [(p, ["--tmpfs", p]) for p in private_dirs] + \
        [(real, ["--bind-data", str(fd), real]) for real, fd in private_fds.items()]
    for _, args in sorted(mounts, key=lambda m: len(Path(m[0]).parts)):
        argv += args
    # Where the host's own directories are seen again: mount point -> what it shows.
    shown = [*spec.expose, *((Path(p), Path(p)) for p in writable)]
    covered = [*private_roots(), Path("/proc"), Path("/dev"), Path(MOUNTS),
               *(Path(os.path.realpath(h)) for h in spec.hide),
               *(Path(os.path.realpath(d)) for d in private_dirs)]
    for door in host_sockets(shown, covered):
        argv += ["--ro-bind", "/dev/null", door]
    for hidden in spec.hide:
        # Under a private root (/tmp) its tmpfs already hides it (unless exposed again);
        # elsewhere an empty read-only tmpfs covers it (after the writable binds, so a
        # writable path cannot expose it).
        if not any(_under(hidden, r) for r in PRIVATE_ROOTS) or any(
                _under(hidden, str(inside)) for inside, _ in spec.expose):
            argv += ["--tmpfs", str(hidden), "--remount-ro", str(hidden)]
    return argv


def _attempt_binds(spec: SandboxSpec) -> list[str]:
    """The attempt's own paths under ``/mnt``."""
    argv = ["--bind", str(spec.workspace), str(WORKSPACE)]
    inputs = spec.workspace / "inputs"
    if inputs.is_dir():
        argv += ["--ro-bind", str(inputs), str(WORKSPACE / "inputs")]
    for host, inside in ((spec.prompt_file, PROMPT_FILE),
                         (spec.attempt_context, ATTEMPT_CONTEXT)):
        if host is not None:
            argv += ["--ro-bind-try", str(host), str(inside)]
    return argv


_UNIX_SOCKETS = "/proc/net/unix"


def _empty_roots() -> list[str]:
    """An empty tmpfs over each private root's real directory.

    The files ``/etc`` links into them or into ``/mnt`` (``resolv.conf`` under
    systemd-resolved, or WSL) are shown again.
    """
    argv: list[str] = []
    for root in private_roots():
        argv += ["--tmpfs", str(root)]
    for kept in _etc_links_into_run():
        argv += ["--ro-bind", kept, kept]
    return argv


@functools.lru_cache(maxsize=1)
def _etc_links_into_run() -> tuple[str, ...]:
    """Files ``/etc`` links into ``/run`` (``resolv.conf`` under systemd-resolved).

    Shown again over the empty ``/run``, or an agent with network could not resolve a
    name. Looked up once per process.
    """
    out: list[str] = []
    with contextlib.suppress(OSError), os.scandir("/etc") as entries:
        for entry in entries:
            if not entry.is_symlink():
                continue
            real = os.path.realpath(entry.path)
            hidden = (*map(str, private_roots()), str(MOUNTS))
            if any(_under(Path(real), h) for h in hidden) and os.path.isfile(real):
                out.append(real)
    return tuple(sorted(out))


def host_sockets(shown: Iterable[tuple[Path, Path]] = (),
                 covered: Iterable[Path] | None = None) -> list[str]:
    """Where an agent would still see a host Unix socket: each place to cover with /dev/null.

    From ``/proc/net/unix`` (sockets bound in this network namespace), read for every
    attempt since daemons come and go. A socket is seen at its real path unless a
    ``covered`` directory (a real path) holds it (a path through a link would be no mount
    point in the sandbox), and again under every ``shown`` mount point (the sandbox's path, the host
    directory it shows) whose directory holds it; a path that is not a socket here (bound
    in another mount namespace) is left alone.

    Not found this way: a socket bound in another network namespace (a container's), one
    renamed after it was bound, one bound with a relative path. Outside the private roots
    only a privileged user can put one, so the README tells operators what to keep out.
    """
    try:
        with open(_UNIX_SOCKETS, encoding="utf-8", errors="surrogateescape") as fh:
            lines = fh.read().splitlines()[1:]
    except OSError:
        return []
    views = [(mount, Path(os.path.realpath(source))) for mount, source in shown]
    hidden = private_roots() if covered is None else list(covered)
    out: set[str] = set()
    for line in lines:
        fields = line.split(None, 7)
        if len(fields) < 8 or not fields[7].startswith("/"):
            continue  # unbound, or abstract (@name: only a shared network namespace)
        real = Path(os.path.realpath(fields[7]))
        try:
            if not stat.S_ISSOCK(os.lstat(real).st_mode):
                continue
        except OSError:
            continue
        if not any(_under(real, str(h)) for h in hidden):
            out.add(str(real))
        for mount, source in views:
            if _under(real, str(source)):
                out.add(str(mount / real.relative_to(source)))
    return sorted(out)


def sandbox_environment(env: Mapping[str, str]) -> dict[str, str]:
    """Map the agent's environment onto the sandbox's fixed paths and private /tmp.

    The agent's environment with the runtime's paths replaced by the fixed ones inside the
    sandbox, and TMPDIR pointing at the private /tmp (a host TMPDIR would be read-only in
    there).
    """
    out = dict(env)
    out.update({"RUNTIME_WORKSPACE": str(WORKSPACE), "RUNTIME_PROMPT_FILE": str(PROMPT_FILE),
                "RUNTIME_ATTEMPT_CONTEXT": str(ATTEMPT_CONTEXT), "TMPDIR": "/tmp"})
    return out


def _host_root() -> list[str]:
    """Fallback: bind every top-level entry of the host's ``/`` read-only.

    Symlinks (``/bin`` -> ``usr/bin`` on merged-/usr systems) are recreated as symlinks.
    """
    out: list[str] = []
    with os.scandir("/") as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            if entry.name in _OWN_MOUNTS:
                continue
            path = f"/{entry.name}"
            if entry.is_symlink():
                out += ["--symlink", os.readlink(path), path]
            else:
                out += ["--ro-bind", path, path]
    return out


def _under(path: Path | str, top: Path | str) -> bool:
    """Whether absolute, normalised ``path`` is ``top`` or inside it.

    On strings: every attempt asks this of each PATH entry, socket and root, and
    pathlib's ``parents`` costs tens of microseconds a call.
    """
    p, t = os.fspath(path), os.fspath(top).rstrip("/") or "/"
    return p == t or p.startswith(t if t == "/" else t + "/")
