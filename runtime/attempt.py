"""One attempt, start to finish: check the prompt digest, prepare the workspace,
assemble the prompt (with the retry preamble when due), invoke the agent, classify the
evidence, and record ``attempt.json`` and the ledger events."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from .agents import AgentExit, Invocation, make_agent
from .assemble import RuntimeContext, assemble_prompt
from .capture import BoundedCapture
from .context import AttemptResult
from .contract import AcceptanceSummary, verify_artifacts
from .digest import blake3_hex
from .failures import FailureClass
from .feedback import fingerprint, render_preamble
from .files import replace_atomically, write_read_only
from .ledger import AttemptFinished, AttemptRecord, AttemptStarted
from .profiles import CommandProfile
from .records import AttemptContext, PriorFailure, SandboxRecord
from .redact import Redactor

if TYPE_CHECKING:
    from .execute import NodeExecutor

ERROR_LIMIT = 4096
SUMMARY_LIMIT = 200


def summarize(redactor: Redactor, hint: str | None, error: str) -> str:
    """One line a user can act on: the adapter's reading of the agent's own reason when
    it has one, else the error's first non-empty line. Redacted and bounded."""
    source = hint or next((ln for ln in error.splitlines() if ln.strip()), "")
    line = " ".join(source.split())
    return redactor.clean(line, SUMMARY_LIMIT) if line else ""


