"""``http`` agent: any OpenAI-compatible chat-completions endpoint.

One request per attempt: a system message stating the output protocol, and the
assembled prompt as the user message. The reply goes to ``reply.md`` in the workspace;
each fenced block whose info string says ``file=<path>`` is written to that
workspace-relative path (``http_files``). The API key is read from the environment
variable the profile names and goes only into the Authorization header: it is scrubbed
from anything the agent writes.

Bounds (issue 8): one deadline, ``timeout_s``, covers the whole attempt, however slowly a
server drips its reply (``http_wire``); a body is read to at most ``MAX_BODY_BYTES`` off
the wire and again after decompression; nothing a server returns raises out of ``run``.

What failed, for the executor (issue 10, DESIGN section 10), with the provider's own
message as the one-line ``summary``:

- 401, 403: ``agent_auth``. Other 4xx, and redirects (not followed): ``agent_rejected``.
- Connection refused, DNS failure, no connection within ``CONNECT_TIMEOUT_S``:
  ``agent_unreachable``.
- 429, 529, a 5xx that says "overloaded", a 503 with ``Retry-After``, a 5xx or 408 whose
  ``Retry-After`` is longer than a blip's pause: ``rate_limited``, at once, with the
  provider's ``Retry-After`` in ``retry_after_s``: the executor waits, within the node's
  wait budget; the adapter never sleeps on a rate limit.
- Other 5xx, 408, and a connection that breaks mid-exchange: retried in the adapter at
  most ``max_retries`` times, ``BLIP_PAUSES_S`` apart (or the server's shorter
  ``Retry-After``), within the deadline; then ``agent_exit``. So is a malformed or
  oversized reply.
- A 200 whose body carries an ``error`` object, a refusal, a ``content_filter`` stop, or
  file blocks that cannot be written: ``contradictory_completion`` (exit 0 with
  ``reported_error``), naming each block and why.
"""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from email.utils import parsedate_to_datetime
from typing import Any

import httpx

from runtime.agents.base import AgentExit, Invocation
from runtime.agents.http_files import parse, show, write_blocks, write_inside
from runtime.agents.http_wire import (
    AttemptCancelled,
    BodyError,
    attempt_bounds,
    read_body,
    shared_transport,
)
from runtime.failures import FailureClass
from runtime.plan.profiles import HttpProfile

OUTPUT_PROTOCOL = (
    "Write each required artifact as a fenced code block whose info string is "
    "file=<path>, with the path relative to the workspace, for example:\n"
    "```json file=findings.json\n{...}\n```\n"
    "Fence a file that itself holds ``` lines with more backticks (````). "
    "Everything outside such blocks is kept as your reply."
)
MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_ERROR_BODY_BYTES = 64 * 1024  # an error body is read only for its message
CONNECT_TIMEOUT_S = 30.0
BLIP_PAUSES_S = (0.25, 0.5, 1.0, 2.0)  # then 2.0 s for any further retry
MAX_RETRY_AFTER_S = 86_400.0
SUMMARY_CHARS = 300

Wait = Callable[[threading.Event, float], bool]


def _wait_on(cancel: threading.Event, seconds: float) -> bool:
    return cancel.wait(seconds)


@dataclass(frozen=True)
class Reply:
    """One HTTP exchange as read: status, headers and the (bounded) decoded body."""

    status: int
    reason: str
    headers: Mapping[str, str]
    body: bytes


@dataclass(frozen=True)
class Verdict:
    """What a non-200 reply means for the attempt."""

    failure: FailureClass
    summary: str
    retry_after_s: float | None = None
    blip: bool = False  # worth a short retry within the attempt


class _Expired(Exception):
    """The attempt's deadline passed (by the agent's clock)."""


class _NoConnection(Exception):
    """No TCP (or TLS) connection within ``CONNECT_TIMEOUT_S``, with time to spare."""


