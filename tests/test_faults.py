"""Engine faults, injected through serving.engine.faults on the real engine (demo model).

One request's failure (its sampling inputs, its detokenization) fails that request alone:
it gets an error, in its stream if it was streaming, and the requests batched with it
finish with the same text as without the fault. A failed device step kills the engine:
every in-flight request gets an error, every page comes back, /health answers 503,
new requests are refused and run_server returns 1 (the process exits non-zero).
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from aiohttp import web

from serving.engine.faults import Faults
from tests.http_stream import Stream, text
from tests.server_util import (ENGINE, MODEL, assert_error, free_port, get_json, metric,
                               metrics, post, wait_healthy, wait_until)

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time"


def body(seed: int, max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "seed": seed}


def in_band_error(events: list[dict]) -> dict:
    """A stream that started, then failed: chunks, then one error event last."""
    *chunks, last = events
    assert chunks and all("error" not in c for c in chunks), events
    assert set(last) == {"error"}, last
    return last["error"]


# -- one request fails --------------------------------------------------------------------------

def test_one_requests_fault_fails_only_that_request(shared_server):
    live = shared_server
    live.wait_idle()
    want = post(live.port, "/v1/completions", body(1, 24))[1]["choices"][0]["text"]
    before = metrics(live.port)
    bystanders = [Stream(live.port, "/v1/completions", body(i, 24)) for i in range(1, 4)]
    for s in bystanders:
        s.read(2)  # all three are running now, and stay running for ~20 more steps
    live.engine.faults = Faults.parse("sampling:101,detokenize:202,detokenize:203:3")
    try:
        with ThreadPoolExecutor(3) as pool:
            refused = [pool.submit(post, live.port, "/v1/completions", body(seed, 24))
                       for seed in (101, 202)]
            mid_stream = Stream(live.port, "/v1/completions", body(203, 24))
            broken = mid_stream.rest()
            for future, stage in zip(refused, ("sampling inputs", "detokenization")):
                status, err = future.result()
                assert_error(status, err, 500, type_="server_error")
                assert stage in err["error"]["message"], err
        assert "detokenization" in in_band_error(broken)["message"]
        assert 1 <= len(text(broken[:-1])) < len(want)  # it failed part-way
        for s in bystanders:
            events = s.rest()
            assert text(events) == want
            assert events[-1]["choices"][0]["finish_reason"] == "length"
    finally:
        live.engine.faults = None
    live.wait_idle()
    errors = metric(metrics(live.port), "xlaserve:request_success_total",
                    finished_reason="error") - metric(before, "xlaserve:request_success_total",
                                                      finished_reason="error")
    assert errors == 3
    assert post(live.port, "/v1/completions", body(101, 4))[0] == 200  # fault off: served


def test_a_request_the_engine_cannot_add_gets_an_error(shared_server, monkeypatch):
    """Any exception while adding a request reaches its client (it used to be logged only,
    leaving the client waiting forever)."""
    live = shared_server

    def broken(*args):
        raise RuntimeError("tokenizer state lost")
    monkeypatch.setattr(live.engine, "add_request", broken)
    status, err = post(live.port, "/v1/completions", body(1, 4))
    assert_error(status, err, 500, type_="server_error")
    assert "tokenizer state lost" in err["error"]["message"]
    monkeypatch.undo()
    assert post(live.port, "/v1/completions", body(1, 4))[0] == 200
    live.wait_idle()


# -- the engine dies ----------------------------------------------------------------------------

@contextlib.contextmanager
def doomed_server(checkpoint):
    """run_server over an engine of its own on `port`; next to it, on `probe_port`, an app
    over the same engine that outlives run_server, to ask /health after the engine died.
    Yields (engine, async_engine, port, probe_port, run_server's future)."""
    from serving.openai.api_server import build_app, run_server
    from serving.engine.async_engine import AsyncEngine
    from serving.core.config import EngineConfig
    from serving.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(checkpoint), progress=False, **ENGINE))
    async_engine = AsyncEngine(engine)
    async_engine.start()
    port, probe_port = free_port(), free_port()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    stop = asyncio.run_coroutine_threadsafe(_event(), loop).result(10)
    probe = web.AppRunner(build_app(async_engine, served_model_name=MODEL))
    asyncio.run_coroutine_threadsafe(_start(probe, probe_port), loop).result(30)
    served = asyncio.run_coroutine_threadsafe(run_server(
        async_engine, "127.0.0.1", port, served_model_name=MODEL, grace_period_s=60,
        stop_event=stop), loop)
    try:
        wait_healthy(port, 60, alive=lambda: not served.done())
        yield engine, async_engine, port, probe_port, served
    finally:
        loop.call_soon_threadsafe(stop.set)
        served.result(90)
        asyncio.run_coroutine_threadsafe(probe.cleanup(), loop).result(30)
        async_engine.shutdown()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


async def _event() -> asyncio.Event:
    return asyncio.Event()


async def _start(runner: web.AppRunner, port: int) -> None:
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()


def test_failed_device_step_kills_the_engine_cleanly(demo_checkpoint):
    with doomed_server(demo_checkpoint) as (engine, async_engine, port, probe_port, served):
        streaming = Stream(port, "/v1/completions", body(1, 64))
        streaming.read(2)
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(post, port, "/v1/completions", body(2, 64))
            wait_until(lambda: engine.scheduler.num_running == 2, 60, "both to run")
            engine.faults = Faults.parse("step:303:3")
            victim = Stream(port, "/v1/completions", body(303, 64))
            victim_events = victim.rest()
            status, err = waiting.result()
        assert "engine failed" in in_band_error(victim_events)["message"]
        assert "engine failed" in in_band_error(streaming.rest())["message"]
        assert_error(status, err, 500, type_="server_error")
        assert "engine failed" in err["error"]["message"]

        assert engine.scheduler.allocator.num_used_pages == 0
        assert not engine.has_unfinished and async_engine.dead is not None
        assert served.result(90) == 1  # drained, then "exit non-zero"
        status, err = get_json(probe_port, "/health")
        assert_error(status, err, 503, code="engine_dead")
        status, err = post(probe_port, "/v1/completions", body(1, 4))
        assert_error(status, err, 503, code="engine_dead")
