"""Fuzzing the HTTP API of the real server (demo model, loopback). Sweeps send every field of
every route each hostile value in turn (wrong types, huge and negative numbers, NaN and
infinities, lone surrogates, odd digits, enormous prompts, bad token-id lists), every
content type with every raw body (invalid UTF-8, truncated and deep JSON), every method on
every path, odd API-key headers. Hypothesis then draws bodies from the server's own
/openapi.json schemas, the same bodies with hostile fields, and raw requests. Last,
malformed HTTP.

Every answer must be 2xx, or 4xx in OpenAI's error envelope: no 5xx, no hang (each request
has a timeout), no error event inside a 200 stream. Afterwards the server still answers a
normal request and every KV page is free. Runs are derandomized, so CI sends the same cases
each time; `-s` prints how many were sent.
"""
from __future__ import annotations

import json
import socket
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from serving.openai.openapi import openapi_spec, request_schemas
from tests import fuzz_strategies as fs
from tests.server_util import MODEL, assert_error, get_json, post, request, sse_events

pytestmark = pytest.mark.slow

HANG_S = 120  # a request still unanswered after this long counts as a hang
BATCH = 8  # requests sent at once per example: the engine batches them
SENT: Counter = Counter()
FUZZ = settings(max_examples=25, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def live(shared_server):
    return shared_server


@pytest.fixture(scope="module")
def schemas(live):
    return request_schemas(MODEL, len(live.tokenizer), live.engine.max_model_len)


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(BATCH) as executor:
        yield executor


def check_answer(case, status: int, headers: dict, raw: bytes) -> None:
    method = case[0]
    assert 200 <= status < 300 or 400 <= status < 500, (status, case, raw[:300])
    if method == "HEAD":
        return
    content_type = headers.get("Content-Type", "")
    if status >= 400:
        body = json.loads(raw)
        assert_error(status, body, status, param=body["error"]["param"],
                     code=body["error"]["code"])
    elif content_type.startswith("text/event-stream"):
        events = sse_events(headers, raw)
        assert not any("error" in e for e in events), (case, events[-1])
    elif content_type.startswith("application/json"):
        assert "error" not in json.loads(raw), (case, raw[:300])


def send_all(port: int, pool, cases: list[tuple[str, str, dict, bytes]], kind: str,
             expect: int | None = None) -> list[str]:
    """Sends the cases, BATCH at a time; returns what went wrong, one line a case."""
    def one(case):
        method, path, headers, body = case
        return request(port, method, path, body or None, headers, timeout=HANG_S)

    failures = []
    for case, (status, headers, raw) in zip(cases, pool.map(one, cases)):
        SENT[kind] += 1
        try:
            assert expect in (None, status), f"expected {expect}"
            check_answer(case, status, headers, raw)
        except (AssertionError, ValueError) as e:
            method, path, headers, body = case
            failures.append(f"{method} {path} {headers} {body[:120]!r}: {status} {e}"[:400])
    return failures


def json_case(path: str, body) -> tuple[str, str, dict, bytes]:
    return "POST", path, {"Content-Type": "application/json"}, fs.encode(body)


def cheap(path: str, body):
    """Chat without a length limit runs to the end of the context: keep fuzzing fast."""
    if path == "/v1/chat/completions" and isinstance(body, dict) and \
            body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 1
    return body


# -- the description ---------------------------------------------------------------------------

def test_openapi_json_describes_the_routes(live):
    status, spec = get_json(live.port, "/openapi.json")
    assert status == 200
    assert spec == openapi_spec(MODEL, len(live.tokenizer), live.engine.max_model_len)
    # A stored response's id: an unknown one is rightly a 404.
    status, stored = post(live.port, "/v1/responses", {"input": "Hi", "max_output_tokens": 1})
    assert status == 200, stored
    for path, ops in spec["paths"].items():
        for method in ops:
            url = path.replace("{model}", MODEL).replace("{response_id}", stored["id"])
            body = b"{}" if method == "post" else None
            assert request(live.port, method.upper(), url, body)[0] != 404, (method, path)
    assert get_json(live.port, "/v1/not-described")[0] == 404


def _base(path: str) -> dict:
    return {"/v1/completions": {"prompt": "Hi", "max_tokens": 1},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}],
                                     "max_tokens": 1},
            "/tokenize": {"prompt": "Hi"}, "/detokenize": {"tokens": [1]}}[path]


def test_every_described_field_is_validated_under_its_name(live, schemas):
    """A list of lists is the wrong type for every field: each one the description lists
    must be refused with that field named, so the description holds no field the server
    ignores."""
    checked = 0
    for path, schema in schemas.items():
        assert post(live.port, path, _base(path))[0] == 200, path
        for field in schema["properties"]:
            status, body = post(live.port, path, {**_base(path), field: [[]]})
            assert status == 400, (path, field, body)
            assert_error(status, body, 400, param=field, code=body["error"]["code"])
            checked += 1
    assert checked > 50


