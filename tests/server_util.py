"""Helpers for the end-to-end server tests: one small engine configuration (shared by the
in-process server and the `python -m serving` subprocess, so both hit the same compiled
programs in the persistent cache), raw HTTP, SSE parsing and /metrics scraping."""
from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
import threading
import time
from dataclasses import dataclass

import openai
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "sekrit-key"
MAX_QUEUED = 2
PAGES_BACK_S = 60  # deadline for aborted requests' pages to come back (a few steps)

# Two programs: (tokens 8, requests 8) for one or a few streams decoding, (64, 32) for
# prefill and the 32-stream batch. One page bucket: a whole sequence's table.
ENGINE = dict(max_model_len=256, max_num_seqs=32, max_num_batched_tokens=64,
              token_buckets=(8, 64), request_buckets=(8, 32), page_buckets=(16,))
CLI_FLAGS = ["--max-model-len", "256", "--max-num-seqs", "32",
             "--max-num-batched-tokens", "64", "--token-buckets", "8,64",
             "--request-buckets", "8,32", "--page-buckets", "16"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(port: int, method: str, path: str, body=None, headers=None,
            timeout: float = 120) -> tuple[int, dict, bytes]:
    """body: a dict (sent as JSON), bytes (sent as is) or None."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        hdrs = dict(headers or {})
        if isinstance(body, dict):
            body = json.dumps(body).encode()
            hdrs.setdefault("Content-Type", "application/json")
        conn.request(method, path, body=body, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def post(port: int, path: str, body, headers=None) -> tuple[int, dict]:
    status, _, raw = request(port, "POST", path, body, headers)
    return status, json.loads(raw)


def get_json(port: int, path: str, headers=None) -> tuple[int, dict]:
    status, _, raw = request(port, "GET", path, headers=headers)
    return status, json.loads(raw)


def sse_events(headers: dict, raw: bytes) -> list[dict]:
    """Parses an SSE body strictly: `data: {json}` events, each followed by a blank line,
    `data: [DONE]` last."""
    assert headers["Content-Type"].startswith("text/event-stream")
    text = raw.decode()
    assert text.endswith("data: [DONE]\n\n"), text[-300:]
    events = text.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), text[:500]
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


def stream(port: int, path: str, body: dict) -> list[dict]:
    status, headers, raw = request(port, "POST", path, {**body, "stream": True})
    assert status == 200, raw
    return sse_events(headers, raw)


def metrics(port: int) -> dict[tuple[str, tuple], float]:
    """The server's series by (name, labels); what each engine (data-parallel replica)
    reports under its `engine` label is summed over the engines."""
    status, _, raw = request(port, "GET", "/metrics")
    assert status == 200
    out: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(raw.decode()):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items()
                                  if k not in ("model_name", "engine")))
            out[(s.name, labels)] = out.get((s.name, labels), 0.0) + s.value
    return out


def metric(snapshot: dict, name: str, **labels) -> float:
    return snapshot.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def wait_healthy(port: int, timeout: float, alive=lambda: True) -> None:
    def healthy():
        assert alive(), "the server process exited"
        try:
            return request(port, "GET", "/health", timeout=5)[0] == 200
        except OSError:
            return False
    wait_until(healthy, timeout, "/health to answer 200", interval=0.2)


def open_stream(port: int, path: str, body: dict, num_events: int) -> tuple[socket.socket, bytes]:
    """Starts a streaming request on a raw socket and reads until num_events SSE events have
    arrived; returns the socket (still open) and what was read."""
    payload = json.dumps({**body, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    data = b""
    while data.count(b"data: ") < num_events:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the stream early: {data!r}"
        data += chunk
    assert data.startswith(b"HTTP/1.1 200"), data[:200]
    return sock, data


def assert_error(status: int, body: dict, want_status: int, *, param=None, code=None,
                 type_=None) -> None:
    """OpenAI's error envelope, exactly: {"error": {message, type, param, code}}."""
    assert status == want_status, body
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["param"] == param, err
    assert err["code"] == code, err
    if type_ is not None:
        assert err["type"] == type_, err


# -- the in-process server ----------------------------------------------------------------

@dataclass
class Live:
    engine: object  # LLMEngine
    port: int  # the main server (run_server)
    auth_port: int  # api_key=API_KEY
    queue_port: int  # max_queued_requests=MAX_QUEUED
    cold_port: int  # over an AsyncEngine that was never started: warming up
    tokenizer: object

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0,
                             timeout=300, **kwargs)

    def used_pages(self) -> int:
        return self.engine.scheduler.allocator.num_used_pages

    def wait_idle(self) -> None:
        """Every request finished or aborted and its pages back, as /metrics reports it."""
        def idle():
            m = metrics(self.port)
            return (metric(m, "xlaserve:kv_cache_usage_perc") == 0
                    and metric(m, "xlaserve:num_requests_running") == 0
                    and metric(m, "xlaserve:num_requests_waiting") == 0)
        wait_until(idle, PAGES_BACK_S, "the KV cache to empty")
        assert self.used_pages() == 0


async def _start_site(app: web.Application, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


@contextlib.contextmanager
def live_server(checkpoint, **engine_options):
    """One engine (ENGINE, with engine_options on top) behind run_server on a free port, in
    an event loop of its own thread; the same loop serves three more apps over the same
    engine (see Live)."""
    from serving.openai.api_server import build_app, run_server
    from serving.openai.tools import DEMO_CHAT_TEMPLATE
    from serving.engine.async_engine import AsyncEngine
    from serving.core.config import EngineConfig
    from serving.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(checkpoint), progress=False,
                                    **{**ENGINE, **engine_options}))
    async_engine = AsyncEngine(engine)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="e2e-server-loop", daemon=True)
    main, stop, runners = None, None, []

    def call(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    async def make_event():
        return asyncio.Event()

    try:
        async_engine.start()
        thread.start()
        stop = call(make_event())
        port = free_port()
        main = asyncio.run_coroutine_threadsafe(run_server(  # as `xlaserve serve` the demo
            async_engine, "127.0.0.1", port, served_model_name=MODEL, grace_period_s=10,
            stop_event=stop, chat_template=DEMO_CHAT_TEMPLATE.read_text(),
            tool_call_parser="hermes"), loop)
        ports = [free_port() for _ in range(3)]
        apps = [build_app(async_engine, served_model_name=MODEL, api_key=API_KEY),
                build_app(async_engine, served_model_name=MODEL,
                          max_queued_requests=MAX_QUEUED),
                build_app(AsyncEngine(engine), served_model_name=MODEL)]  # never started
        for app, p in zip(apps, ports):
            runners.append(call(_start_site(app, p)))
        wait_healthy(port, 60, alive=lambda: not main.done())
        yield Live(engine, port, *ports, engine.tokenizer)
    finally:
        if main is not None:
            loop.call_soon_threadsafe(stop.set)
            main.result(60)
        for runner in runners:
            call(runner.cleanup())
        async_engine.shutdown()
        if thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
        loop.close()
