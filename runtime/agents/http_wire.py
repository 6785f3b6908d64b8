"""The http agent's wire: one deadline per attempt and capped response bodies.

One deadline over every socket operation of an attempt, and response bodies read with a cap
before and after decompression.

httpx's timeouts bound each socket operation, not a whole exchange: a server that drips
one byte every few seconds never trips a read timeout (issue 8: 45 s on a 5 s timeout).
``DeadlineTransport`` is httpx's own transport over a connection pool whose network
streams bound every read, write and connect by the deadline of the attempt running on
the calling thread (sync httpx does all of a request's I/O on that thread), and poll the
attempt's cancel event while they wait for data. One transport serves the whole process,
so building an agent per attempt costs no TLS context and keeps connections alive.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import httpcore
import httpx

# How often a read waiting for data wakes to look at the cancel event.
POLL_S = 0.25


class AttemptCancelled(Exception):
    """The attempt's cancel event was set while the agent waited on the network."""


class BodyError(Exception):
    """A response body the agent refuses to read further (too large, undecodable)."""


class _Bounds(threading.local):
    deadline: float | None = None
    cancel: threading.Event | None = None


_bounds = _Bounds()


@contextmanager
def attempt_bounds(deadline: float, cancel: threading.Event) -> Iterator[None]:
    """Bound this thread's socket operations by ``deadline`` and ``cancel`` while the block runs.

    ``deadline`` is a ``time.monotonic`` value.
    """
    saved = (_bounds.deadline, _bounds.cancel)
    _bounds.deadline, _bounds.cancel = deadline, cancel
    try:
        yield
    finally:
        _bounds.deadline, _bounds.cancel = saved


def _limit(timeout: float | None, expired: type[Exception],
           clock: Callable[[], float]) -> float | None:
    """The timeout one socket operation may use now; raises once the deadline passed."""
    if _bounds.cancel is not None and _bounds.cancel.is_set():
        raise AttemptCancelled
    if _bounds.deadline is None:
        return timeout
    remaining = _bounds.deadline - clock()
    if remaining <= 0:
        raise expired("the attempt's deadline passed")
    return remaining if timeout is None else min(timeout, remaining)


class DeadlineStream(httpcore.NetworkStream):
    """A network stream whose operations end by the calling thread's attempt deadline."""

    def __init__(self, inner: httpcore.NetworkStream,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._inner = inner
        self._clock = clock

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        # A recv that times out consumed nothing, so waiting in POLL_S slices is safe and
        # lets a cancel interrupt a long wait for a reply.
        """Read up to ``max_bytes``, bounded by the attempt's deadline and its cancel event."""
        give_up = None if timeout is None else self._clock() + timeout
        while True:
            limit = _limit(None, httpcore.ReadTimeout, self._clock)
            if give_up is not None:
                own = give_up - self._clock()
                if own <= 0:
                    raise httpcore.ReadTimeout("timed out")
                limit = own if limit is None else min(limit, own)
            try:
                return self._inner.read(max_bytes, POLL_S if limit is None
                                        else min(limit, POLL_S))
            except httpcore.ReadTimeout:
                continue  # the loop looks at the deadline, the timeout and the cancel

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        # Not sliced: a timed-out send may have sent part of the buffer.
        """Write all of ``buffer``, bounded by the attempt's deadline."""
        self._inner.write(buffer, _limit(timeout, httpcore.WriteTimeout, self._clock))

    def close(self) -> None:
        """Close the wrapped stream."""
        self._inner.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        """Upgrade to TLS, with the handshake bounded by the attempt's deadline."""
        inner = self._inner.start_tls(ssl_context, server_hostname,
                                      _limit(timeout, httpcore.ConnectTimeout, self._clock))
        return DeadlineStream(inner, self._clock)

    def get_extra_info(self, info: str) -> Any:
        """Pass through to the wrapped stream (httpcore asks it for the socket and TLS details)."""
        return self._inner.get_extra_info(info)


class DeadlineBackend(httpcore.NetworkBackend):
    """httpcore's socket backend, its streams wrapped in ``DeadlineStream``."""

    def __init__(self, inner: httpcore.NetworkBackend | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._inner = inner or httpcore.SyncBackend()
        self._clock = clock

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        """Connect over TCP within the attempt's deadline; the stream keeps bounding every I/O."""
        stream = self._inner.connect_tcp(
            host, port, _limit(timeout, httpcore.ConnectTimeout, self._clock),
            local_address, socket_options)
        return DeadlineStream(stream, self._clock)

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None,
                            ) -> httpcore.NetworkStream:
        """Connect over a Unix socket within the attempt's deadline; the stream bounds every I/O."""
        stream = self._inner.connect_unix_socket(
            path, _limit(timeout, httpcore.ConnectTimeout, self._clock), socket_options)
        return DeadlineStream(stream, self._clock)

    def sleep(self, seconds: float) -> None:
        """Sleep as the wrapped backend does (httpcore calls it between connection retries)."""
        self._inner.sleep(seconds)


class DeadlineTransport(httpx.HTTPTransport):
    """httpx's HTTP/1.1 transport over a pool of ``DeadlineStream`` connections.

    Proxy variables are ignored (the agent connects directly).
    """

    def __init__(self) -> None:
        super().__init__(trust_env=False)
        # httpx takes no network backend, so the pool it built is replaced by the same
        # pool over ours; httpx's request mapping and exception translation stay its own.
        # tests/test_http_agent.py pins that the attribute still exists.
        self._pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(trust_env=False),
            network_backend=DeadlineBackend())


