"""The http agent's bounds, measured against hostile servers on 127.0.0.1 (issue 8).

Each scenario runs the agent in a fresh child process, so its peak RSS is the agent's
own; the servers run in this process. Printed: seconds, peak RSS, and the ratio of each
to the same agent receiving a well-formed reply in the same run. Then fence parsing:
480 KB of unclosed ``file=`` fences through the parser, against a well-formed reply of
the same size, and the regex this parser replaced on 12 and 24 KB (it is quadratic:
480 KB took 100 s).

    python benchmarks/http_bounds.py
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MIB = 1 << 20
OLD_FENCE = re.compile(r"^```[^\n`]*?\bfile=([^\s`]+)[^\n]*\n(.*?)\n```[ \t]*$", re.S | re.M)
UNCLOSED = "```json file=a.json\n" * (480_000 // 20)


def completion(content: str) -> bytes:
    return json.dumps({"choices": [{"message": {"content": content},
                                    "finish_reason": "stop"}]}).encode()


def _bomb() -> bytes:
    """~0.6 MB of gzip that inflates to 600 MiB, built without holding the 600 MiB."""
    z, block = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS), b" " * MIB
    return b"".join([*(z.compress(block) for _ in range(600)), z.flush()])


BOMB = _bomb()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def handle(self) -> None:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            super().handle()  # the agent hanging up is the point

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        scenario = self.path.split("/")[1]
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            getattr(self, f"serve_{scenario}")()

    def _head(self, length: int | None, **headers: str) -> None:
        self.send_response(200)
        self.send_header("content-type", "application/json")
        if length is None:
            self.send_header("connection", "close")
        else:
            self.send_header("content-length", str(length))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()

    def serve_ok(self) -> None:
        body = completion("Done.\n```json file=findings.json\n{}\n```\n")
        self._head(len(body))
        self.wfile.write(body)

    def serve_big(self) -> None:  # 400 MB, no length announced
        self._head(None)
        self.wfile.write(b'{"choices": [{"message": {"content": "')
        chunk = b"x" * MIB
        for _ in range(400):
            self.wfile.write(chunk)
        self.close_connection = True

    def serve_bomb(self) -> None:
        self._head(len(BOMB), **{"content-encoding": "gzip"})
        self.wfile.write(BOMB)

    def serve_drip(self) -> None:  # one byte every 0.5 s, for at most 60 s
        self._head(1000)
        for _ in range(120):
            self.wfile.write(b" ")
            self.wfile.flush()
            time.sleep(0.5)

    def serve_fences(self) -> None:
        body = completion(UNCLOSED)
        self._head(len(body))
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def peak_rss_mib() -> float:
    """This process's peak RSS: VmHWM, which (unlike ru_maxrss) exec resets."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise SystemExit("no VmHWM in /proc/self/status")


def child(scenario: str, url: str, timeout: float) -> None:
    """Run the agent once; print seconds, peak RSS and what it concluded, as JSON."""
    from runtime.agents.base import Invocation
    from runtime.agents.capture import BoundedCapture
    from runtime.agents.http import HttpAgent
    from runtime.plan.profiles import HttpProfile

    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "ws").mkdir()
        out, err = BoundedCapture(d / "out"), BoundedCapture(d / "err")
        inv = Invocation(run_id="r", node="n", attempt=1, max_attempts=1, prompt="Audit it.",
                         prompt_file=d / "p", workspace=d / "ws", timeout_s=timeout, env={},
                         artifacts=(), stdout=out, stderr=err, cancel=threading.Event())
        agent = HttpAgent(HttpProfile(kind="http", base_url=f"{url}/{scenario}/v1",
                                      model="m", max_retries=0))
        start = time.monotonic()
        result = agent.run(inv)
        seconds = time.monotonic() - start
        out.close()
        err.close()
    print(json.dumps({"seconds": seconds,
                      "rss_mib": peak_rss_mib(),
                      "outcome": "timed out" if result.timed_out else
                      str(result.failure or result.reported_error or "succeeded")[:60],
                      "summary": (result.summary or "")[:90]}))


def measure(scenario: str, url: str, timeout: float) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, "--child", scenario, url, str(timeout)],
                          capture_output=True, text=True, timeout=120, check=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def timed(fn: Callable[[str], object], arg: str) -> float:
    start = time.perf_counter()
    fn(arg)
    return time.perf_counter() - start


def main() -> int:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        base = measure("ok", url, 5.0)
        print(f"{'scenario':34} {'seconds':>8} {'x ok':>6} {'peak MiB':>9} {'x ok':>6}  outcome")
        for scenario, label in [("ok", "well-formed reply"),
                                ("big", "400 MB body, no length"),
                                ("bomb", f"gzip bomb ({len(BOMB) / 1e6:.2f} MB -> 600 MiB)"),
                                ("drip", "1 byte / 0.5 s, timeout_s 5"),
                                ("fences", "480 KB of unclosed fences")]:
            r = base if scenario == "ok" else measure(scenario, url, 5.0)
            print(f"{label:34} {r['seconds']:8.2f} {r['seconds'] / base['seconds']:6.1f} "
                  f"{r['rss_mib']:9.1f} {r['rss_mib'] / base['rss_mib']:6.2f}  "
                  f"{r['outcome']}: {r['summary']}")
    finally:
        server.shutdown()
        server.server_close()

    from runtime.agents.http_files import parse

    closed = "".join(f"```json file=f{i % 200}.json\n{{}}\n```\n" for i in range(480_000 // 27))
    t_closed, t_unclosed = timed(parse, closed), timed(parse, UNCLOSED)
    print(f"\nparse, {len(closed) // 1000} KB of closed fences:   {t_closed * 1000:8.1f} ms")
    print(f"parse, {len(UNCLOSED) // 1000} KB of unclosed fences: {t_unclosed * 1000:8.1f} ms "
          f"({t_unclosed / t_closed:.2f}x closed)")
    widths = "".join("`" * (10 - i % 8) + f"txt file=f{i}\n" for i in range(480_000 // 20))
    t_widths = timed(parse, widths)
    print(f"parse, {len(widths) // 1000} KB of unclosed fences of 10..3 backticks: "
          f"{t_widths * 1000:8.1f} ms ({t_widths / t_closed:.2f}x closed)")
    t12, t24 = timed(OLD_FENCE.findall, UNCLOSED[:12_000]), timed(OLD_FENCE.findall,
                                                                    UNCLOSED[:24_000])
    print(f"old regex, 12 KB unclosed: {t12 * 1000:8.1f} ms; 24 KB: {t24 * 1000:8.1f} ms "
          f"({t24 / t12:.1f}x for 2x the text: quadratic)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], float(sys.argv[4]))
        raise SystemExit(0)
    raise SystemExit(main())