class Attempt:
    """One attempt, start to finish. Split out so each step stays small."""

    def __init__(self, owner: NodeExecutor, number: int) -> None:
        self.o = owner
        self.ctx = owner.ctx
        self.node_id, self.node, self.policy = owner.node_id, owner.node, owner.policy
        self.number = number
        self.dir = self.ctx.layout.attempt_dir(self.node_id, number)
        finished = [a for a in owner.history if a.outcome is not None]
        self.trigger: str = "retry" if finished else "initial"
        self.prior_attempt = finished[-1].attempt if finished else None
        self.profile_name = self.policy.profile_for(owner.charged())
        self.started = self.ctx.clock()

    def run(self) -> AttemptResult:
        self.dir.mkdir()
        layout = self.ctx.layout
        plan_prompt_path = layout.prompt_rendered(self.node_id)
        plan_bytes = plan_prompt_path.read_bytes()  # hashed and used: one read, no race
        actual = blake3_hex(plan_bytes)
        if actual != self.node.prompt_digest:
            error = (f"{plan_prompt_path.name} hashes to {actual}, the plan says "
                     f"{self.node.prompt_digest}: the plan was tampered with")
            self._start(prompt_digest=actual, preamble=None, prior=[])
            return self._finish(FailureClass.DIGEST_MISMATCH, None, error,
                                AcceptanceSummary(), 0, 0)
        plan_prompt = plan_bytes.decode("utf-8")
        layout.reset_workspace(self.node_id)
        inputs = layout.place_inputs(self.node_id, {
            up: [a.path for a in self.ctx.manifest.nodes[up].artifacts]
            for up in self.node.needs})
        prior = self.o.prior_failures() if self.trigger == "retry" else []
        preamble = None
        if self.policy.retry_feedback and self.trigger == "retry" and prior:
            preamble = render_preamble(self.number, self.policy.ceiling, prior,
                                       self.policy.feedback_max_bytes)
        prompt = assemble_prompt(
            RuntimeContext(
                topology=self.ctx.manifest.topology.name, node=self.node_id,
                artifacts=[(a.path, a.kind, a.required) for a in self.node.artifacts],
                inputs=inputs),
            plan_prompt, operator_prompt=self.ctx.settings.operator_prompt, preamble=preamble)
        prompt_bytes = prompt.encode()
        write_read_only(self.dir / "prompt.md", prompt_bytes)
        self._start(prompt_digest=blake3_hex(prompt_bytes), preamble=preamble, prior=prior)
        return self._invoke(prompt)

    def _context(self, **outcome: object) -> AttemptContext:
        return AttemptContext(
            run_id=self.ctx.run_id, node=self.node_id, attempt=self.number,
            max_attempts=self.policy.ceiling, trigger=self.trigger,  # type: ignore[arg-type]
            prior_attempt=self.prior_attempt, profile=self.profile_name,
            profile_digest=self.ctx.profile_digest(self.profile_name),
            plan_prompt_digest=self.node.prompt_digest, prompt_digest=self._prompt_digest,
            preamble_digest=self._preamble_digest, prior_failures=self._prior,
            sandbox=self._sandbox(), started_at=self.started, **outcome)  # type: ignore[arg-type]

    def _sandbox(self) -> SandboxRecord | None:
        from .agents.sandbox import find_bubblewrap

        profile = self.ctx.manifest.agents[self.profile_name]
        if not isinstance(profile, CommandProfile):
            return None
        if profile.sandbox is False:
            return SandboxRecord(enabled=False)
        bwrap = find_bubblewrap()
        return SandboxRecord(enabled=True, bubblewrap=bwrap.version if bwrap else None,
                             network=profile.sandbox.network)

    def _write_context(self, ctx: AttemptContext) -> None:
        data = (ctx.model_dump_json(indent=2) + "\n").encode()
        target = self.dir / "attempt.json"
        if ctx.outcome is None:  # the first write creates the file: nothing to replace
            target.write_bytes(data)
            return
        replace_atomically(target, data)

    def _start(self, *, prompt_digest: str, preamble: str | None,
               prior: list[PriorFailure]) -> None:
        self._prompt_digest = prompt_digest
        self._preamble_digest = blake3_hex(preamble.encode()) if preamble else None
        self._prior = prior
        self._write_context(self._context())
        self.ctx.ledger.append(AttemptStarted(
            node=self.node_id, attempt=self.number, profile=self.profile_name,
            trigger=self.trigger,  # type: ignore[arg-type]
            prior_attempt=self.prior_attempt, prompt_digest=prompt_digest,
            preamble_digest=self._preamble_digest))
        self.o.history.append(AttemptRecord(attempt=self.number, profile=self.profile_name,
                                            trigger=self.trigger))  # type: ignore[arg-type]

    def _invoke(self, prompt: str) -> AttemptResult:
        stdout = BoundedCapture(self.dir / "stdout.log")
        stderr = BoundedCapture(self.dir / "stderr.log")
        # Absolute: the agent's cwd is its workspace, so relative paths would not resolve.
        ws = self.ctx.layout.workspace(self.node_id).absolute()
        timeout = self.policy.timeout_s
        if self.ctx.settings.deadline_at is not None:
            timeout = max(0.001, min(timeout, self.ctx.settings.deadline_at - self.ctx.clock()))
        inv = Invocation(
            run_id=self.ctx.run_id, node=self.node_id, attempt=self.number,
            max_attempts=self.policy.ceiling, prompt=prompt,
            prompt_file=self.dir.absolute() / "prompt.md", workspace=ws, timeout_s=timeout,
            env=self._env(ws), artifacts=tuple(self.node.artifacts), stdout=stdout,
            stderr=stderr, cancel=self.ctx.cancel, attempt_dir=self.dir.absolute())
        try:
            agent = make_agent(self.ctx.manifest.agents[self.profile_name])
            exit_ = agent.run(inv)
        finally:
            stdout.close()
            stderr.close()
        failure, error = self._classify(exit_, stderr, timeout)
        self._summary_hint = exit_.summary
        acceptance = AcceptanceSummary()
        if failure not in (FailureClass.LAUNCH_ERROR, FailureClass.CANCELLED):
            acceptance = verify_artifacts(ws, list(self.node.artifacts),
                                          list(self.node.acceptance))
            if failure is None and acceptance.unsatisfied:
                failure, error = FailureClass.ARTIFACT_CONTRACT, "\n".join(acceptance.unsatisfied)
        return self._finish(failure, exit_.exit_code, error, acceptance, stdout.total,
                            stderr.total)

    def _env(self, ws: Path) -> Mapping[str, str]:
        return {
            "RUNTIME_RUN_ID": self.ctx.run_id, "RUNTIME_NODE": self.node_id,
            "RUNTIME_ATTEMPT": str(self.number),
            "RUNTIME_MAX_ATTEMPTS": str(self.policy.ceiling),
            "RUNTIME_WORKSPACE": str(ws),
            "RUNTIME_PROMPT_FILE": str(self.dir.absolute() / "prompt.md"),
            "RUNTIME_ATTEMPT_CONTEXT": str(self.dir.absolute() / "attempt.json"),
        }

    def _classify(self, exit_: AgentExit, stderr: BoundedCapture, timeout: float,
                  ) -> tuple[FailureClass | None, str]:
        tail = stderr.tail_text(ERROR_LIMIT)
        if exit_.launch_error is not None:
            return FailureClass.LAUNCH_ERROR, exit_.launch_error
        if exit_.cancelled:
            return FailureClass.CANCELLED, "cancelled by the operator"
        if exit_.timed_out:
            return FailureClass.AGENT_TIMEOUT, f"timed out after {timeout:g} s\n{tail}".strip()
        if exit_.failure is not None:  # the adapter recognised the agent's own reason
            head = exit_.summary or exit_.reported_error or f"exit status {exit_.exit_code}"
            return exit_.failure, f"{head}\n{tail}".strip()
        if exit_.exit_code != 0:
            return FailureClass.AGENT_EXIT, f"exit status {exit_.exit_code}\n{tail}".strip()
        if exit_.reported_error is not None:
            return FailureClass.CONTRADICTORY_COMPLETION, exit_.reported_error
        return None, ""

    def _finish(self, failure: FailureClass | None, exit_code: int | None, error: str,
                acceptance: AcceptanceSummary, out_bytes: int, err_bytes: int,
                ) -> AttemptResult:
        finished = self.ctx.clock()
        duration = round(finished - self.started, 6)
        clean = self.ctx.redactor.clean(error, ERROR_LIMIT) if error else ""
        clean_acc = AcceptanceSummary(
            satisfied=acceptance.satisfied, unknown=acceptance.unknown,
            unsatisfied=[self.ctx.redactor.clean(u, 1024) for u in acceptance.unsatisfied])
        fp = fingerprint(failure, clean) if failure is not None else None
        summary = summarize(self.ctx.redactor, getattr(self, "_summary_hint", None), clean) \
            if failure is not None else ""
        outcome: Literal["succeeded"] | FailureClass = "succeeded" if failure is None else failure
        self._write_context(self._context(
            outcome=outcome, failure_classes=[failure] if failure else [],
            exit_code=exit_code, error=clean, summary=summary, acceptance=clean_acc,
            stdout_bytes=out_bytes,
            stderr_bytes=err_bytes, finished_at=finished, duration_s=duration))
        self.ctx.ledger.append(AttemptFinished(
            node=self.node_id, attempt=self.number, outcome=outcome, exit_code=exit_code,
            error=clean, summary=summary, fingerprint=fp, duration_s=duration),
            sync=False)  # the next event, synced before anything acts on this one, covers it
        self.o.history[-1] = self.o.history[-1].model_copy(update={
            "outcome": outcome, "exit_code": exit_code, "error": clean, "summary": summary,
            "fingerprint": fp,
            "duration_s": duration})
        return AttemptResult(outcome=failure, number=self.number)
