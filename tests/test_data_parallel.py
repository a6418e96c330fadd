"""`xlaserve serve --data-parallel-size 2` on two simulated CPU devices, in a subprocess with
its own XLA_FLAGS (docs/architecture.md, "Fleets: routers, data parallelism and
disaggregation"): the same greedy tokens as one engine, both replicas serve, a request goes
where its prefix is cached, X-data-parallel-rank pins a request (and a bad rank is a 400),
the worker endpoints and metrics report each replica; vLLM's -dp rules refused up front."""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from serving.core.config import EngineConfig
from serving.engine.data_parallel import check_config
from tests.demo_engine import greedy
from tests.server_util import (CLI_FLAGS, MODEL, assert_error, free_port, get_json, metrics,
                               post, wait_healthy)

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
READY_S = 300  # the second replica compiles its programs (a saved one is bound to device 0)
PAGE = 16  # the server's default page size
# Prompts of 1 to 5 pages, token ids as the demo tokenizer makes them
PROMPTS = [[1], list(range(100, 120)), list(range(200, 240)), list(range(300, 380))]


class Server:
    def __init__(self, checkpoint, tmp: Path):
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env.update(XLA_FLAGS="--xla_force_host_platform_device_count=2",
                   PYTHONPATH=str(ROOT))
        self.log = tmp / "dp.log"
        cmd = [sys.executable, "-m", "serving", "serve", "--model", str(checkpoint),
               "--served-model-name", MODEL, *CLI_FLAGS, "--port", str(self.port),
               "--data-parallel-size", "2", "--disable-log-stats"]
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out,
                                         stderr=subprocess.STDOUT)
        wait_healthy(self.port, READY_S, alive=lambda: self.proc.poll() is None
                     or print(self.log.read_text()[-3000:]))

    def complete(self, prompt: list[int], max_tokens: int = 8, headers=None) -> list[int]:
        status, body = post(self.port, "/v1/completions", {
            "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}, headers)
        assert status == 200, body
        return body

    def per_engine(self, name: str) -> dict[str, float]:
        """A series' value for each engine (replica) rank."""
        from prometheus_client.parser import text_string_to_metric_families

        from tests.server_util import request
        raw = request(self.port, "GET", "/metrics")[2].decode()
        return {s.labels["engine"]: s.value for f in text_string_to_metric_families(raw)
                for s in f.samples if s.name == name}

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def server(demo_checkpoint, tmp_path_factory):
    s = Server(demo_checkpoint, tmp_path_factory.mktemp("dp"))
    yield s
    s.close()


def texts(body: dict) -> str:
    return body["choices"][0]["text"]


def test_two_replicas_give_one_engines_tokens(server, demo_llm):
    expected = [r.text for r in demo_llm.generate(PROMPTS, greedy(8))]
    with ThreadPoolExecutor(4) as pool:  # at once: both replicas busy
        got = list(pool.map(lambda p: texts(server.complete(p)), PROMPTS * 2))
    assert got == expected * 2
    queries = server.per_engine("xlaserve:prefix_cache_queries_total")
    assert set(queries) == {"0", "1"} and all(v > 0 for v in queries.values()), queries


def test_prefix_hit_places_and_rank_header_pins(server):
    shared = list(range(1000, 1000 + 3 * PAGE))
    first = server.complete(shared + [7, 8])
    hits_before = server.per_engine("xlaserve:prefix_cache_hits_total")
    second = server.complete(shared + [9, 10, 11])
    hits = server.per_engine("xlaserve:prefix_cache_hits_total")
    gained = {rank: hits[rank] - hits_before.get(rank, 0.0) for rank in hits}
    assert sorted(gained.values()) == [0.0, 3 * PAGE], gained  # found where it was cached
    assert texts(first) and texts(second)

    for rank in ("0", "1"):
        before = server.per_engine("xlaserve:prefix_cache_queries_total")
        server.complete([5, 6, 7], headers={"X-Data-Parallel-Rank": rank})
        after = server.per_engine("xlaserve:prefix_cache_queries_total")
        assert after[rank] == before.get(rank, 0.0) + 3
        assert after[str(1 - int(rank))] == before.get(str(1 - int(rank)), 0.0)
    for bad in ("2", "-1", "one"):
        status, body = post(server.port, "/v1/completions", {"prompt": [5], "max_tokens": 1},
                            {"x-data-parallel-rank": bad})
        assert_error(status, body, 400, code="invalid_data_parallel_rank")


def test_worker_endpoints_report_each_replica(server):
    status, load = get_json(server.port, "/get_load")
    assert status == 200 and [entry["dp_rank"] for entry in load] == [0, 1]
    status, info = get_json(server.port, "/server_info")
    assert (info["dp_size"], info["tp_size"]) == (2, 1)
    running = server.per_engine("vllm:num_requests_running")
    assert set(running) == {"0", "1"}
    assert "xlaserve:kv_cache_usage_perc" in {name for name, _ in metrics(server.port)}


def test_data_parallel_rules_refused_before_loading():
    check_config(EngineConfig(data_parallel_size=2), 2)
    with pytest.raises(ValueError, match="needs 4 devices; there are 2"):
        check_config(EngineConfig(data_parallel_size=2, tensor_parallel_size=2), 2)
    with pytest.raises(ValueError, match="--enable-lora"):
        check_config(EngineConfig(data_parallel_size=2, enable_lora=True), 2)
    with pytest.raises(ValueError, match="--kv-transfer-config"):
        check_config(EngineConfig(data_parallel_size=2, kv_transfer_config="{}"), 2)
    with pytest.raises(ValueError, match="at least 1"):
        check_config(EngineConfig(data_parallel_size=0), 2)
