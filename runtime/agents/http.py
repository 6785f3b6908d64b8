"""``http`` agent: any OpenAI-compatible chat-completions endpoint.

One request per attempt: a system message stating the output protocol, and the
assembled prompt as the user message. 429 and 5xx replies and transport errors are
retried with exponential backoff (tenacity), honouring ``Retry-After``, within the
attempt's timeout and cancel event. The reply goes to ``reply.md`` in the workspace;
each fenced block whose info string says ``file=<path>`` is written to that
workspace-relative path (paths that escape the workspace are refused). The API key is
read from the environment variable the profile names and goes only into the
Authorization header: it is scrubbed from anything the agent writes.

Contradictory completion: a 200 reply whose body carries an ``error`` object, or whose
``finish_reason`` is ``content_filter``, is a terminal error reported with success.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import httpx
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt

from ..files import within
from ..profiles import HttpProfile
from ..topology import check_relative_path
from . import AgentExit, Invocation

OUTPUT_PROTOCOL = (
    "Write each required artifact as a fenced code block whose info string is "
    "file=<path>, with the path relative to the workspace, for example:\n"
    "```json file=findings.json\n{...}\n```\n"
    "Everything outside such blocks is kept as your reply."
)
FENCE = re.compile(r"^```[^\n`]*?\bfile=([^\s`]+)[^\n]*\n(.*?)\n```[ \t]*$", re.S | re.M)
MAX_BACKOFF_S = 8.0


class RetryableStatus(Exception):
    def __init__(self, response: httpx.Response) -> None:
        super().__init__(f"HTTP {response.status_code}")
        self.response = response


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, RetryableStatus | httpx.TransportError) and not isinstance(
        exc, httpx.TimeoutException)


class HttpAgent:
    def __init__(self, profile: HttpProfile) -> None:
        self.profile = profile

    def run(self, inv: Invocation) -> AgentExit:
        key = None
        if self.profile.api_key_env:
            key = os.environ.get(self.profile.api_key_env)
            if not key:
                return AgentExit(launch_error=f"environment variable "
                                 f"{self.profile.api_key_env} is not set (api_key_env)")
        scrub = _Scrubber(key)
        deadline = time.monotonic() + inv.timeout_s
        try:
            body = self._post(inv, key, deadline)
        except httpx.TimeoutException:
            inv.stderr.write(f"http agent: no reply within {inv.timeout_s:g} s\n")
            return AgentExit(timed_out=True)
        except _Cancelled:
            return AgentExit(cancelled=True)
        except RetryableStatus as exc:
            inv.stderr.write(scrub(f"http agent: {exc} after {self.profile.max_retries + 1} "
                                   f"tries: {exc.response.text[:2000]}\n"))
            return AgentExit(exit_code=1)
        except httpx.HTTPStatusError as exc:
            inv.stderr.write(scrub(f"http agent: HTTP {exc.response.status_code}: "
                                   f"{exc.response.text[:2000]}\n"))
            return AgentExit(exit_code=1)
        except httpx.HTTPError as exc:
            inv.stderr.write(scrub(f"http agent: {type(exc).__name__}: {exc}\n"))
            return AgentExit(exit_code=1)
        try:
            parsed = body.json()
        except ValueError as exc:
            inv.stderr.write(scrub(f"http agent: malformed reply (not JSON: {exc}): "
                                   f"{body.text[:2000]}\n"))
            return AgentExit(exit_code=1)
        return self._handle_body(inv, parsed, scrub)

    def _post(self, inv: Invocation, key: str | None, deadline: float) -> httpx.Response:
        url = self.profile.base_url.rstrip("/") + "/chat/completions"
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        payload = {"model": self.profile.model, "messages": [
            {"role": "system", "content": OUTPUT_PROTOCOL},
            {"role": "user", "content": inv.prompt}]}

        def sleep(seconds: float) -> None:
            if inv.cancel.wait(min(seconds, max(deadline - time.monotonic(), 0))):
                raise _Cancelled
            if time.monotonic() >= deadline:
                raise httpx.TimeoutException("attempt timeout reached while backing off")

        retrying = Retrying(
            retry=retry_if_exception(_retryable),
            stop=stop_after_attempt(self.profile.max_retries + 1),
            wait=_wait_retry_after, sleep=sleep, reraise=True)
        with httpx.Client(trust_env=False) as client:
            for attempt in retrying:
                with attempt:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise httpx.TimeoutException("attempt timeout reached")
                    response = client.post(url, json=payload, headers=headers,
                                           timeout=httpx.Timeout(remaining))
                    if response.status_code == 429 or response.status_code >= 500:
                        raise RetryableStatus(response)
                    response.raise_for_status()
                    return response
        raise AssertionError("unreachable")  # pragma: no cover

    def _handle_body(self, inv: Invocation, body: Any, scrub: _Scrubber) -> AgentExit:
        try:
            choice = body["choices"][0]
            content = choice["message"]["content"]
            if not isinstance(content, str):
                raise TypeError("message.content is not a string")
        except (KeyError, IndexError, TypeError) as exc:
            if isinstance(body, dict) and body.get("error"):
                inv.stderr.write(scrub(f"http agent: error in reply: "
                                       f"{json.dumps(body['error'])[:2000]}\n"))
                return AgentExit(exit_code=0, reported_error=scrub(
                    f"endpoint reported an error: {json.dumps(body['error'])[:500]}"))
            inv.stderr.write(scrub(f"http agent: malformed reply ({exc}): "
                                   f"{json.dumps(body)[:2000]}\n"))
            return AgentExit(exit_code=1)
        content = scrub(content)
        (inv.workspace / "reply.md").write_text(content)
        inv.stdout.write(content)
        for rel, text in FENCE.findall(content):
            target = _inside(inv.workspace, rel)
            if target is None:
                inv.stderr.write(f"http agent: refused to write {rel!r}: outside the "
                                 "workspace\n")
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text + "\n")
        if choice.get("finish_reason") == "content_filter":
            return AgentExit(exit_code=0, reported_error="reply stopped by a content filter")
        return AgentExit(exit_code=0)


class _Cancelled(Exception):
    pass


class _Scrubber:
    def __init__(self, key: str | None) -> None:
        self.key = key

    def __call__(self, text: str) -> str:
        return text.replace(self.key, "[REDACTED:api_key]") if self.key else text


def _wait_retry_after(state: RetryCallState) -> float:
    exc = state.outcome.exception() if state.outcome else None
    if isinstance(exc, RetryableStatus):
        header = exc.response.headers.get("retry-after", "")
        if header.replace(".", "", 1).isdigit():
            return min(float(header), MAX_BACKOFF_S)
    return float(min(0.25 * 2 ** (state.attempt_number - 1), MAX_BACKOFF_S))


def _inside(workspace: Path, rel: str) -> Path | None:
    """Where a reply's ``file=<path>`` block may be written: the same rules as a
    declared artifact path, and no symlink out of the workspace."""
    try:
        check_relative_path(rel)
    except ValueError:
        return None
    real = within(workspace, rel)
    return Path(real) if real is not None else None
