"""Record a real OpenAI-compatible server's replies as fixtures for the http agent's tests.

The server is LiteLLM's proxy serving ``mock_response`` models, offline, on 127.0.0.1.
Installing it takes about 2.5 minutes (more than CI should spend on it), so CI replays
what this script recorded (``tests/fixtures/http/*.json``) through ``httpx.MockTransport``.
Run it again after a LiteLLM upgrade to refresh them:

    python -m venv /tmp/litellm && /tmp/litellm/bin/pip install 'litellm[proxy]'
    python benchmarks/record_http_fixtures.py --litellm /tmp/litellm/bin/litellm

It then runs the http agent itself against the live proxy, once per scenario, and prints
the failure class, summary and time of each (the numbers in the lead's notes).

Two things are set up around LiteLLM, both noted in each fixture: without a database,
LiteLLM answers a wrong key with 400 "No connected db.", so a ``custom_auth`` hook raises
LiteLLM's own 401 ``ProxyException``; a 429 carries ``Retry-After`` only when every
deployment of a model group is cooling down, so ``mock-cooldown`` has two deployments
that always rate-limit, and is asked until the header appears.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MASTER_KEY = "sk-fixture-master"
CONFIG = """\
model_list:
  - model_name: mock-ok
    litellm_params:
      model: openai/mock-ok
      api_key: unused
      mock_response: "Done.\\n```json file=findings.json\\n{\\"ok\\": true}\\n```\\n"
  - model_name: mock-429
    litellm_params: {model: openai/mock-429, api_key: unused,
                     mock_response: "litellm.RateLimitError"}
  - model_name: mock-500
    litellm_params: {model: openai/mock-500, api_key: unused,
                     mock_response: "litellm.InternalServerError"}
  - model_name: mock-cooldown
    litellm_params: {model: openai/mock-a, api_key: unused,
                     mock_response: "litellm.RateLimitError"}
  - model_name: mock-cooldown
    litellm_params: {model: openai/mock-b, api_key: unused,
                     mock_response: "litellm.RateLimitError"}
router_settings: {num_retries: 0, allowed_fails: 0, cooldown_time: 30}
general_settings:
  master_key: %(key)s
  custom_auth: fixture_auth.user_api_key_auth
"""
AUTH_HOOK = """\
from litellm.proxy._types import ProxyErrorTypes, ProxyException, UserAPIKeyAuth


async def user_api_key_auth(request, api_key):
    if api_key == %(key)r:
        return UserAPIKeyAuth(api_key=api_key)
    raise ProxyException(message="Authentication Error, invalid api key",
                         type=ProxyErrorTypes.auth_error, param="api_key", code=401)