class HttpAgent:
    """The ``http`` agent adapter for one profile.

    ``transport``, ``clock`` and ``wait`` are seams for tests: an ``httpx.MockTransport``, a
    fake monotonic clock, and a wait that returns at once (True when cancelled). By default:
    the process's shared deadline transport.
    """

    def __init__(self, profile: HttpProfile, *, transport: httpx.BaseTransport | None = None,
                 clock: Callable[[], float] = time.monotonic, wait: Wait = _wait_on,
                 wall: Callable[[], float] = time.time) -> None:
        self.profile = profile
        self._clock, self._wait, self._wall = clock, wait, wall
        self._client = httpx.Client(transport=transport or shared_transport(),
                                    trust_env=False, follow_redirects=False)
        self._url = profile.base_url.rstrip("/") + "/chat/completions"

    def run(self, inv: Invocation) -> AgentExit:
        """Send the attempt's prompt to the provider and write the reply's file blocks.

        The API key is read from the profile's ``api_key_env`` here, at call time, so it never
        sits in a profile, a record or a log.
        """
        key = None
        if self.profile.api_key_env:
            key = os.environ.get(self.profile.api_key_env)
            if not key:
                return AgentExit(launch_error=f"environment variable "
                                 f"{self.profile.api_key_env} is not set (api_key_env)")
            if not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
                return AgentExit(launch_error=f"the value of {self.profile.api_key_env} is "
                                 "not an API key: it holds spaces or non-printable or "
                                 "non-ASCII characters (api_key_env)")
        scrub = _Scrubber(key)
        try:
            return scrub.exit(self._run(inv, key, scrub))
        except Exception as exc:  # noqa: BLE001 - the adapter boundary: never a traceback
            # A reply this adapter did not foresee must fail the attempt, not the run.
            inv.stderr.write(scrub(traceback.format_exc()))
            return scrub.exit(AgentExit(exit_code=1, failure=FailureClass.AGENT_EXIT,
                                        summary=f"the http agent could not handle the reply: "
                                        f"{type(exc).__name__}: {exc}"))

    def _run(self, inv: Invocation, key: str | None, scrub: _Scrubber) -> AgentExit:
        deadline = self._clock() + inv.timeout_s
        try:
            reply = self._exchange(inv, key, deadline)
        except _NoConnection:
            return self._failed(inv, FailureClass.AGENT_UNREACHABLE,
                                f"no connection to {self._origin()} within "
                                f"{CONNECT_TIMEOUT_S:g} s", scrub)
        except (_Expired, httpx.TimeoutException):
            inv.stderr.write(f"http agent: no complete reply within {inv.timeout_s:g} s\n")
            return AgentExit(timed_out=True)
        except AttemptCancelled:
            return AgentExit(cancelled=True)
        except (httpx.UnsupportedProtocol, httpx.InvalidURL) as exc:
            return AgentExit(launch_error=f"base_url {self.profile.base_url!r} is not usable: "
                             f"{exc}")
        except httpx.ConnectError as exc:
            return self._failed(inv, FailureClass.AGENT_UNREACHABLE,
                                f"cannot connect to {self._origin()}: {_reason(exc)}", scrub)
        except httpx.TransportError as exc:
            return self._failed(inv, FailureClass.AGENT_EXIT,
                                f"the connection to {self._origin()} broke: {_reason(exc)}",
                                scrub)
        except BodyError as exc:
            return self._failed(inv, FailureClass.AGENT_EXIT, f"reply refused: {exc}", scrub)
        if not 200 <= reply.status < 300:
            verdict = classify(reply, self._wall())
            inv.stderr.write(scrub(f"http agent: POST {self._url} -> HTTP {reply.status}: "
                                   f"{_text(reply.body, 2000)}\n"))
            return AgentExit(exit_code=1, failure=verdict.failure, summary=verdict.summary,
                             retry_after_s=verdict.retry_after_s)
        return self._handle_body(inv, reply, scrub)

    def _exchange(self, inv: Invocation, key: str | None, deadline: float) -> Reply:
        """POST the request, retrying transient failures (never rate limits) while time remains.

        POST once, and again after a blip (5xx, 408, broken connection) while retries and
        time remain. A plain loop: the pauses are short and fixed, and a rate limit is never
        retried here.
        """
        tries = self.profile.max_retries + 1
        for n in range(1, tries + 1):
            try:
                reply = self._post(inv, key, deadline)
                why, after = f"HTTP {reply.status}", None
                if n == tries or not _is_blip(reply, self._wall()):
                    return reply
                after = retry_after(reply.headers, self._wall())
            except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError) as exc:
                if n == tries:
                    raise
                why, after = _reason(exc), None
            pause = BLIP_PAUSES_S[min(n, len(BLIP_PAUSES_S)) - 1]
            if after is not None:
                pause = max(pause, after)
            if pause >= deadline - self._clock():
                raise _Expired
            inv.stderr.write(f"http agent: {why} (try {n} of {tries}); again in {pause:g} s\n")
            if self._wait(inv.cancel, pause):
                raise AttemptCancelled
        raise AssertionError("unreachable")  # pragma: no cover

    def _post(self, inv: Invocation, key: str | None, deadline: float) -> Reply:
        remaining = deadline - self._clock()
        if remaining <= 0:
            raise _Expired
        headers = {"content-type": "application/json", "accept-encoding": "gzip, deflate"}
        if key:
            headers["authorization"] = f"Bearer {key}"
        # ASCII JSON: nothing in the prompt can fail to encode.
        payload = json.dumps({"model": self.profile.model, "messages": [
            {"role": "system", "content": OUTPUT_PROTOCOL},
            {"role": "user", "content": inv.prompt}]}).encode()
        request = self._client.build_request(
            "POST", self._url, content=payload, headers=headers,
            timeout=httpx.Timeout(remaining, connect=min(remaining, CONNECT_TIMEOUT_S)))

        def check() -> None:
            if inv.cancel.is_set():
                raise AttemptCancelled
            if self._clock() >= deadline:
                raise _Expired

        with attempt_bounds(time.monotonic() + remaining, inv.cancel):
            try:
                response = self._client.send(request, stream=True)
            except httpx.ConnectTimeout:
                if remaining > CONNECT_TIMEOUT_S:  # the connect limit, not the deadline
                    raise _NoConnection from None
                raise
            try:
                ok = 200 <= response.status_code < 300
                body = read_body(response, MAX_BODY_BYTES if ok else MAX_ERROR_BODY_BYTES,
                                 check, truncate=not ok)
            finally:
                response.close()
        return Reply(response.status_code, response.reason_phrase, response.headers,
                     bytes(body))

    def _handle_body(self, inv: Invocation, reply: Reply, scrub: _Scrubber) -> AgentExit:
        try:
            body = json.loads(reply.body)
        except (ValueError, RecursionError) as exc:
            return self._failed(inv, FailureClass.AGENT_EXIT,
                                f"malformed reply (not JSON: {_reason(exc)})", scrub,
                                detail=_text(reply.body, 2000))
        content, refusal, why = _content(body)
        if refusal is not None:
            return AgentExit(exit_code=0, summary=refusal, reported_error=refusal)
        if content is None and isinstance(body, dict) and body.get("error"):
            message = _error_message(body)
            inv.stderr.write(scrub(f"http agent: error in a 200 reply: {message}\n"))
            if _overloaded(body, message):
                return AgentExit(exit_code=1, failure=FailureClass.RATE_LIMITED,
                                 summary=message)
            return AgentExit(exit_code=0, summary=message, reported_error=(
                f"the endpoint reported an error with status 200: {message}"))
        if content is None:
            return self._failed(inv, FailureClass.AGENT_EXIT, f"malformed reply ({why})",
                                scrub, detail=_text(reply.body, 2000))
        return self._write_reply(inv, scrub(content), body)

    def _write_reply(self, inv: Invocation, content: str, body: Any) -> AgentExit:
        inv.stdout.write(content)
        data = content.encode("utf-8", "backslashreplace")
        problem = write_inside(inv.workspace, "reply.md", data)
        if problem is not None:
            inv.stderr.write(f"http agent: reply.md {problem}\n")
        parsed = parse(content)
        problems = write_blocks(inv.workspace, parsed)
        finish = body["choices"][0].get("finish_reason")
        if parsed.unclosed is not None:
            inv.stderr.write(
                f"http agent: the block for file={show(parsed.unclosed.path)} (line "
                f"{parsed.unclosed.line}) is never closed and was not written"
                + (" (the reply was cut at the model's token limit)\n"
                   if finish == "length" else "\n"))
        for p in problems:
            inv.stderr.write(f"http agent: not written: {p}\n")
        if problems:
            more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
            return AgentExit(exit_code=0, summary=f"a file block was not written: {problems[0]}",
                             reported_error="the reply's files were not all written: "
                             + "; ".join(problems[:3]) + more)
        if finish == "content_filter":
            return AgentExit(exit_code=0, summary="reply stopped by a content filter",
                             reported_error="reply stopped by a content filter")
        return AgentExit(exit_code=0)

    def _failed(self, inv: Invocation, failure: FailureClass, summary: str,
                scrub: _Scrubber, detail: str = "") -> AgentExit:
        inv.stderr.write(scrub(f"http agent: {summary}\n" + (f"{detail}\n" if detail else "")))
        return AgentExit(exit_code=1, failure=failure, summary=summary)

    def _origin(self) -> str:
        """scheme://host:port of the endpoint: never its path or credentials."""
        try:
            url = httpx.URL(self.profile.base_url)
            port = f":{url.port}" if url.port else ""
            return f"{url.scheme}://{url.host}{port}"
        except (httpx.InvalidURL, ValueError, TypeError):
            return "the endpoint"


