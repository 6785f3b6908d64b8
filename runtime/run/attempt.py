"""One attempt, start to finish.

Check the prompt digest, prepare the workspace, assemble the prompt (with the retry preamble
when due), invoke the agent, classify the evidence, and record ``attempt.json`` and the
ledger events.

An attempt receives a frozen ``AttemptSpec`` and returns the ``AttemptRecord`` it wrote.
Whatever goes wrong inside it stays inside it: a missing or unreadable plan prompt or
input is ``digest_mismatch``, any other exception a ``launch_error`` naming it; only a
``FatalRunError`` (the run can no longer record anything) leaves the attempt.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from runtime.agents.base import AgentExit
from runtime.agents.capture import BoundedCapture
from runtime.agents.recognise import error_tail
from runtime.digest import blake3_hex
from runtime.errors import FatalRunError
from runtime.failures import FailureClass, Outcome
from runtime.files import (
    UnsafeFileError,
    create_read_only,
    read_capped,
    replace_atomically,
    rewrite_in_place,
    write_read_only,
)
from runtime.plan.profiles import CommandProfile
from runtime.prompt.assemble import RuntimeContext, assemble_prompt
from runtime.prompt.feedback import fingerprint, render_preamble
from runtime.prompt.redact import Redactor, sanitize
from runtime.run.context import AttemptSpec, RunContext
from runtime.run.contract import AcceptanceSummary, verify_artifacts
from runtime.run.engine import LOCAL, AgentOutcome, AgentRequest, InputFile, LocalSite, deliver
from runtime.run.events import AttemptFinished, AttemptStarted
from runtime.run.layout import InputMismatch
from runtime.run.records import AttemptContext, SandboxRecord
from runtime.run.state import AttemptRecord

log = logging.getLogger(__name__)

ERROR_LIMIT = 4096
SUMMARY_LIMIT = 200
PROMPT_MAX_BYTES = 64 * 1024 * 1024
# Errors that mean the run's own records cannot be written: no attempt can be recorded,
# so the run stops (resumable) instead of failing node after node.
FATAL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO})


def summarize(redactor: Redactor, hint: str | None, error: str) -> str:
    """One redacted, bounded line a user can act on.

    The adapter's reading of the agent's own reason when it has one, else the error's first
    non-empty line. Redacted and bounded.
    """
    source = hint or next((ln for ln in error.splitlines() if ln.strip()), "")
    line = " ".join(source.split())
    return redactor.clean(line, SUMMARY_LIMIT) if line else ""


@dataclass(frozen=True)
class Launch:
    """A prepared attempt: the engine's request, and the driver's side of it."""

    request: AgentRequest
    site: LocalSite


_T = TypeVar("_T")


class _Failed(Exception):
    """An attempt ends early with a class (raised inside, caught in ``run``)."""

    def __init__(self, failure: FailureClass, error: str) -> None:
        super().__init__(error)
        self.failure, self.error = failure, error


class Attempt:
    """One attempt. Owns its directory and its two ledger events; nothing else."""

    def __init__(self, ctx: RunContext, spec: AttemptSpec) -> None:
        self.ctx, self.spec = ctx, spec
        self.node = ctx.manifest.nodes[spec.node_id]
        self.dir = ctx.layout.attempt_dir(spec.node_id, spec.number)
        self.started = ctx.clock()
        self._prompt_digest = ""
        self._prompt_text = ""
        self._preamble_digest: str | None = None
        self._started = False
        self._summary_hint: str | None = None
        self._retry_after: float | None = None
        self._where: AgentOutcome | None = None  # the engine's report: where it ran
        self._context_bytes = b""
        self._context_fd: int | None = None  # attempt.json, kept open for the final record
        self._records_optional = False  # set once the attempt ends early
        self._deadline_cut = False  # the run's deadline comes before the node's timeout

    def run(self) -> AttemptRecord:
        """Run the attempt on the run's engine, blocking, and return the record it wrote.

        Only ``FatalRunError`` propagates (the run can no longer record anything); every other
        failure is recorded as this attempt's outcome.
        """
        launch = self.prepare()
        if isinstance(launch, AttemptRecord):
            return launch
        try:
            outcome: AgentOutcome | Exception = self.ctx.engine.run(launch.request, launch.site)
        except FatalRunError:
            raise
        except Exception as exc:  # noqa: BLE001 - an engine bug is this attempt's launch_error
            outcome = exc
        return self.complete(launch, outcome)

    def prepare(self, *, sync: bool = True) -> Launch | AttemptRecord:
        """Everything before the agent starts; the record instead when the attempt ends early.

        Checks the plan prompt, resets the workspace, places the inputs, writes the prompt
        and ``attempt.json`` and appends ``attempt.started`` (``sync=False``: the caller
        calls ``ledger.sync()`` before it starts the agent).
        """
        return self._guard(lambda: self._prepare(sync))

    def complete(self, launch: Launch, outcome: AgentOutcome | Exception) -> AttemptRecord:
        """Everything after the agent: classify, verify the artifacts, record the attempt.

        ``outcome`` is what the engine observed, or the exception it raised (recorded as
        this attempt's ``launch_error``).
        """
        return self._guard(lambda: self._complete(launch, outcome))

    def _guard(self, step: Callable[[], _T]) -> _T | AttemptRecord:
        try:
            return step()
        except FatalRunError:
            raise
        except _Failed as failed:
            return self._end_early(failed.failure, failed.error)
        except OSError as exc:
            if exc.errno in FATAL_ERRNOS:
                raise FatalRunError(self.dir, f"cannot write the run's records: "
                                    f"{exc.strerror}") from None
            # The environment (no descriptors left, a file an agent planted), not a bug:
            # one line, no traceback; the attempt records the error.
            log.warning("attempt %s/%d: %s", self.spec.node_id, self.spec.number, exc)
            return self._end_early(FailureClass.LAUNCH_ERROR, f"runtime error preparing or "
                                   f"recording the attempt: {type(exc).__name__}: {exc}")
        except Exception as exc:
            log.exception("attempt %s/%d: internal error", self.spec.node_id, self.spec.number)
            return self._end_early(FailureClass.LAUNCH_ERROR, f"runtime error in the attempt: "
                                   f"{type(exc).__name__}: {exc}")

    def _end_early(self, failure: FailureClass, error: str) -> AttemptRecord:
        # The attempt's own files may be what failed (an unsandboxed agent can turn
        # attempt.json into a directory): the ledger still records how it ended.
        self._records_optional = True
        if not self._started:
            self._start(prompt_digest=self._prompt_digest or "0" * 64, preamble=None)
        return self._finish(failure, None, error, AcceptanceSummary(), 0, 0, {})

    def _prepare(self, sync: bool) -> Launch:
        layout, spec = self.ctx.layout, self.spec
        plan_bytes = self._plan_prompt()
        layout.reset_workspace(spec.node_id)
        try:
            inputs = layout.place_inputs(spec.node_id, self.ctx.accepted_inputs(spec.node_id))
        except InputMismatch as exc:
            raise _Failed(FailureClass.DIGEST_MISMATCH, str(exc)) from None
        preamble = None
        if spec.policy.retry_feedback and spec.trigger == "retry" and spec.prior_failures:
            preamble = render_preamble(spec.number, spec.last_number,
                                       list(spec.prior_failures),
                                       spec.policy.feedback_max_bytes)
        prompt = assemble_prompt(
            RuntimeContext(
                topology=self.ctx.manifest.topology.name, node=spec.node_id,
                artifacts=[(a.path, a.kind, a.required) for a in self.node.artifacts],
                inputs=inputs),
            plan_bytes.decode("utf-8"), operator_prompt=self.ctx.settings.operator_prompt,
            preamble=preamble)
        prompt_bytes = prompt.encode()
        write_read_only(self.dir / "prompt.md", prompt_bytes)
        self._start(prompt_digest=blake3_hex(prompt_bytes), preamble=preamble, sync=sync)
        self._prompt_text = prompt
        return self._launch(prompt_bytes)

    def _plan_prompt(self) -> bytes:
        """The plan's prompt, read once without following links, hashed and used."""
        path = self.ctx.layout.prompt_rendered(self.spec.node_id)
        try:
            data = read_capped(path, PROMPT_MAX_BYTES)
        except (OSError, UnsafeFileError) as exc:
            if isinstance(exc, OSError) and exc.errno in FATAL_ERRNOS:
                raise
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise _Failed(FailureClass.DIGEST_MISMATCH,
                          f"{path.name} cannot be read ({reason}): the run's copy of the "
                          "plan prompt is gone or replaced") from None
        actual = blake3_hex(data)
        self._prompt_digest = actual
        if actual != self.node.prompt_digest:
            raise _Failed(FailureClass.DIGEST_MISMATCH,
                          f"{path.name} hashes to {actual}, the plan says "
                          f"{self.node.prompt_digest}: the plan was tampered with")
        return data

    def _context(self, **outcome: object) -> AttemptContext:
        spec = self.spec
        return AttemptContext.model_validate(dict(
            run_id=self.ctx.run_id, node=spec.node_id, attempt=spec.number,
            max_attempts=spec.last_number, trigger=spec.trigger,
            prior_attempt=spec.prior_attempt, profile=spec.profile,
            profile_digest=self.ctx.profile_digest(spec.profile),
            plan_prompt_digest=self.node.prompt_digest, prompt_digest=self._prompt_digest,
            preamble_digest=self._preamble_digest, prior_failures=list(spec.prior_failures),
            sandbox=self._sandbox(), started_at=self.started, engine=self.ctx.engine.name,
            worker_host=self._where.host if self._where else None,
            worker=self._where.worker if self._where else None, **outcome))

    def _sandbox(self) -> SandboxRecord | None:
        from runtime.agents.sandbox import find_bubblewrap

        profile = self.ctx.manifest.agents[self.spec.profile]
        if not isinstance(profile, CommandProfile):
            return None
        if profile.sandbox is False:
            return SandboxRecord(enabled=False)
        bwrap = find_bubblewrap()
        return SandboxRecord(enabled=True, bubblewrap=bwrap.version if bwrap else None,
                             network=profile.sandbox.network)

    def _write_context(self, ctx: AttemptContext) -> None:
        try:
            self._write_context_file(ctx)
        except OSError as exc:
            if not self._records_optional or exc.errno in FATAL_ERRNOS:
                raise
            log.warning("attempt %s/%d: attempt.json cannot be written (%s); the ledger "
                        "records the attempt", self.spec.node_id, self.spec.number, exc)

    def _write_context_file(self, ctx: AttemptContext) -> None:
        data = (ctx.model_dump_json(indent=2) + "\n").encode()
        path = self.dir / "attempt.json"
        if not self._started:  # the directory was just claimed: create in place
            self._context_bytes = data  # what the agent reads; a remote engine ships it
            with contextlib.suppress(FileExistsError):  # (a failed first try: replace)
                self._context_fd = create_read_only(path, data)
                return
        fd, self._context_fd = self._context_fd, None
        if fd is None:
            replace_atomically(path, data)
        else:  # the final record: the same file again (a create and a rename less)
            rewrite_in_place(fd, path, data)

    def _start(self, *, prompt_digest: str, preamble: str | None, sync: bool = True) -> None:
        self._prompt_digest = prompt_digest
        self._preamble_digest = blake3_hex(preamble.encode()) if preamble else None
        self._write_context(self._context())
        spec = self.spec
        self.ctx.ledger.append(AttemptStarted(
            node=spec.node_id, attempt=spec.number, profile=spec.profile,
            trigger=spec.trigger, prior_attempt=spec.prior_attempt,
            prompt_digest=prompt_digest, preamble_digest=self._preamble_digest,
            waited_s=spec.waited_s), sync=sync)
        self._started = True

    def _launch(self, prompt: bytes) -> Launch:
        ws = self.ctx.layout.workspace(self.spec.node_id)
        timeout = self.spec.policy.timeout_s
        if self.ctx.settings.deadline_at is not None:
            left = self.ctx.settings.deadline_at - self.ctx.clock()
            if left < timeout:  # stopped then, it is the run's deadline, not the node's fault
                timeout, self._deadline_cut = max(0.001, left), True
        profile = self.ctx.manifest.agents[self.spec.profile]
        request = AgentRequest(
            run_id=self.ctx.run_id, node=self.spec.node_id, attempt=self.spec.number,
            max_attempts=self.spec.last_number, profile_name=self.spec.profile,
            profile=profile, prompt=prompt, inputs=self._inputs(ws),
            env_names=tuple(getattr(profile, "env", ())), timeout_s=timeout,
            artifacts=tuple(self.node.artifacts),
            context=self._context_bytes if self.ctx.engine.name != LOCAL else b"")
        where = self.ctx.layout.absolute()  # agents get absolute paths
        ws, adir = where.workspace(self.spec.node_id), where.attempt_dir(self.spec.node_id,
                                                                         self.spec.number)
        site = LocalSite(
            workspace=ws, attempt_dir=adir, prompt_file=adir / "prompt.md",
            env=self._env(ws, adir),
            stdout=BoundedCapture(self.dir / "stdout.log"),
            stderr=BoundedCapture(self.dir / "stderr.log"), cancel=self.ctx.cancel,
            leader_log=where.leaders)
        return Launch(request, site)

    def _complete(self, launch: Launch, result: AgentOutcome | Exception) -> AttemptRecord:
        site = launch.site
        try:
            if isinstance(result, Exception):
                raise result
            deliver(result, site)
        finally:
            site.stdout.close()
            site.stderr.close()
        outcome = result
        self._where = outcome
        exit_ = outcome.exit
        if outcome.lost is not None:
            return self._finish(FailureClass.LOST, None, outcome.lost, AcceptanceSummary(),
                                outcome.stdout_total, outcome.stderr_total, {})
        ws = site.workspace
        failure, error = self._classify(exit_, site.stderr, launch.request.timeout_s)
        self._summary_hint, self._retry_after = exit_.summary, exit_.retry_after_s
        acceptance = AcceptanceSummary()
        digests: dict[str, str] = {}
        if failure not in (FailureClass.LAUNCH_ERROR, FailureClass.CANCELLED):
            acceptance = verify_artifacts(ws, list(self.node.artifacts),
                                          list(self.node.acceptance))
            if failure is None and acceptance.unsatisfied:
                failure, error = FailureClass.ARTIFACT_CONTRACT, "\n".join(acceptance.unsatisfied)
            if failure is None:
                digests, problem = self.ctx.layout.artifact_digests(
                    self.spec.node_id, [a.path for a in self.node.artifacts])
                if problem:
                    failure, error = FailureClass.ARTIFACT_CONTRACT, problem
        return self._finish(failure, exit_.exit_code, error, acceptance,
                            outcome.stdout_total, outcome.stderr_total, digests)

    def _inputs(self, ws: Path) -> tuple[InputFile, ...]:
        """Read the placed inputs with their digests, for an engine that runs elsewhere.

        The local engine reads them in place: for it this returns nothing.
        """
        if self.ctx.engine.name == LOCAL:
            return ()
        out = []
        for up, accepted in self.ctx.accepted_inputs(self.spec.node_id).items():
            for rel in sorted(accepted):
                path = ws / "inputs" / up / rel
                if os.path.lexists(path):
                    data = read_capped(path, PROMPT_MAX_BYTES)
                    out.append(InputFile(f"inputs/{up}/{rel}", data, blake3_hex(data)))
        return tuple(out)

    def _env(self, ws: Path, adir: Path) -> Mapping[str, str]:
        """The RUNTIME_* variables, from the absolute workspace and attempt directory."""
        return {
            "RUNTIME_RUN_ID": self.ctx.run_id, "RUNTIME_NODE": self.spec.node_id,
            "RUNTIME_RUN_KEY": self.ctx.run_key,
            "RUNTIME_ATTEMPT": str(self.spec.number),
            "RUNTIME_MAX_ATTEMPTS": str(self.spec.last_number),
            "RUNTIME_WORKSPACE": str(ws),
            "RUNTIME_PROMPT_FILE": str(adir / "prompt.md"),
            "RUNTIME_ATTEMPT_CONTEXT": str(adir / "attempt.json"),
        }

    def _error_tail(self, stderr: BoundedCapture) -> str:
        """The last ERROR_LIMIT characters of stderr, redacted before they are bounded.

        A window twice as wide goes through the redactor first, so a multi-line key whose
        BEGIN line falls just outside the tail is still recognised and removed.
        """
        # Lines echoing the prompt (codex prints it whole) are dropped first, or they
        # would fill the budget with trusted text inside the untrusted block (issue 10).
        wide = error_tail(stderr, self._prompt_text, 2 * ERROR_LIMIT)
        clean = self.ctx.redactor.redact(sanitize(wide))
        if len(clean) <= ERROR_LIMIT:
            return clean
        cut = clean[-ERROR_LIMIT:]
        newline = cut.find("\n")
        return cut[newline + 1:] if newline >= 0 else ""

    def _classify(self, exit_: AgentExit, stderr: BoundedCapture, timeout: float,
                  ) -> tuple[FailureClass | None, str]:
        if exit_.launch_error is not None:
            return FailureClass.LAUNCH_ERROR, exit_.launch_error
        if exit_.cancelled:
            return FailureClass.CANCELLED, "cancelled by the operator"
        if exit_.timed_out and self._deadline_cut:
            # Uncharged, like an operator's stop: the node did nothing wrong.
            return FailureClass.CANCELLED, "stopped at the run's deadline (--deadline)"
        if exit_.timed_out:
            tail = self._error_tail(stderr)
            return FailureClass.AGENT_TIMEOUT, f"timed out after {timeout:g} s\n{tail}".strip()
        if exit_.failure is not None:  # the adapter recognised the agent's own reason
            head = exit_.summary or exit_.reported_error or f"exit status {exit_.exit_code}"
            return exit_.failure, f"{head}\n{self._error_tail(stderr)}".strip()
        if exit_.exit_code != 0:
            tail = self._error_tail(stderr)
            return FailureClass.AGENT_EXIT, f"exit status {exit_.exit_code}\n{tail}".strip()
        if exit_.reported_error is not None:
            return FailureClass.CONTRADICTORY_COMPLETION, exit_.reported_error
        return None, ""  # success: stderr is not read (redacting it costs ~1 ms)

    # PLR0913: The evidence gathered over one attempt, recorded together; a private step of run().
    def _finish(self, failure: FailureClass | None, exit_code: int | None, error: str,  # noqa: PLR0913
                acceptance: AcceptanceSummary, out_bytes: int, err_bytes: int,
                digests: dict[str, str]) -> AttemptRecord:
        redactor = self.ctx.redactor
        finished = self.ctx.clock()
        duration = round(finished - self.started, 6)
        clean = redactor.clean(error, ERROR_LIMIT) if error else ""
        clean_acc = AcceptanceSummary(
            satisfied=acceptance.satisfied, unknown=acceptance.unknown,
            unsatisfied=[redactor.clean(u, 1024) for u in acceptance.unsatisfied])
        fp = fingerprint(failure, clean) if failure is not None else None
        summary = summarize(redactor, self._summary_hint, clean) if failure is not None else ""
        outcome = Outcome.of(failure)
        retry_after = self._retry_after if failure is FailureClass.RATE_LIMITED else None
        self._write_context(self._context(
            outcome=outcome, failure_classes=[failure] if failure else [],
            exit_code=exit_code, error=clean, summary=summary, acceptance=clean_acc,
            stdout_bytes=out_bytes, stderr_bytes=err_bytes, finished_at=finished,
            duration_s=duration))
        event = AttemptFinished(
            node=self.spec.node_id, attempt=self.spec.number, outcome=outcome,
            exit_code=exit_code, error=clean, summary=summary, fingerprint=fp,
            duration_s=duration, unsatisfied=clean_acc.unsatisfied, retry_after_s=retry_after,
            artifacts=digests)
        # Written, not synced: it rides on the next synced event (node.succeeded or
        # node.failed right after it, or the next attempt.started), so a worker does not
        # wait for a disk flush per attempt (~12% of a 1,000-node run of `true`). A kill
        # leaves the line in the page cache; only a power loss can drop it, and then the
        # attempt folds as lost and runs again.
        self.ctx.ledger.append(event, sync=False)
        return AttemptRecord(
            attempt=self.spec.number, profile=self.spec.profile, trigger=self.spec.trigger,
            outcome=outcome, exit_code=exit_code, error=clean, summary=summary,
            fingerprint=fp, duration_s=duration, unsatisfied=clean_acc.unsatisfied,
            retry_after_s=retry_after, waited_s=self.spec.waited_s, artifacts=digests)
