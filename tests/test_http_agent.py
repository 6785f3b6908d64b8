"""The http agent through ``httpx.MockTransport``, a fake clock and a recorded wait; replies
recorded from a real LiteLLM proxy (tests/fixtures/http, benchmarks/record_http_fixtures.py);
and one end-to-end run against a real local server."""

from __future__ import annotations

import gzip
import json
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpcore
import httpx
import pytest

from runtime.agents.base import AgentExit, Invocation
from runtime.agents.capture import BoundedCapture
from runtime.agents.http import HttpAgent, Reply, classify, retry_after
from runtime.agents.http_wire import (
    POLL_S,
    AttemptCancelled,
    DeadlineBackend,
    DeadlineStream,
    DeadlineTransport,
    attempt_bounds,
)
from runtime.failures import FailureClass
from runtime.plan.profiles import HttpProfile
from runtime.plan.topology import ArtifactSpec

KEY = "sk-test-" + "k3y" * 10
FIXTURES = Path(__file__).parent / "fixtures" / "http"
Handler = Callable[[httpx.Request], httpx.Response]


def completion(content: str | None, **choice: Any) -> dict[str, Any]:
    return {"id": "x", "choices": [{"index": 0, "message": {"role": "assistant",
                                                            "content": content}, **choice}]}


def streamed(status: int, data: bytes, headers: dict[str, str] | None = None,
             ) -> httpx.Response:
    """A reply read off the transport chunk by chunk, as from a socket."""
    return httpx.Response(status, headers=headers, content=iter([data[:7], data[7:]]))


def ok(content: str, **choice: Any) -> httpx.Response:
    return httpx.Response(200, json=completion(content, **choice))


