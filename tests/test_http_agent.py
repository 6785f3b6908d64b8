"""The http agent against a local server (127.0.0.1 only) that speaks the protocol."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from runtime.agents import Invocation, make_agent
from runtime.capture import BoundedCapture
from runtime.profiles import HttpProfile
from runtime.topology import ArtifactSpec

KEY = "sk-test-" + "k3y" * 10


def _reply(content: str, **choice: Any) -> tuple[int, bytes, dict[str, str], float]:
    body = {"id": "x", "choices": [{"index": 0, "message": {"role": "assistant",
                                                            "content": content}, **choice}]}
    return 200, json.dumps(body).encode(), {}, 0.0


class Server:
    def __init__(self) -> None:
        self.script: list[tuple[int, bytes, dict[str, str], float]] = []
        self.requests: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", 0))
                outer.requests.append({"path": self.path,
                                       "auth": self.headers.get("authorization"),
                                       "body": json.loads(self.rfile.read(length))})
                status, body, headers, delay = outer.script.pop(0)
                time.sleep(delay)
                try:
                    self.send_response(status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("content-length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.close()


@pytest.fixture
def invoke(tmp_path: Path, server: Server, monkeypatch: pytest.MonkeyPatch,
           ) -> Iterator[Callable[..., tuple[Any, Invocation]]]:
    monkeypatch.setenv("TEST_LLM_KEY", KEY)
    caps: list[BoundedCapture] = []

    def run(timeout: float = 10.0, retries: int = 3) -> tuple[Any, Invocation]:
        ws = tmp_path / "ws"
        ws.mkdir(exist_ok=True)
        out, err = BoundedCapture(tmp_path / "out.log"), BoundedCapture(tmp_path / "err.log")
        caps.extend([out, err])
        inv = Invocation(run_id="r", node="n", attempt=1, max_attempts=1, prompt="Audit it.",
                         prompt_file=tmp_path / "p.md", workspace=ws, timeout_s=timeout,
                         env={}, artifacts=(ArtifactSpec(path="findings.json", kind="json"),),
                         stdout=out, stderr=err)
        agent = make_agent(HttpProfile(kind="http", base_url=server.url, model="m-1",
                                       api_key_env="TEST_LLM_KEY", max_retries=retries))
        return agent.run(inv), inv

    yield run
    for c in caps:
        c.close()


def test_reply_and_artifacts_are_written(server: Server, invoke: Any) -> None:
    server.script = [_reply('Done.\n```json file=findings.json\n{"ok": true}\n```\n'
                            "```md file=../../escape.md\nnope\n```\n")]
    result, inv = invoke()
    assert result.exit_code == 0 and result.reported_error is None
    assert json.loads((inv.workspace / "findings.json").read_text()) == {"ok": True}
    assert (inv.workspace / "reply.md").read_text().startswith("Done.")
    assert not (inv.workspace.parent.parent / "escape.md").exists()
    req = server.requests[0]
    assert req["path"] == "/v1/chat/completions" and req["auth"] == f"Bearer {KEY}"
    assert req["body"]["model"] == "m-1"
    assert req["body"]["messages"][-1] == {"role": "user", "content": "Audit it."}


@pytest.mark.parametrize("statuses", [[429], [500, 502], [503, 429, 500]])
def test_429_and_5xx_are_retried(server: Server, invoke: Any, statuses: list[int]) -> None:
    server.script = [(s, b'{"error": "busy"}', {"retry-after": "0"}, 0.0) for s in statuses]
    server.script.append(_reply("```json file=findings.json\n{}\n```"))
    result, _ = invoke()
    assert result.exit_code == 0 and len(server.requests) == len(statuses) + 1


def test_persistent_5xx_gives_up_after_max_retries(server: Server, invoke: Any) -> None:
    server.script = [(503, b"down for maintenance", {"retry-after": "0"}, 0.0)] * 3
    result, inv = invoke(retries=2)
    assert result.exit_code == 1 and len(server.requests) == 3
    assert "HTTP 503 after 3 tries" in inv.stderr.tail_text(4096)


def test_4xx_is_not_retried_and_the_key_never_leaks(server: Server, invoke: Any) -> None:
    server.script = [(401, f'{{"error": "invalid key {KEY}"}}'.encode(), {}, 0.0)]
    result, inv = invoke()
    assert result.exit_code == 1 and len(server.requests) == 1
    err = inv.stderr.tail_text(4096)
    assert "HTTP 401" in err and KEY not in err and "[REDACTED:api_key]" in err


def test_slow_reply_times_out(server: Server, invoke: Any) -> None:
    server.script = [(*_reply("late")[:3], 2.0)]
    start = time.monotonic()
    result, _ = invoke(timeout=0.5)
    assert result.timed_out and time.monotonic() - start < 2.0


@pytest.mark.parametrize(("body", "message"), [
    (b"<html>gateway</html>", "malformed reply (not JSON"),
    (b'{"choices": []}', "malformed reply"),
    (b'{"choices": [{"message": {"content": null}}]}', "malformed reply"),
])
def test_malformed_bodies(server: Server, invoke: Any, body: bytes, message: str) -> None:
    server.script = [(200, body, {}, 0.0)]
    result, inv = invoke()
    assert result.exit_code == 1 and message in inv.stderr.tail_text(4096)


def test_error_object_with_200_is_contradictory(server: Server, invoke: Any) -> None:
    server.script = [(200, b'{"error": {"message": "context length exceeded"}}', {}, 0.0)]
    result, _ = invoke()
    assert result.exit_code == 0 and "context length exceeded" in result.reported_error


def test_missing_key_is_a_launch_error(invoke: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TEST_LLM_KEY")
    result, _ = invoke()
    assert result.launch_error == "environment variable TEST_LLM_KEY is not set (api_key_env)"


def test_end_to_end_key_never_reaches_disk(server: Server, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from runtime.redact import Redactor
    from tests.conftest import Project, make_topology, run_topology

    monkeypatch.setenv("TEST_LLM_KEY", KEY)
    project = Project(tmp_path / "proj")
    project.root.mkdir()
    project.template("task.md.j2", "Audit {{ node.id }}.\n")
    topo = make_topology({"a": []})
    topo["agents"] = {"llm": {"kind": "http", "base_url": server.url, "model": "m",
                              "api_key_env": "TEST_LLM_KEY", "max_retries": 0}}
    topo["defaults"] = {"agent": "llm", "max_attempts": 2}
    server.script = [(400, f"bad request for key {KEY}".encode(), {}, 0.0),
                     _reply("```json file=a.json\n{}\n```")]
    result = run_topology(project, topo, redactor=Redactor.from_environment(os.environ))
    assert result.status.value == "succeeded"
    for path in result.run_dir.rglob("*"):
        if path.is_file():
            assert KEY not in path.read_text(errors="replace"), path