# -- sweeps: every field, content type, method, path and key header, each hostile value ------

def test_sweep_every_field_with_hostile_values(live, schemas, pool):
    cases = [json_case(path, cheap(path, {**_base(path), field: value}))
             for path, schema in schemas.items() for field in sorted(schema["properties"])
             for value in fs.SWEEP]
    failures = send_all(live.port, pool, cases, "field sweep")
    assert not failures, "\n".join(failures[:30])


def test_sweep_raw_requests(live, pool):
    cases = [("POST", "/v1/completions", {"Content-Type": t} if t else {}, body)
             for t in fs.CONTENT_TYPES for body in fs.RAW_BODIES]
    cases += [(method, path, {"Content-Type": "application/json"}, fs.VALID)
              for method in fs.METHODS for path in fs.PATHS]
    failures = send_all(live.port, pool, cases, "raw sweep")
    assert not failures, "\n".join(failures[:30])


def test_sweep_authorization_headers(live, pool):
    cases = [(method, path, {"Authorization": value}, fs.VALID)
             for value in fs.AUTHORIZATIONS
             for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"))]
    failures = send_all(live.auth_port, pool, cases, "key sweep", expect=401)
    assert not failures, "\n".join(failures[:30])


# -- fuzzing -----------------------------------------------------------------------------------

def draw_batch(data, schemas: dict, bodies) -> list[tuple[str, str, dict, bytes]]:
    """BATCH requests to random routes; bodies(path) is the strategy for a route's body."""
    cases = []
    for _ in range(BATCH):
        path = data.draw(st.sampled_from(sorted(schemas)))
        cases.append(json_case(path, cheap(path, data.draw(bodies(path)))))
    return cases


@settings(FUZZ, max_examples=8)
@given(data=st.data())
def test_fuzz_bodies_from_the_description(live, schemas, pool, data):
    cases = draw_batch(data, schemas, lambda path: fs.from_schema(schemas[path]))
    assert not send_all(live.port, pool, cases, "described bodies")


@settings(FUZZ, max_examples=20)
@given(data=st.data())
def test_fuzz_hostile_fields(live, schemas, pool, data):
    def bodies(path):
        return fs.mutated(fs.from_schema(schemas[path]), sorted(schemas[path]["properties"]))
    assert not send_all(live.port, pool, draw_batch(data, schemas, bodies), "hostile fields")


@FUZZ
@given(cases=st.lists(fs.raw_requests(), min_size=BATCH, max_size=BATCH))
def test_fuzz_raw_requests(live, pool, cases):
    assert not send_all(live.port, pool, cases, "raw requests")


# -- malformed HTTP --------------------------------------------------------------------------

def _exchange(port: int, data: bytes, half_close: bool) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=HANG_S) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
MALFORMED = [  # (raw bytes, half-close after sending)
    (HEAD + b"Content-Length: 100\r\n\r\n" + fs.VALID, True),  # body cut short
    (HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n" + fs.VALID + b"\r\n0\r\n\r\n", False),
    (HEAD + b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"pro", True),  # chunk cut short
    (HEAD + b"Content-Length: -1\r\n\r\n" + fs.VALID, False),
    (HEAD + b"Content-Length: 36\r\nContent-Length: 5\r\n\r\n" + fs.VALID, False),
    (HEAD + b"Authorization: Bearer \x01\x02\r\nContent-Length: 36\r\n\r\n" + fs.VALID, False),
    (HEAD + b"X-Long: " + b"a" * 20000 + b"\r\nContent-Length: 36\r\n\r\n" + fs.VALID, False),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40, True),  # TLS hello
    (b"GET /health HTTP/9.9\r\n\r\n", False),
    (b"POST\r\n\r\n", False),
]


@pytest.mark.parametrize("data,half_close", MALFORMED)
def test_malformed_http_gets_4xx_or_close(live, data, half_close):
    """HTTP that cannot be parsed never reaches a route: aiohttp's parser answers a plain
    400 (or, for a body the client cut short, closes). Never a 5xx, never a hang."""
    answer = _exchange(live.port, data, half_close)
    SENT["malformed HTTP"] += 1
    if answer:
        status = int(answer.split(b" ", 2)[1])
        assert 400 <= status < 500, answer[:300]
    else:
        assert half_close, "closed without an answer"
    assert get_json(live.port, "/health")[0] == 200


def test_server_serves_normally_after_fuzzing(live):
    """Runs last in this module: the server answers, every page is free, nothing waits."""
    status, body = post(live.port, "/v1/completions",
                        {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4,
                         "temperature": 0, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 4, body
    live.wait_idle()
    print(f"\nfuzz: {sum(SENT.values())} requests sent: "
          + ", ".join(f"{kind} {n}" for kind, n in SENT.items()))