class Clock:
    """A monotonic clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Harness:
    tmp: Path
    clock: Clock = field(default_factory=Clock)
    requests: list[httpx.Request] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    cancel_on_wait: bool = False

    def wait(self, cancel: threading.Event, seconds: float) -> bool:
        self.waits.append(seconds)
        self.clock.now += seconds
        if self.cancel_on_wait:
            cancel.set()
        return cancel.is_set()

    def run(self, script: Sequence[httpx.Response | Exception] | Handler, *,
            timeout: float = 60.0, retries: int = 3, base_url: str = "http://llm.test/v1",
            ) -> tuple[AgentExit, Invocation]:
        replies = script if callable(script) else list(script)

        def handler(request: httpx.Request) -> httpx.Response:
            self.requests.append(request)
            if callable(replies):
                return replies(request)
            reply = replies.pop(0)
            if isinstance(reply, Exception):
                raise reply
            return reply

        ws = self.tmp / "ws"
        ws.mkdir(exist_ok=True)
        out, err = BoundedCapture(self.tmp / "out.log"), BoundedCapture(self.tmp / "err.log")
        inv = Invocation(run_id="r", node="n", attempt=1, max_attempts=1, prompt="Audit it.",
                         prompt_file=self.tmp / "p.md", workspace=ws, timeout_s=timeout,
                         env={}, artifacts=(ArtifactSpec(path="findings.json", kind="json"),),
                         stdout=out, stderr=err)
        agent = HttpAgent(HttpProfile(kind="http", base_url=base_url, model="m-1",
                                      api_key_env="TEST_LLM_KEY", max_retries=retries),
                          transport=httpx.MockTransport(handler), clock=self.clock,
                          wait=self.wait, wall=lambda: 1_000_000.0)
        try:
            return agent.run(inv), inv
        finally:
            out.close()
            err.close()

    def stderr(self) -> str:
        return (self.tmp / "err.log").read_text()


@pytest.fixture
def h(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Harness:
    monkeypatch.setenv("TEST_LLM_KEY", KEY)
    return Harness(tmp_path)


# ---- success -----------------------------------------------------------------------

def test_reply_and_artifacts_are_written(h: Harness) -> None:
    result, inv = h.run([ok('Done.\n```json file=findings.json\n{"ok": true}\n```\n')])
    assert result == AgentExit(exit_code=0)
    assert json.loads((inv.workspace / "findings.json").read_text()) == {"ok": True}
    assert (inv.workspace / "reply.md").read_text().startswith("Done.")
    req = h.requests[0]
    assert str(req.url) == "http://llm.test/v1/chat/completions"
    assert req.headers["authorization"] == f"Bearer {KEY}"
    assert req.headers["accept-encoding"] == "gzip, deflate"
    body = json.loads(req.content)
    assert body["model"] == "m-1"
    assert body["messages"][-1] == {"role": "user", "content": "Audit it."}


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "raw-deflate"])
def test_compressed_replies_are_decoded(h: Harness, encoding: str) -> None:
    raw = json.dumps(completion("```json file=findings.json\n{}\n```")).encode()
    if encoding == "gzip":
        data = gzip.compress(raw)
    elif encoding == "deflate":
        data = zlib.compress(raw)
    else:
        c = zlib.compressobj(wbits=-zlib.MAX_WBITS)
        data, encoding = c.compress(raw) + c.flush(), "deflate"
    result, inv = h.run([streamed(200, data, {"content-encoding": encoding})])
    assert result.exit_code == 0
    assert (inv.workspace / "findings.json").exists()


# ---- recorded LiteLLM replies -----------------------------------------------------------

def recorded(name: str) -> httpx.Response | Exception:
    data = json.loads((FIXTURES / f"{name}.json").read_text())
    if "transport_error" in data:
        error = data["transport_error"]
        exc: Exception = getattr(httpx, error["type"])(error["message"])
        return exc
    r = data["response"]
    return streamed(r["status"], r["body"].encode(), r["headers"])


@pytest.mark.parametrize(("name", "failure", "summary", "after"), [
    ("unauthorized", FailureClass.AGENT_AUTH,
     "HTTP 401 Unauthorized: Authentication Error, invalid api key", None),
    ("unknown_model", FailureClass.AGENT_REJECTED,
     "HTTP 400 Bad Request: /chat/completions: Invalid model name passed in "
     "model=no-such-model. Call `/v1/models` to view available models for your key.", None),
    ("rate_limited", FailureClass.RATE_LIMITED,
     "HTTP 429 Too Many Requests: litellm.RateLimitError: this is a mock rate limit error "
     "LiteLLM: model group 'mock-429' failed with the error above. No fallback was "
     "attempted.", None),
    ("rate_limited_retry_after", FailureClass.RATE_LIMITED,
     "HTTP 429 Too Many Requests: No deployments available for selected model, Try again "
     "in 30 seconds.", 30.0),
    ("connection_refused", FailureClass.AGENT_UNREACHABLE,
     "cannot connect to http://llm.test: ConnectError: [Errno 111] Connection refused", None),
])
def test_recorded_failures_are_classified_at_once(
        h: Harness, name: str, failure: FailureClass, summary: str, after: float | None,
        ) -> None:
    result, _ = h.run([recorded(name)])
    assert result.failure is failure
    assert result.exit_code == 1
    assert result.summary is not None
    assert result.summary.startswith(summary)
    assert "\n" not in result.summary
    assert len(result.summary) <= 300
    assert result.retry_after_s == after
    assert len(h.requests) == 1
    assert h.waits == []  # no retry, no sleep in the adapter


def test_recorded_success(h: Harness) -> None:
    result, inv = h.run([recorded("ok")])
    assert result == AgentExit(exit_code=0)
    assert json.loads((inv.workspace / "findings.json").read_text()) == {"ok": True}


def test_recorded_server_error_is_retried_briefly_then_agent_exit(h: Harness) -> None:
    result, _ = h.run([recorded("server_error") for _ in range(4)], retries=3)
    assert result.failure is FailureClass.AGENT_EXIT
    assert result.summary is not None
    assert result.summary.startswith(
        "HTTP 500 Internal Server Error: litellm.InternalServerError: this is a mock")
    assert len(h.requests) == 4
    assert h.waits == [0.25, 0.5, 1.0]
    assert "HTTP 500 (try 1 of 4); again in 0.25 s" in h.stderr()


# ---- classification ---------------------------------------------------------------------

def reply(status: int, body: Any = b"", **headers: str) -> Reply:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return Reply(status, httpx.codes.get_reason_phrase(status), httpx.Headers(headers), data)


@pytest.mark.parametrize(("r", "failure", "blip", "summary"), [
    (reply(403, {"error": {"message": "no access"}}), FailureClass.AGENT_AUTH, False,
     "HTTP 403 Forbidden: no access"),
    (reply(404, b"<html>\n<h1>Not Found</h1></html>"), FailureClass.AGENT_REJECTED, False,
     "HTTP 404 Not Found: <html> <h1>Not Found</h1></html>"),
    (reply(422, {"detail": "messages: field required"}), FailureClass.AGENT_REJECTED, False,
     "HTTP 422 Unprocessable Entity: messages: field required"),
    (reply(400, {"error": "bad"}), FailureClass.AGENT_REJECTED, False,
     "HTTP 400 Bad Request: bad"),
    (reply(408), FailureClass.AGENT_EXIT, True, "HTTP 408 Request Timeout"),
    (reply(502, b"bad gateway"), FailureClass.AGENT_EXIT, True,
     "HTTP 502 Bad Gateway: bad gateway"),
    (reply(529, {"error": {"type": "overloaded_error", "message": "Overloaded"}}),
     FailureClass.RATE_LIMITED, False, "HTTP 529: Overloaded"),
    (reply(500, {"error": {"message": "The engine is currently overloaded"}}),
     FailureClass.RATE_LIMITED, False, "HTTP 500 Internal Server Error: The engine is "
     "currently overloaded"),
    (reply(503, b"", **{"retry-after": "7"}), FailureClass.RATE_LIMITED, False,
     "HTTP 503 Service Unavailable"),
    (reply(302, b"", location="https://elsewhere.test/v1"), FailureClass.AGENT_REJECTED,
     False, "HTTP 302: redirected to 'https://elsewhere.test/v1'; redirects are not "
     "followed, set base_url to the final address"),
])
def test_classify(r: Reply, failure: FailureClass, blip: bool, summary: str) -> None:
    verdict = classify(r, 0.0)
    assert (verdict.failure, verdict.blip, verdict.summary) == (failure, blip, summary)


@pytest.mark.parametrize(("headers", "expected"), [
    ({"retry-after": "12"}, 12.0),
    ({"retry-after": "1.5"}, 1.5),
    ({"retry-after-ms": "250", "retry-after": "9"}, 0.25),
    ({"retry-after": "Thu, 01 Jan 1970 00:01:40 GMT"}, 40.0),  # now = 60
    ({"retry-after": "Thu, 01 Jan 1970 00:00:00 GMT"}, 0.0),
    ({"retry-after": "-5"}, 0.0),
    ({"retry-after": "1e12"}, 86_400.0),
    ({"retry-after": "nan"}, None),
    ({"retry-after": "soon"}, None),
    ({}, None),
])
def test_retry_after(headers: dict[str, str], expected: float | None) -> None:
    assert retry_after(httpx.Headers(headers), 60.0) == expected


def test_a_429_storm_costs_one_request(h: Harness) -> None:
    storm = [httpx.Response(429, json={"error": {"message": "slow down"}},
                            headers={"retry-after": "20"})] * 16
    result, _ = h.run(storm)
    assert result.failure is FailureClass.RATE_LIMITED
    assert result.retry_after_s == 20.0
    assert len(h.requests) == 1
    assert h.waits == []


@pytest.mark.parametrize("blip", [httpx.ReadError("reset by peer"),
                                  httpx.RemoteProtocolError("Server disconnected"),
                                  httpx.Response(502, text="bad gateway")])
def test_blips_are_retried_within_the_attempt(h: Harness,
                                               blip: httpx.Response | Exception) -> None:
    result, _ = h.run([blip, ok("```json file=findings.json\n{}\n```")])
    assert result.exit_code == 0
    assert len(h.requests) == 2
    assert h.waits == [0.25]


def test_a_blip_pause_honours_a_short_retry_after(h: Harness) -> None:
    result, _ = h.run([httpx.Response(502, headers={"retry-after": "1.5"}), ok("x")])
    assert result.exit_code == 0
    assert h.waits == [1.5]


def test_a_long_retry_after_on_a_5xx_goes_to_the_executor(h: Harness) -> None:
    result, _ = h.run([httpx.Response(502, headers={"retry-after": "120"}), ok("x")])
    assert result.failure is FailureClass.RATE_LIMITED
    assert result.retry_after_s == 120.0
    assert h.waits == []
    assert len(h.requests) == 1


def test_a_broken_connection_after_the_retries_is_agent_exit(h: Harness) -> None:
    result, _ = h.run([httpx.ReadError("reset by peer")] * 2, retries=1)
    assert result.failure is FailureClass.AGENT_EXIT
    assert result.summary == "the connection to http://llm.test broke: ReadError: reset by peer"


def test_no_retry_when_the_pause_would_pass_the_deadline(h: Harness) -> None:
    result, _ = h.run([httpx.Response(503, text="down")] * 2, timeout=0.2)
    assert result.timed_out
    assert h.waits == []
    assert len(h.requests) == 1


def test_a_cancel_during_a_pause_cancels(h: Harness) -> None:
    h.cancel_on_wait = True
    result, _ = h.run([httpx.Response(503, text="down"), ok("x")])
    assert result.cancelled
    assert len(h.requests) == 1


def test_a_connect_timeout_with_time_left_is_unreachable(h: Harness) -> None:
    result, _ = h.run([httpx.ConnectTimeout("timed out")], timeout=600)
    assert result.failure is FailureClass.AGENT_UNREACHABLE
    assert result.summary == "no connection to http://llm.test within 30 s"


def test_a_dns_failure_is_unreachable(h: Harness) -> None:
    result, _ = h.run([httpx.ConnectError("[Errno -2] Name or service not known")])
    assert result.failure is FailureClass.AGENT_UNREACHABLE
    assert "Name or service not known" in (result.summary or "")


# ---- bounds: time, bytes ------------------------------------------------------------------

def drip(clock: Clock, chunks: int, step: float) -> Iterator[bytes]:
    yield b'{"choices": [{"message": {"content": "'
    for _ in range(chunks):
        clock.now += step
        yield b"x"
    yield b'"}}]}'


def test_a_dripping_reply_ends_at_the_attempt_deadline(h: Harness) -> None:
    sent: list[int] = []

    def handler(_: httpx.Request) -> httpx.Response:
        def body() -> Iterator[bytes]:
            for chunk in drip(h.clock, 1000, 1.0):
                sent.append(1)
                yield chunk
        return httpx.Response(200, content=body())

    result, _ = h.run(handler, timeout=5.0)
    assert result.timed_out
    assert len(sent) <= 7
    assert "no complete reply within 5 s" in h.stderr()


def test_an_oversized_reply_is_refused_by_its_length(h: Harness) -> None:
    result, _ = h.run([streamed(200, b"x", {"content-length": str(400 << 20)})])
    assert result.failure is FailureClass.AGENT_EXIT
    assert result.summary == ("reply refused: the reply announces 419430400 bytes; the cap "
                              "is 16777216")


def test_an_oversized_streamed_reply_stops_at_the_cap(h: Harness) -> None:
    pulled: list[int] = []

    def body() -> Iterator[bytes]:
        for _ in range(400):  # 400 MiB, if anyone read it all
            pulled.append(1)
            yield b"x" * (1 << 20)

    result, _ = h.run([httpx.Response(200, content=body())])
    assert result.summary == "reply refused: the reply is larger than 16777216 bytes on the wire"
    assert len(pulled) == 17


def test_a_gzip_bomb_stops_at_the_cap(h: Harness) -> None:
    bomb = gzip.compress(b"\0" * (20 << 20), 1)  # ~90 KB on the wire
    result, _ = h.run([streamed(200, bomb, {"content-encoding": "gzip"})])
    assert result.summary == ("reply refused: the reply is larger than 16777216 bytes after "
                              "decompression")


@pytest.mark.parametrize(("encoding", "content", "summary"), [
    ("br", b"x", "reply refused: content-encoding 'br' is not supported (the agent asks for "
     "gzip or deflate)"),
    ("gzip, gzip", b"x", "reply refused: content-encoding 'gzip, gzip' is not supported"),
    ("gzip", b"\x1f\x8bnot gzip at all", "reply refused: the gzip body is corrupt"),
    ("gzip", gzip.compress(b"{}" * 100)[:20], "reply refused: the gzip body ends before"),
])
def test_bad_encodings(h: Harness, encoding: str, content: bytes, summary: str) -> None:
    result, _ = h.run([streamed(200, content, {"content-encoding": encoding})])
    assert result.failure is FailureClass.AGENT_EXIT
    assert (result.summary or "").startswith(summary)


def test_an_error_body_is_read_only_to_its_cap(h: Harness) -> None:
    big = b'{"error": {"message": "' + b"y" * (1 << 20) + b'"}}'
    result, _ = h.run([streamed(400, big)])
    assert result.failure is FailureClass.AGENT_REJECTED
    assert (result.summary or "").startswith('HTTP 400 Bad Request: {"error": {"message": "yyy')


# ---- what a reply says --------------------------------------------------------------------

@pytest.mark.parametrize(("body", "summary"), [
    (b"<html>gateway</html>", "malformed reply (not JSON: JSONDecodeError: Expecting value"),
    (b"\xff\xfe\x00", "malformed reply (not JSON: UnicodeDecodeError"),
    (b"[" * 200_000, "malformed reply (not JSON: RecursionError"),
    (b'{"choices": []}', "malformed reply (no choices[0].message)"),
    (b'{"choices": [{"message": "hi"}]}', "malformed reply (no choices[0].message)"),
    (b'{"choices": [{"message": {"content": null}}]}',
     "malformed reply (message.content is not a string)"),
    (b"[1, 2]", "malformed reply (no choices[0].message)"),
])
def test_malformed_bodies(h: Harness, body: bytes, summary: str) -> None:
    result, _ = h.run([httpx.Response(200, content=body)])
    assert result.failure is FailureClass.AGENT_EXIT
    assert result.exit_code == 1
    assert (result.summary or "").startswith(summary)


def test_an_error_object_with_200_is_contradictory(h: Harness) -> None:
    result, _ = h.run([httpx.Response(200, json={"error": {"message": "context length "
                                                                     "exceeded"}})])
    assert result.exit_code == 0
    assert result.failure is None
    assert result.reported_error == ("the endpoint reported an error with status 200: "
                                     "context length exceeded")
    assert result.summary == "context length exceeded"


def test_an_overloaded_error_with_200_is_rate_limited(h: Harness) -> None:
    result, _ = h.run([httpx.Response(200, json={"error": {"type": "overloaded_error",
                                                           "message": "busy"}})])
    assert result.failure is FailureClass.RATE_LIMITED


def test_a_refusal_is_contradictory(h: Harness) -> None:
    body = {"choices": [{"message": {"content": None, "refusal": "I can't help."}}]}
    result, _ = h.run([httpx.Response(200, json=body)])
    assert result.exit_code == 0
    assert result.reported_error == "the model refused: I can't help."


def test_a_content_filter_stop_is_contradictory(h: Harness) -> None:
    result, _ = h.run([ok("partial", finish_reason="content_filter")])
    assert result.reported_error == "reply stopped by a content filter"


def test_a_reply_cut_at_the_token_limit_says_so(h: Harness) -> None:
    result, inv = h.run([ok("```json file=findings.json\n{\"a\": ", finish_reason="length")])
    assert result == AgentExit(exit_code=0)  # the contract then names the missing file
    assert not (inv.workspace / "findings.json").exists()
    assert ("the block for file='findings.json' (line 1) is never closed and was not "
            "written (the reply was cut at the model's token limit)") in h.stderr()


@pytest.mark.parametrize(("content", "problem"), [
    ("```txt file=a\n1\n```\n```txt file=a/\n2\n```\n",
     "file='a/' (line 4): must name a file: no empty or '.' parts, no trailing '/'"),
    ("```txt file=" + "n" * 300 + "\nx\n```\n", "has a part longer than 255 bytes"),
    ("```txt file=a.txt\n\ud800\n```\n", "file='a.txt' (line 1): its text holds a lone "
     "surrogate"),
    ("```txt file=\ud800.txt\nx\n```\n", "file='\\ud800.txt' (line 1): is not valid Unicode"),
    ("```md file=../../escape.md\nnope\n```\n", "'..' escapes the root"),
])
def test_model_text_that_cannot_be_written_is_contradictory(
        h: Harness, content: str, problem: str) -> None:
    result, inv = h.run([httpx.Response(200, content=json.dumps(completion(content)).encode())])
    assert result.exit_code == 0
    assert result.failure is None
    assert result.reported_error is not None
    assert problem in result.reported_error
    assert result.reported_error.startswith("the reply's files were not all written: ")
    assert (inv.workspace / "reply.md").exists()
    assert not (inv.workspace.parent.parent / "escape.md").exists()


def test_a_lone_surrogate_outside_blocks_is_kept_escaped(h: Harness) -> None:
    content = json.dumps(completion("note \ud800\n```json file=findings.json\n{}\n```\n"))
    result, inv = h.run([httpx.Response(200, content=content.encode())])
    assert result == AgentExit(exit_code=0)
    assert "note \\ud800" in (inv.workspace / "reply.md").read_text()


def test_the_key_never_leaks(h: Harness) -> None:
    result, _ = h.run([httpx.Response(401, json={"error": {"message": f"bad key {KEY}"}})])
    assert result.failure is FailureClass.AGENT_AUTH
    assert result.summary == "HTTP 401 Unauthorized: bad key [REDACTED:api_key]"
    assert KEY not in h.stderr()
    assert "[REDACTED:api_key]" in h.stderr()


def test_the_key_is_scrubbed_from_the_reply(h: Harness) -> None:
    result, inv = h.run([ok(f"echo {KEY}\n```json file=findings.json\n{{\"k\": \"{KEY}\"}}\n```")])
    assert result.exit_code == 0
    for name in ("reply.md", "findings.json"):
        assert KEY not in (inv.workspace / name).read_text()


@pytest.mark.parametrize(("value", "message"), [
    (None, "environment variable TEST_LLM_KEY is not set (api_key_env)"),
    ("sk-abc\nInjected: 1", "the value of TEST_LLM_KEY is not an API key: it holds spaces"),
    ("sk-é", "the value of TEST_LLM_KEY is not an API key"),
])
def test_a_missing_or_bad_key_is_a_launch_error(
        h: Harness, monkeypatch: pytest.MonkeyPatch, value: str | None, message: str) -> None:
    if value is None:
        monkeypatch.delenv("TEST_LLM_KEY")
    else:
        monkeypatch.setenv("TEST_LLM_KEY", value)
    result, _ = h.run([])
    assert (result.launch_error or "").startswith(message)
    assert h.requests == []


def test_an_unusable_base_url_is_a_launch_error(h: Harness) -> None:
    result, _ = h.run([httpx.UnsupportedProtocol("Request URL has an unsupported protocol "
                                                 "'ftp://'.")], base_url="ftp://llm.test/v1")
    assert (result.launch_error or "").startswith("base_url 'ftp://llm.test/v1' is not usable")


def test_an_unforeseen_error_fails_the_attempt_not_the_run(h: Harness) -> None:
    def handler(_: httpx.Request) -> httpx.Response:
        raise LookupError(f"surprise with {KEY}")

    result, _ = h.run(handler)
    assert result.failure is FailureClass.AGENT_EXIT
    assert result.summary == ("the http agent could not handle the reply: LookupError: "
                              "surprise with [REDACTED:api_key]")
    assert "Traceback" in h.stderr()
    assert KEY not in h.stderr()


# ---- the deadline on real sockets' streams --------------------------------------------------

class FakeStream(httpcore.NetworkStream):
    """Never has data: each read waits out its timeout on the fake clock."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.timeouts: list[float | None] = []

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        self.timeouts.append(timeout)
        self.clock.now += timeout or 0.0
        raise httpcore.ReadTimeout("timed out")

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.timeouts.append(timeout)