_shared: DeadlineTransport | None = None
_shared_lock = threading.Lock()


def shared_transport() -> DeadlineTransport:
    """The process's one transport (connection pool), built on first use."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = DeadlineTransport()
        return _shared


# ---- bodies ------------------------------------------------------------------------

class _Decoder:
    """One content coding, decoded without ever holding more than the cap."""

    def __init__(self, coding: str) -> None:
        self.coding = coding
        self._z: Any = None
        if coding == "gzip":
            self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif coding == "deflate":
            self._z = zlib.decompressobj()
        self._started = False

    def feed(self, data: bytes, out: bytearray, cap: int) -> None:
        if self._z is None:
            out += data[: cap - len(out) + 1]
        else:
            self._inflate(data, out, cap)
        if len(out) > cap:
            raise BodyError(f"the reply is larger than {cap} bytes after decompression")

    def _inflate(self, data: bytes, out: bytearray, cap: int) -> None:
        while data and not self._z.eof:
            try:
                # max_length bounds what one call may produce: a 0.6 MB bomb stops at
                # the cap instead of inflating to gigabytes.
                out += self._z.decompress(data, cap - len(out) + 1)
            except zlib.error as exc:
                if self.coding == "deflate" and not self._started:
                    # Some servers send raw deflate without the zlib header.
                    self._z, self._started = zlib.decompressobj(-zlib.MAX_WBITS), True
                    continue
                raise BodyError(f"the {self.coding} body is corrupt: {exc}") from None
            self._started = True
            if len(out) > cap:
                return
            data = self._z.unconsumed_tail

    def finish(self, out: bytearray, cap: int) -> None:
        if self._z is not None and self._started and not self._z.eof:
            raise BodyError(f"the {self.coding} body ends before its compressed stream does")


def _decoder(header: str) -> _Decoder:
    codings = [c.strip().lower() for c in header.split(",") if c.strip()]
    codings = [c for c in codings if c != "identity"]
    coding = {"x-gzip": "gzip"}.get(codings[0], codings[0]) if codings else "identity"
    if len(codings) > 1 or coding not in ("identity", "gzip", "deflate"):
        raise BodyError(f"content-encoding {header!r} is not supported (the agent asks "
                        "for gzip or deflate)")
    return _Decoder(coding)


def read_body(response: httpx.Response, cap: int, check: Callable[[], None],
              *, truncate: bool = False) -> bytearray:
    """Read a response body with a cap on both wire bytes and decoded bytes.

    The decoded body, reading at most ``cap`` bytes off the wire and producing at most
    ``cap`` decoded. Past either cap: ``BodyError``, or with ``truncate`` the first ``cap``
    bytes (for error bodies, read only for their message). ``check`` runs before each chunk
    (deadline and cancel, for transports that do not bound sockets).
    """
    decoder = _decoder(response.headers.get("content-encoding", ""))
    declared = response.headers.get("content-length", "")
    if not truncate and declared.isdigit() and int(declared) > cap:
        raise BodyError(f"the reply announces {int(declared)} bytes; the cap is {cap}")
    out, wire = bytearray(), 0
    # An in-memory reply (a test transport) was read and decoded when it was built.
    raw = [response.content] if response.is_stream_consumed else response.iter_raw()
    if response.is_stream_consumed:
        decoder = _Decoder("identity")
    try:
        for chunk in raw:
            check()
            wire += len(chunk)
            if wire > cap:
                decoder.feed(chunk[: len(chunk) - (wire - cap)], out, cap)  # for truncate
                raise BodyError(f"the reply is larger than {cap} bytes on the wire")
            decoder.feed(chunk, out, cap)
        decoder.finish(out, cap)
    except BodyError:
        if not truncate:
            raise
        del out[cap:]
    return out