"""
KEPT_HEADERS = ("content-type", "retry-after", "retry-after-ms")
# name -> (model, key, note)
SCENARIOS: dict[str, tuple[str, str, str]] = {
    "ok": ("mock-ok", MASTER_KEY, "mock_response success"),
    "unauthorized": ("mock-ok", "sk-not-the-key", "wrong key, custom_auth hook (401)"),
    "unknown_model": ("no-such-model", MASTER_KEY, "model not in model_list"),
    "rate_limited": ("mock-429", MASTER_KEY, "mock_response litellm.RateLimitError"),
    "rate_limited_retry_after": ("mock-cooldown", MASTER_KEY,
                                 "every deployment cooling down: Retry-After"),
    "server_error": ("mock-500", MASTER_KEY, "mock_response litellm.InternalServerError"),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_proxy(litellm: str, workdir: Path, port: int) -> subprocess.Popen[bytes]:
    (workdir / "config.yaml").write_text(CONFIG % {"key": MASTER_KEY})
    (workdir / "fixture_auth.py").write_text(AUTH_HOOK % {"key": MASTER_KEY})
    env = {**os.environ, "PYTHONPATH": str(workdir),
           # Offline: no fetch of the model price map from the network.
           "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    log = (workdir / "proxy.log").open("wb")
    proc = subprocess.Popen([litellm, "--config", str(workdir / "config.yaml"),
                             "--host", "127.0.0.1", "--port", str(port)],
                            cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"litellm exited {proc.returncode}; see {workdir}/proxy.log")
        try:
            httpx.get(f"http://127.0.0.1:{port}/health/liveliness", timeout=1)
            return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    stop(proc)
    raise SystemExit(f"litellm did not answer within 180 s; see {workdir}/proxy.log")


def stop(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def post(base: str, model: str, key: str) -> httpx.Response:
    return httpx.post(f"{base}/chat/completions", timeout=30, headers={
        "authorization": f"Bearer {key}"}, json={
        "model": model, "messages": [{"role": "user", "content": "Audit it."}]})


def record(base: str, name: str, model: str, key: str, note: str, version: str,
           ) -> dict[str, Any]:
    response = post(base, model, key)
    if name == "rate_limited_retry_after":
        for _ in range(5):  # the first failures put the deployments in cooldown
            if "retry-after" in response.headers:
                break
            response = post(base, model, key)
    return {"schema_version": 1, "server": f"litellm proxy {version}", "note": note,
            "request": {"model": model, "key_valid": key == MASTER_KEY},
            "response": {"status": response.status_code,
                         "headers": {h: response.headers[h] for h in KEPT_HEADERS
                                     if h in response.headers},
                         "body": response.text}}


def record_refused(version: str) -> dict[str, Any]:
    with socket.socket() as s:  # bound, never listening: the kernel refuses
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1/chat/completions"
        try:
            httpx.post(url, json={}, timeout=5)
        except httpx.ConnectError as exc:
            return {"schema_version": 1, "server": "none (port bound, not listening)",
                    "note": "connection refused", "request": {},
                    "transport_error": {"type": "ConnectError", "message": str(exc)}}
    raise SystemExit("expected a refused connection")


def agent_table(base: str, refused_base: str) -> None:
    from runtime.agents.base import Invocation
    from runtime.agents.capture import BoundedCapture
    from runtime.agents.http import HttpAgent
    from runtime.plan.profiles import HttpProfile

    os.environ["FIXTURE_KEY_OK"], os.environ["FIXTURE_KEY_BAD"] = MASTER_KEY, "sk-not-the-key"
    cases = [(n, m, "FIXTURE_KEY_OK" if k == MASTER_KEY else "FIXTURE_KEY_BAD", base)
             for n, (m, k, _) in SCENARIOS.items()]
    cases.append(("connection_refused", "mock-ok", "FIXTURE_KEY_OK", refused_base))
    print(f"{'scenario':26} {'seconds':>7}  class / summary")
    for name, model, key_env, url in cases:
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp)
            (d / "ws").mkdir()
            out, err = BoundedCapture(d / "out"), BoundedCapture(d / "err")
            inv = Invocation(run_id="r", node="n", attempt=1, max_attempts=1,
                             prompt="Audit it.", prompt_file=d / "p", workspace=d / "ws",
                             timeout_s=60, env={}, artifacts=(), stdout=out, stderr=err,
                             cancel=threading.Event())
            agent = HttpAgent(HttpProfile(kind="http", base_url=url, model=model,
                                          api_key_env=key_env))
            start = time.monotonic()
            result = agent.run(inv)
            took = time.monotonic() - start
            out.close()
            err.close()
        cls = result.failure or ("succeeded" if result.exit_code == 0 else "agent_exit")
        extra = f" retry_after_s={result.retry_after_s}" if result.retry_after_s else ""
        print(f"{name:26} {took:7.2f}  {cls}{extra} / {result.summary}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--litellm", default="litellm", help="the litellm executable")
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "http")
    args = parser.parse_args()
    version = subprocess.run([sys.executable if args.litellm == "python" else
                              str(Path(args.litellm).with_name("python")), "-c",
                              "import importlib.metadata as m; print(m.version('litellm'))"],
                             capture_output=True, text=True, check=False).stdout.strip()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        proc = start_proxy(args.litellm, Path(tmp), port)
        base = f"http://127.0.0.1:{port}/v1"
        try:
            for name, (model, key, note) in SCENARIOS.items():
                data = record(base, name, model, key, note, version)
                (args.out / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")
                print(f"recorded {name}: HTTP {data['response']['status']}")
            refused = record_refused(version)
            (args.out / "connection_refused.json").write_text(
                json.dumps(refused, indent=2) + "\n")
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                agent_table(base, f"http://127.0.0.1:{s.getsockname()[1]}/v1")
        finally:
            stop(proc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