def test_a_read_waits_in_slices_and_ends_at_the_deadline() -> None:
    clock = Clock()
    inner = FakeStream(clock)
    stream = DeadlineStream(inner, clock)
    with attempt_bounds(clock.now + 1.0, threading.Event()), \
            pytest.raises(httpcore.ReadTimeout, match="deadline"):
        stream.read(10, timeout=600)
    assert all(t is not None and t <= POLL_S for t in inner.timeouts)
    assert clock.now == pytest.approx(1001.0)


def test_a_read_ends_at_its_own_timeout_before_the_deadline() -> None:
    clock = Clock()
    stream = DeadlineStream(FakeStream(clock), clock)
    with attempt_bounds(clock.now + 100, threading.Event()), \
            pytest.raises(httpcore.ReadTimeout, match="timed out"):
        stream.read(10, timeout=0.6)
    assert clock.now == pytest.approx(1000.6)


def test_a_cancel_interrupts_a_waiting_read() -> None:
    clock, cancel = Clock(), threading.Event()

    class Cancelling(FakeStream):
        def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
            cancel.set()
            return super().read(max_bytes, timeout)

    with attempt_bounds(clock.now + 100, cancel), pytest.raises(AttemptCancelled):
        DeadlineStream(Cancelling(clock), clock).read(10)


