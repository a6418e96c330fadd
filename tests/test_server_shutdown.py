"""SIGTERM drain of the real command: `python -m serving` on the demo model in a subprocess.
SIGTERM while a stream is in flight: the listening socket closes at once (new connections are
refused), the stream runs to its end, and the process exits 0 within the grace period."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.server_util import CLI_FLAGS, MODEL, free_port, sse_events, wait_healthy, wait_until

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
GRACE_S = 120  # generous: the in-flight stream must finish well within it on a slow CPU
STARTUP_S = 600  # a cold compilation cache compiles every program first


def _refused(port: int) -> bool:
    """True once no new connection is accepted: refused, or reset while the listening
    socket closes under it."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except (ConnectionRefusedError, ConnectionResetError):
        return True
    return False


def _read_to_end(sock: socket.socket, data: bytes) -> bytes:
    while not data.endswith(b"0\r\n\r\n"):  # the chunked body's terminator
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _dechunk(body: bytes) -> bytes:
    out = b""
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return out
        out, body = out + body[:size], body[size + 2:]


def test_sigterm_drains_in_flight_stream_and_exits_0(demo_checkpoint, tmp_path):
    port = free_port()
    log_path = tmp_path / "server.log"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "serving", "--model", str(demo_checkpoint),
           "--served-model-name", MODEL, *CLI_FLAGS, "--port", str(port),
           "--grace-period", str(GRACE_S)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(port, STARTUP_S, alive=lambda: proc.poll() is None)
        max_tokens = 16
        payload = (b'{"model": "%s", "prompt": "Once upon a time", "max_tokens": %d, '
                   b'"temperature": 0, "ignore_eos": true, "stream": true, '
                   b'"stream_options": {"include_usage": true}}' % (MODEL.encode(), max_tokens))
        sock = socket.create_connection(("127.0.0.1", port), timeout=GRACE_S)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
        data = b""
        while data.count(b"data: ") < 2:  # the stream is under way
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk

        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        wait_until(lambda: _refused(port), 30, "the listening socket to close")
        assert proc.poll() is None  # still draining the stream
        data = _read_to_end(sock, data)
        sock.close()

        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"chunked" in head.lower(), head
        content_type = next(line.split(b":", 1)[1].strip().decode() for line in head.split(b"\r\n")
                            if line.lower().startswith(b"content-type:"))
        events = sse_events({"Content-Type": content_type}, _dechunk(body))
        *chunks, usage = events
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == max_tokens
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert "".join(c["choices"][0]["text"] for c in chunks).strip()

        assert proc.wait(timeout=GRACE_S) == 0
        assert time.monotonic() - sent < GRACE_S
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = log_path.read_text(errors="replace")
    assert "shutting down, draining" in log, log[-3000:]
    assert "aborting" not in log, log[-3000:]  # nothing was cut off by the grace period
    assert "Traceback" not in log, log[-3000:]