class _Scrubber:
    def __init__(self, key: str | None) -> None:
        self.key = key

    def __call__(self, text: str) -> str:
        return text.replace(self.key, "[REDACTED:api_key]") if self.key else text

    def exit(self, result: AgentExit) -> AgentExit:
        """The key out of everything the executor records from the adapter."""
        if not self.key:
            return result
        def clean(value: str | None) -> str | None:
            return None if value is None else self(value)

        return replace(result, summary=clean(result.summary),
                       reported_error=clean(result.reported_error),
                       launch_error=clean(result.launch_error))


def _content(body: Any) -> tuple[str | None, str | None, str]:
    """``choices[0].message.content``; else a refusal (as a message); else why neither."""
    try:
        message = body["choices"][0]["message"]
        content = message.get("content")
    except (KeyError, IndexError, TypeError, AttributeError):
        return None, None, "no choices[0].message"
    if isinstance(content, str):
        return content, None, ""
    refusal = message.get("refusal")
    if isinstance(refusal, str) and refusal:
        return None, f"the model refused: {_one_line(refusal)}", ""
    return None, None, "message.content is not a string"


def classify(reply: Reply, now: float) -> Verdict:
    """The failure class and summary of a reply whose status is not 2xx."""
    status = reply.status
    message = _error_message(_json_or_none(reply.body)) or _text(reply.body, SUMMARY_CHARS)
    summary = _one_line(f"HTTP {status} {reply.reason}".strip() + (f": {message}"
                                                                     if message else ""))
    after = retry_after(reply.headers, now)
    if status in (401, 403):
        return Verdict(FailureClass.AGENT_AUTH, summary)
    if status == 429 or status == 529 or (status >= 500 and (
            _overloaded(_json_or_none(reply.body), message)
            or (status == 503 and after is not None))):
        return Verdict(FailureClass.RATE_LIMITED, summary, retry_after_s=after)
    if status == 408 or status >= 500:
        if after is not None and after > BLIP_PAUSES_S[-1]:
            # The server asks for more than a blip's pause: the executor's wait, not ours.
            return Verdict(FailureClass.RATE_LIMITED, summary, retry_after_s=after)
        return Verdict(FailureClass.AGENT_EXIT, summary, blip=True)
    if 300 <= status < 400:
        where = reply.headers.get("location", "")
        return Verdict(FailureClass.AGENT_REJECTED, _one_line(
            f"HTTP {status}: redirected to {where[:200]!r}; redirects are not followed, "
            "set base_url to the final address"))
    return Verdict(FailureClass.AGENT_REJECTED, summary)


