"""Two `xlaserve serve` workers behind the routers vLLM and SGLang fleets run (vllm-router and
sglang-router, PyPI wheels in the test extra), everything on 127.0.0.1 (docs/architecture.md,
"Fleets: routers, data parallelism and disaggregation"): every request succeeds through
them, streamed and not, with the fields they add to bodies; round robin spreads requests over
both workers; cache-aware routing keeps a shared prefix on one worker, whose prefix-cache hits
rise; the routers' load and cache-flush fan-outs reach the workers."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from tests.server_util import (CLI_FLAGS, MODEL, free_port, metric, metrics, request,
                               wait_healthy, wait_until)

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
READY_S = 300  # both workers load (or on a cold cache compile) their programs on two cores
# A long shared system prompt: several pages of the same tokens in every cache-aware request
SYSTEM = ("You are a careful assistant for a weather service. Answer in one short sentence, "
          "name the city, give the temperature in Celsius and say whether to take an umbrella. "
          "Never invent data you were not given; say when you do not know. ") * 2


class Workers:
    """Two demo-model workers (the server tests' small buckets, so their programs load from
    the executable cache the other server tests fill)."""

    def __init__(self, tmp: Path):
        self.ports = [free_port(), free_port()]
        self.logs = [tmp / f"worker{i}.log" for i in range(2)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.procs = []
        for port, path in zip(self.ports, self.logs):
            cmd = [sys.executable, "-m", "serving", "serve", *CLI_FLAGS, "--port", str(port),
                   "--served-model-name", MODEL, "--disable-log-stats"]
            with path.open("w") as log:
                self.procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                                   stderr=subprocess.STDOUT))
        for port, proc, path in zip(self.ports, self.procs, self.logs):
            wait_healthy(port, READY_S, alive=lambda proc=proc: proc.poll() is None
                         or print(path.read_text()[-3000:]))

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.ports]

    def finished(self) -> list[float]:
        """Requests each worker has finished so far, by its /metrics."""
        return [sum(v for (name, _), v in metrics(port).items()
                    if name == "xlaserve:request_success_total") for port in self.ports]

    def prefix_hits(self) -> list[float]:
        return [metric(metrics(port), "xlaserve:prefix_cache_hits_total")
                for port in self.ports]

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    w = Workers(tmp_path_factory.mktemp("fleet"))
    yield w
    w.close()


class Router:
    """A router process in front of the workers; its own port, killed at the end."""

    def __init__(self, argv: list[str], log: Path):
        self.port = free_port()
        self.log = log
        with log.open("w") as out:
            self.proc = subprocess.Popen([*argv, "--host", "127.0.0.1", "--port",
                                          str(self.port), "--prometheus-host", "127.0.0.1",
                                          "--prometheus-port", str(free_port())],
                                         stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        wait_healthy(self.port, 60, alive=lambda: self.proc.poll() is None)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused",
                             max_retries=0, timeout=120)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def vllm_router(workers: Workers, policy: str, tmp: Path) -> Router:
    return Router([str(BIN / "vllm-router"), "--worker-urls", *workers.urls, "--policy", policy],
                  tmp / f"vllm-router-{policy}.log")


def sglang_router(workers: Workers, policy: str, tmp: Path) -> Router:
    return Router([str(BIN / "sglang-router"), "launch", "--worker-urls", *workers.urls,
                   "--policy", policy], tmp / f"sglang-router-{policy}.log")


def ask(client: openai.OpenAI, text: str, stream: bool = False, system: str | None = None) -> str:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}]
    if stream:
        chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                temperature=0, stream=True)
        text_out, reasons = "", []
        for chunk in chunks:
            if chunk.choices:
                text_out += chunk.choices[0].delta.content or ""
                reasons.append(chunk.choices[0].finish_reason)
        assert reasons[-1] in ("length", "stop")
        return text_out
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                         temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")
    return out.choices[0].message.content


def deltas(before: list[float], after: list[float]) -> list[float]:
    return [b - a for a, b in zip(before, after)]


def test_vllm_router_round_robin_spreads_and_fans_out(workers, tmp_path):
    router = vllm_router(workers, "round_robin", tmp_path)
    try:
        client = router.client()
        before = workers.finished()
        direct = openai.OpenAI(base_url=workers.urls[0] + "/v1", api_key="unused",
                               max_retries=0)
        expected = ask(direct, "Name a colour.")
        direct_done = workers.finished()
        answers = [ask(client, "Name a colour.", stream=i % 2 == 1) for i in range(6)]
        assert answers == [expected] * 6  # the router's added body fields change nothing
        wait_until(lambda: sum(deltas(direct_done, workers.finished())) == 6, 30,
                   "the workers to count six requests")
        assert deltas(direct_done, workers.finished()) == [3, 3]
        assert sum(deltas(before, workers.finished())) == 7

        status, _, body = request(router.port, "GET", "/v1/models")
        assert status == 200 and MODEL in body.decode()
        status, _, body = request(router.port, "POST", "/flush_cache")
        assert status == 200, body  # fanned out to both idle workers, which both reset
    finally:
        router.close()


@pytest.mark.parametrize("router_kind", ["vllm-router", "sglang-router"])
def test_cache_aware_keeps_a_shared_prefix_on_one_worker(workers, tmp_path, router_kind):
    start = vllm_router if router_kind == "vllm-router" else sglang_router
    router = start(workers, "cache_aware", tmp_path)
    try:
        client = router.client()
        for port in workers.ports:  # a cold start on both: hits come from this test only
            assert request(port, "POST", "/reset_prefix_cache")[0] == 200
        before, hits_before = workers.finished(), workers.prefix_hits()
        for i, city in enumerate(["Paris", "Oslo", "Lima", "Kyoto", "Cairo"]):
            ask(client, f"What is the weather in {city}?", stream=i == 2, system=SYSTEM)
        wait_until(lambda: sum(deltas(before, workers.finished())) == 5, 30,
                   "the workers to count five requests")
        served = deltas(before, workers.finished())
        hits = deltas(hits_before, workers.prefix_hits())
        assert sorted(served) == [0, 5], served  # all on one worker...
        busy = served.index(5)
        assert hits[busy] >= 4 * 16 and hits[1 - busy] == 0, hits  # ...which hits its prefix
    finally:
        router.close()
