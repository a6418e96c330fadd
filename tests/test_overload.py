"""Overload: more load than --max-queued-requests allows (the shared server's queue-limited
app, MAX_QUEUED waiting requests, over an engine running at most 32).

The excess is refused with 503 queue_full while the admitted requests hold every slot, so
a refusal never waits for capacity; the admitted requests run to the end with the text
they have alone; nothing deadlocks, and the server admits again once the load is gone.
Latencies are printed (run with -s), not asserted.
"""
from __future__ import annotations

import asyncio
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.http_stream import Stream, text
from tests.server_util import (MAX_QUEUED, MODEL, assert_error, metric, metrics, post,
                               request, wait_until)

pytestmark = pytest.mark.slow

MAX_NUM_SEQS = 32  # tests/server_util.py ENGINE
BURST = 40
PROMPT = {"model": MODEL, "prompt": "The best way to learn is", "temperature": 0,
          "ignore_eos": True}


def timed_post(port: int, body: dict) -> tuple[int, dict, float]:
    started = time.monotonic()
    status, body = post(port, "/v1/completions", body)
    return status, body, time.monotonic() - started


def test_excess_gets_503_while_admitted_requests_finish(shared_server):
    live = shared_server
    live.wait_idle()
    want = timed_post(live.port, {**PROMPT, "max_tokens": 16})
    assert want[0] == 200
    # Every slot taken and more waiting, through the app without a limit.
    started = time.monotonic()
    admitted = [Stream(live.port, "/v1/completions", {**PROMPT, "max_tokens": 16})
                for _ in range(MAX_NUM_SEQS + MAX_QUEUED)]
    wait_until(lambda: metric(metrics(live.port), "xlaserve:num_requests_waiting")
               >= MAX_QUEUED, 120, "requests to queue")

    with ThreadPoolExecutor(8) as pool:
        refused = list(pool.map(lambda i: timed_post(live.queue_port, {
            **PROMPT, "max_tokens": 4, "seed": i}), range(BURST)))
    during = metrics(live.port)
    for status, body, _ in refused:
        assert_error(status, body, 503, code="queue_full", type_="service_unavailable_error")
    # Refused without waiting for capacity: no admitted request had finished yet.
    assert metric(during, "xlaserve:num_requests_running") + metric(
        during, "xlaserve:num_requests_waiting") == len(admitted)

    for s in admitted:
        events = s.rest()
        assert text(events) == want[1]["choices"][0]["text"]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
    admitted_s = time.monotonic() - started
    live.wait_idle()
    status, body = post(live.queue_port, "/v1/completions", {**PROMPT, "max_tokens": 2})
    assert status == 200, body
    waits = sorted(t for *_, t in refused)
    print(f"\noverload: {BURST} refused with 503 (median {statistics.median(waits) * 1e3:.0f}"
          f" ms, max {waits[-1] * 1e3:.0f} ms) while {len(admitted)} admitted requests ran;"
          f" one request alone {want[2]:.1f} s, all admitted done in {admitted_s:.1f} s")


def test_burst_on_the_limited_app_never_deadlocks(shared_server):
    """A burst straight at the limited app: each answer is a complete 200 or a 503, and
    the server is idle and admitting afterwards."""
    live = shared_server
    live.wait_idle()

    def one(i: int) -> tuple[int, bytes]:
        body = {**PROMPT, "max_tokens": 6, "stream": i % 2 == 1}
        status, _, raw = request(live.queue_port, "POST", "/v1/completions", body)
        return status, raw

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(one, range(BURST)))
    statuses = [status for status, _ in answers]
    assert set(statuses) <= {200, 503}, statuses
    assert 200 in statuses
    for status, raw in answers:
        if status == 200:
            assert raw.endswith(b"data: [DONE]\n\n") or b'"completion_tokens": 6' in raw, raw
    live.wait_idle()
    print(f"\nburst on the limited app: {statuses.count(200)} admitted, "
          f"{statuses.count(503)} refused of {BURST}")


def test_a_burst_sees_each_admitted_request_at_once(shared_server):
    """Admission counts a request as waiting from the moment it is submitted. Over an
    engine whose loop never runs, whatever is admitted waits forever: of a burst, exactly
    MAX_QUEUED are admitted and the rest refused, however fast they arrive."""
    from serving.openai.api_server import build_app
    from serving.engine.async_engine import AsyncEngine

    stalled = AsyncEngine(shared_server.engine)  # never started
    stalled.ready = True

    async def go():
        app = build_app(stalled, served_model_name=MODEL, max_queued_requests=MAX_QUEUED)
        async with TestClient(TestServer(app)) as client:
            burst = [asyncio.create_task(client.post("/v1/completions", json={
                **PROMPT, "max_tokens": 2})) for _ in range(MAX_QUEUED + 4)]
            refused = []
            while len(refused) < 4:
                done, _ = await asyncio.wait([t for t in burst if t not in refused],
                                             timeout=60, return_when=asyncio.FIRST_COMPLETED)
                assert done, "no answer within 60 s"
                refused += done
            for task in refused:
                assert task.result().status == 503
                assert (await task.result().json())["error"]["code"] == "queue_full"
            waiting = [t for t in burst if t not in refused]
            assert len(waiting) == MAX_QUEUED and not any(t.done() for t in waiting)
            for task in waiting:
                task.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)

    asyncio.run(go())