def _is_blip(reply: Reply, now: float) -> bool:
    return not 200 <= reply.status < 300 and classify(reply, now).blip


def retry_after(headers: Mapping[str, str], now: float) -> float | None:
    """Seconds the provider asks to wait before the next request, from its headers.

    ``retry-after-ms``, else ``Retry-After`` as seconds or an HTTP date (``now`` is the wall
    clock); None when absent or unreadable.
    """
    seconds: float | None = None
    try:
        if "retry-after-ms" in headers:
            seconds = float(headers["retry-after-ms"]) / 1000
        elif "retry-after" in headers:
            value = headers["retry-after"].strip()
            try:
                seconds = float(value)
            except ValueError:
                seconds = parsedate_to_datetime(value).timestamp() - now
    except (ValueError, TypeError, IndexError, OverflowError):
        return None
    if seconds is None or seconds != seconds:  # NaN
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


def _json_or_none(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def _error_message(body: Any) -> str:
    """Extract the provider's own error message from a JSON error body.

    ``error.message`` (OpenAI, LiteLLM), a string ``error``, ``message`` or ``detail``
    (FastAPI).
    """
    if not isinstance(body, dict):
        return ""
    error = body.get("error")
    for candidate in (error.get("message") if isinstance(error, dict) else error,
                      body.get("message"), body.get("detail")):
        if isinstance(candidate, str) and candidate.strip():
            return _one_line(candidate)
    return _one_line(json.dumps(error)) if error else ""


def _overloaded(body: Any, message: str) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    kind = f"{error.get('type', '')} {error.get('code', '')}" if isinstance(error, dict) else ""
    return "overloaded" in f"{kind} {message}".lower()


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    line = line.encode("utf-8", "backslashreplace").decode("utf-8")
    return line if len(line) <= SUMMARY_CHARS else line[: SUMMARY_CHARS - 3] + "..."


def _text(body: bytes, limit: int) -> str:
    return body[:limit].decode("utf-8", "replace")


def _reason(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return _one_line(f"{type(exc).__name__}: {text}" if text != type(exc).__name__ else text)
