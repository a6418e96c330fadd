"""Security basics. With an API key, every route but /health needs it (compared in constant
time), /openapi.json included; bodies and prompts are size-limited (413); the real command
binds 127.0.0.1 unless told otherwise and keeps prompts and keys out of its logs at the
default level, even when requests fail, HTTP is malformed or the engine dies (then it
exits 1)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from serving.cli import build_parser
from serving.openai.openapi import openapi_spec
from serving.openai.server_state import longest_token
from tests.http_stream import Stream
from tests.server_util import (API_KEY, CLI_FLAGS, MODEL, assert_error, free_port, post,
                               request, wait_healthy)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BODIES = {"/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 1},
          "/v1/chat/completions": {"model": MODEL, "max_tokens": 1,
                                   "messages": [{"role": "user", "content": "Hi"}]},
          "/v1/responses": {"model": MODEL, "input": "Hi", "max_output_tokens": 1},
          "/tokenize": {"prompt": "Hi"}, "/detokenize": {"tokens": [1, 2]}}
WRONG_KEYS = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
              {"Authorization": f"Basic {API_KEY}"}, {"Authorization": f"Bearer {API_KEY}x"},
              {"Authorization": "Bearer " + API_KEY[:-1]}]


def routes(live, response_id: str) -> list[tuple[str, str]]:
    spec = openapi_spec(MODEL, len(live.tokenizer), live.engine.max_model_len)
    return [(method.upper(), path.replace("{model}", MODEL).replace("{response_id}", response_id))
            for path, ops in spec["paths"].items() for method in ops]


def call(port: int, method: str, path: str, headers: dict) -> tuple[int, bytes]:
    body = json.dumps(BODIES[path]).encode() if method == "POST" else None
    status, _, raw = request(port, method, path, body,
                             {"Content-Type": "application/json", **headers})
    return status, raw


def test_every_route_but_health_needs_the_key(shared_server):
    live = shared_server
    checked = []
    status, raw = call(live.auth_port, "POST", "/v1/responses",
                       {"Authorization": f"Bearer {API_KEY}"})
    assert status == 200, raw[:300]
    for method, path in routes(live, json.loads(raw)["id"]):
        if path == "/health":
            assert call(live.auth_port, method, path, {})[0] == 200
            continue
        for headers in WRONG_KEYS:
            status, raw = call(live.auth_port, method, path, headers)
            assert_error(status, json.loads(raw), 401, code="invalid_api_key",
                         type_="authentication_error")
        status, raw = call(live.auth_port, method, path,
                           {"Authorization": f"Bearer {API_KEY}"})
        assert status == 200, (path, raw[:300])
        checked.append(path)
    assert {"/metrics", "/tokenize", "/detokenize", "/v1/models", "/openapi.json",
            "/v1/completions", "/v1/chat/completions", "/v1/responses"} <= set(checked)
    # A route that does not exist answers 401 too: no key, nothing learned.
    assert call(live.auth_port, "GET", "/v1/secret", {})[0] == 401


def test_the_key_is_compared_in_constant_time(shared_server, monkeypatch):
    from serving.openai import http_guard
    compared = []
    real = http_guard.hmac.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return real(a, b)
    monkeypatch.setattr(http_guard.hmac, "compare_digest", spy)
    assert call(shared_server.auth_port, "GET", "/v1/models",
                {"Authorization": "Bearer guess"})[0] == 401
    assert call(shared_server.auth_port, "GET", "/v1/models",
                {"Authorization": f"Bearer {API_KEY}"})[0] == 200
    assert compared == [(b"guess", API_KEY.encode()), (API_KEY.encode(), API_KEY.encode())]


def test_bodies_and_prompts_are_size_limited(shared_server):
    live = shared_server
    for path, body in BODIES.items():  # 4 MiB body limit, on every route that reads one
        big = json.dumps({**body, "padding": "x" * (5 << 20)}).encode()
        status, _, raw = request(live.port, "POST", path, big,
                                 {"Content-Type": "application/json"})
        assert_error(status, json.loads(raw), 413, code="request_too_large")
    # A prompt longer than max_model_len of the longest tokens can never fit: 413 before
    # tokenizing. One character less is tokenized and refused for the context (400).
    limit = live.engine.max_model_len * longest_token(live.tokenizer)
    prompts = {"/v1/completions": ("prompt", lambda text: {**BODIES["/v1/completions"],
                                                           "prompt": text}),
               "/tokenize": ("prompt", lambda text: {"prompt": text}),
               "/v1/chat/completions": ("messages", lambda text: {
                   **BODIES["/v1/chat/completions"],
                   "messages": [{"role": "user", "content": text}]})}
    for path, (param, make) in prompts.items():
        status, body = post(live.port, path, make("a " * (limit // 2) + "a"))
        assert_error(status, body, 413, param=param, code="prompt_too_large")
        status, body = post(live.port, path, make("a " * (limit // 2)))
        assert status != 413, body
        if path != "/tokenize":  # tokenize has no context to exceed
            assert_error(status, body, 400, param=param, code="context_length_exceeded")


def test_default_bind_is_loopback():
    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"


# -- the real command ------------------------------------------------------------------------

SECRET_KEY = "key-ocelot-5519"
PROMPT_MARK = "zebra quokka narwhal"
VICTIM_SEED = 4242


def listening_addresses(port: int) -> set[str]:
    """Local addresses of the sockets listening on port, from /proc/net/tcp{,6}."""
    found = set()
    for name in ("tcp", "tcp6"):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(socket.inet_ntop(socket.AF_INET, bytes.fromhex(address)[::-1])
                          if name == "tcp" else address)
    return found


def test_cli_binds_loopback_logs_no_secrets_and_exits_1_when_the_engine_dies(demo_checkpoint,
                                                                            tmp_path):
    port = free_port()
    log_path = tmp_path / "server.log"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
           "XLASERVE_FAULTS": f"step:{VICTIM_SEED}:2"}
    cmd = [sys.executable, "-m", "serving", "--model", str(demo_checkpoint),
           "--served-model-name", MODEL, *CLI_FLAGS, "--port", str(port),
           "--api-key", SECRET_KEY]  # no --host
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(port, 600, alive=lambda: proc.poll() is None)
        assert listening_addresses(port) == {"127.0.0.1"}
        auth = {"Authorization": f"Bearer {SECRET_KEY}"}
        chat = {"model": MODEL, "max_tokens": 3,
                "messages": [{"role": "user", "content": f"Say {PROMPT_MARK}"}]}
        completion = {"model": MODEL, "prompt": f"The {PROMPT_MARK} is", "max_tokens": 3}
        assert post(port, "/v1/chat/completions", chat, auth)[0] == 200
        assert Stream(port, "/v1/completions", completion, auth).rest()
        assert post(port, "/tokenize", {"prompt": PROMPT_MARK}, auth)[0] == 200
        assert post(port, "/v1/completions", {**completion, "top_p": 7}, auth)[0] == 400
        assert post(port, "/v1/completions", completion,
                    {"Authorization": f"Bearer {SECRET_KEY}-wrong"})[0] == 401
        malformed = (f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                     f"{SECRET_KEY}\x01{PROMPT_MARK}\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            sock.sendall(malformed)
            assert sock.recv(100).startswith(b"HTTP/1.")

        victim = Stream(port, "/v1/completions", {**completion, "max_tokens": 40, "ignore_eos":
                                                  True, "seed": VICTIM_SEED}, auth)
        assert "error" in victim.rest()[-1]  # the step failed mid-stream
        assert proc.wait(timeout=120) == 1
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    log = log_path.read_text(errors="replace")
    assert "engine failed" in log and "injected step fault" in log, log[-3000:]
    assert "unparsable HTTP request" in log, log[-3000:]
    for secret in (SECRET_KEY, PROMPT_MARK, "zebra", "quokka"):
        assert secret not in log, (secret, log[-3000:])