def test_writes_are_bounded_by_the_deadline_and_unbounded_outside_an_attempt() -> None:
    clock = Clock()
    inner = FakeStream(clock)
    stream = DeadlineStream(inner, clock)
    with attempt_bounds(clock.now + 2.0, threading.Event()):
        stream.write(b"x", timeout=30)
    stream.write(b"x", timeout=30)
    assert inner.timeouts == [2.0, 30]


def test_the_transport_connects_through_the_deadline_backend() -> None:
    # httpx takes no network backend: DeadlineTransport replaces its pool. Pin that.
    transport = DeadlineTransport()
    assert isinstance(transport._pool, httpcore.ConnectionPool)
    assert isinstance(transport._pool._network_backend, DeadlineBackend)
    transport.close()


# ---- end to end: a real server, the whole runtime -------------------------------------------

class Server:
    """An OpenAI-compatible endpoint on 127.0.0.1, scripted reply by reply."""

    def __init__(self) -> None:
        self.script: list[tuple[int, bytes]] = []
        self.requests: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", 0))
                outer.requests.append({"path": self.path,
                                       "body": json.loads(self.rfile.read(length))})
                status, body = outer.script.pop(0)
                self.send_response(status)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_end_to_end_key_never_reaches_disk(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from runtime.prompt.redact import Redactor
    from tests.conftest import Project, make_topology, run_topology

    monkeypatch.setenv("TEST_LLM_KEY", KEY)
    server = Server()
    try:
        project = Project(tmp_path / "proj")
        project.root.mkdir()
        project.template("task.md.j2", "Audit {{ node.id }}.\n")
        topo = make_topology({"a": []})
        topo["agents"] = {"llm": {"kind": "http", "base_url": server.url, "model": "m",
                                  "api_key_env": "TEST_LLM_KEY", "max_retries": 0}}
        topo["defaults"] = {"agent": "llm", "max_attempts": 2}
        server.script = [(500, f"internal error for key {KEY}".encode()),
                         (200, json.dumps(completion("```json file=a.json\n{}\n```")).encode())]
        result = run_topology(project, topo, redactor=Redactor.from_environment(os.environ))
    finally:
        server.close()
    assert result.status.value == "succeeded"
    assert [r["path"] for r in server.requests] == ["/v1/chat/completions"] * 2
    for path in result.run_dir.rglob("*"):
        if path.is_file():
            assert KEY not in path.read_text(errors="replace"), path
