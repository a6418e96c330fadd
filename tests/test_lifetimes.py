"""The suite's own bookkeeping (tests/lifetimes.py, tests/budget.py): shared fixtures' users
run together and each is closed after its last user; an engine a module dropped is really
freed once the module's memory is released; the budget table counts what it measured."""
from __future__ import annotations

import contextlib
import gc
import weakref
from dataclasses import dataclass

import pytest

from tests import budget, lifetimes


@dataclass
class FakeItem:
    nodeid: str
    fixturenames: tuple = ()


def test_users_of_a_shared_fixture_run_together_and_it_closes_after_the_last(monkeypatch):
    monkeypatch.setattr(lifetimes, "_still_needed", {})
    monkeypatch.setattr(lifetimes, "_live", {})
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    items = [FakeItem("a.py::t1", ("shared_server",)), FakeItem("b.py::t1"),
             FakeItem("c.py::t1", ("demo_llm",)), FakeItem("c.py::t2"),
             FakeItem("d.py::t1", ("demo_llm", "shared_server")), FakeItem("e.py::t1")]
    lifetimes.order_and_plan(items)
    order = list(dict.fromkeys(i.nodeid.split("::")[0] for i in items))
    # no shared fixture first, then demo_llm's users, both, shared_server's only
    assert order == ["b.py", "e.py", "c.py", "d.py", "a.py"]
    assert [i.nodeid for i in items if i.nodeid.startswith("c.py")] == ["c.py::t1", "c.py::t2"]

    closed = []

    @contextlib.contextmanager
    def resource(name):
        try:
            yield Handle(name)
        finally:
            closed.append(name)

    llm = lifetimes.shared("demo_llm", resource("demo_llm"))
    server = lifetimes.shared("shared_server", resource("shared_server"))
    lifetimes.release("c.py")  # d.py still needs both
    assert closed == [] and llm.name == "demo_llm"
    lifetimes.release("d.py")  # a.py needs the server only
    assert closed == ["demo_llm"]
    with pytest.raises(AttributeError):  # emptied: a use after release fails loudly
        llm.name
    assert server.name == "shared_server"
    lifetimes.release("a.py")
    assert closed == ["demo_llm", "shared_server"] and lifetimes._live == {}


class Handle:
    def __init__(self, name):
        self.name = name


def test_an_engine_a_module_dropped_is_freed(tmp_path):
    """Nothing (JAX's caches, jitted closures, threads) keeps a dropped engine alive once
    the module's memory is released: its weights and KV cache go with it."""
    from model.checkpoint import convert_hf
    from serving import LLM, SamplingParams
    from tests.hf_tiny import tiny_hf_model
    tiny_hf_model("llama", tmp_path / "hf")
    convert_hf(tmp_path / "hf", tmp_path / "ckpt", "float32", progress=False)
    llm = LLM(str(tmp_path / "ckpt"), max_model_len=64, max_num_seqs=2, progress=False,
              max_num_batched_tokens=8, token_buckets=(8,), request_buckets=(2,),
              compilation_cache_dir=None)
    [out] = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4,
                                                     ignore_eos=True))
    assert len(out.token_ids) == 4
    engine, cache = weakref.ref(llm.engine), weakref.ref(llm.engine.runner.cache)
    del llm, out
    lifetimes.free_memory()
    assert engine() is None and cache() is None, gc.get_referrers(engine() or cache())


def test_a_server_that_answered_a_request_is_freed():
    """aiohttp caches each handler's middleware chain with its application: released, a
    test server's application (and the engine in its state) goes when the module ends."""
    import asyncio

    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    class Engine:  # stands for the engine an app's state holds
        pass

    engine = Engine()
    key = web.AppKey("engine", Engine)

    @web.middleware
    async def passing(request, handler):  # servers have middlewares: the chain is cached
        return await handler(request)

    async def health(request):
        return web.Response(text="ok")

    async def serve_one():
        app = web.Application(middlewares=[passing])
        app[key] = engine
        app.router.add_get("/health", health)
        async with TestClient(TestServer(app)) as client:
            assert (await (await client.get("/health")).text()) == "ok"
    asyncio.run(serve_one())
    gone = weakref.ref(engine)
    del engine
    lifetimes.free_memory()
    assert gone() is None


def test_the_budget_counts_each_module():
    b = budget.Budget()
    try:
        b.enter("x.py")
        b.current.tests += 2
        blob = bytearray(64 << 20)
        blob[::4096] = b"\1" * len(range(0, len(blob), 4096))  # every page touched: resident
        b.enter("y.py")  # leaving x.py
        del blob
        b.current.tests += 1
        b.close()
    finally:
        b.stop.set()
    x, y = b.modules
    assert (x.name, x.tests, y.name, y.tests) == ("x.py", 2, "y.py", 1)
    assert x.peak_self >= x.rss_before + (60 << 20)  # the 64 MiB showed in x.py's peak
    assert x.peak_tree >= x.peak_self
    assert "| x.py | 2 |" in b.table() and "min of tests" in b.summary()


def test_the_budget_of_a_run_without_tests():  # --collect-only still prints the summary
    b = budget.Budget()
    b.close()
    assert "min of tests" in b.summary()
