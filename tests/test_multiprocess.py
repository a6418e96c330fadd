"""One model over two processes on this machine (docs/architecture.md, "Several processes"):
`xlaserve serve` twice with --coordinator-address / --num-processes / --process-id, two
simulated CPU devices each, the model split over all four (gloo between the processes).
Process 0 answers HTTP with the tokens one process gives; a follower that dies fails the
request in flight and process 0 exits 1 within seconds; process 0 dying ends the follower.

The processes get their own XLA_FLAGS; nothing reaches this session."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from serving import LLM
from tests.demo_engine import greedy
from tests.hf_tiny import tiny_hf_model
from tests.server_util import free_port, get_json, post, request
from tests.test_tensor_parallel import SHAPES

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--max-num-seqs", "4", "--max-model-len", "64", "--max-num-batched-tokens", "16",
         "--page-size", "4", "--token-buckets", "16", "--request-buckets", "4",
         "--compilation-cache-dir", "", "--attention-backend", "cpu", "--quantize", "none",
         "--disable-log-stats", "--tensor-parallel-size", "4"]
PROMPT = [3, 5, 7, 9, 11, 13, 15]
READY_S = 300  # both processes compile their programs on two shared cores


@pytest.fixture(scope="module")
def model(tmp_path_factory, demo_model_dir):
    folder = tmp_path_factory.mktemp("mp-model")
    # The demo's tokenizer, so the server starts as it does for any model (structured
    # outputs need the vocabulary to cover it).
    tiny_hf_model("llama", folder, seed=1, **{**SHAPES, "vocab_size": 49152})
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(demo_model_dir / name, folder / name)
    return str(folder)


class Cluster:
    """Two `xlaserve serve` processes of one model; process 0 listens on `self.port`."""

    def __init__(self, model: str, tmp: Path):
        self.port, coordinator = free_port(), f"127.0.0.1:{free_port()}"
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env.update(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
                   PYTHONPATH=str(ROOT))
        self.logs = [tmp / f"process{i}.log" for i in range(2)]
        self.procs = []
        for i in range(2):
            cmd = [sys.executable, "-m", "serving", "serve", model, *FLAGS, "--port",
                   str(self.port), "--coordinator-address", coordinator,
                   "--num-processes", "2", "--process-id", str(i)]
            with self.logs[i].open("w") as log:
                self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                   env=env, cwd=ROOT))

    def log(self, i: int) -> str:
        return self.logs[i].read_text()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            for i, p in enumerate(self.procs):
                assert p.poll() is None, f"process {i} exited:\n{self.log(i)[-3000:]}"
            try:
                if request(self.port, "GET", "/health", timeout=5)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(1)
        raise AssertionError(f"not ready in {READY_S} s:\n{self.log(0)[-3000:]}")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def wait_exit(proc, seconds: float) -> int | None:
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return None


@pytest.fixture
def cluster(model, tmp_path):
    c = Cluster(model, tmp_path)
    yield c
    c.close()


def test_two_processes_answer_as_one_and_the_follower_exits_with_process_0(model, cluster):
    alone = LLM(model, attention_backend="cpu", quantize="none", max_num_seqs=4,
                max_model_len=64, max_num_batched_tokens=16, page_size=4,
                token_buckets=(16,), request_buckets=(4,), compilation_cache_dir="",
                progress=False).generate([PROMPT], greedy(10))[0]
    cluster.wait_ready()
    status, body = post(cluster.port, "/v1/completions",
                        dict(model=get_json(cluster.port, "/v1/models")[1]["data"][0]["id"],
                             prompt=PROMPT, max_tokens=10, temperature=0, ignore_eos=True))
    assert status == 200, body
    assert body["choices"][0]["text"] == alone.text and alone.text
    assert "tensor parallel 2/4 on" in cluster.log(1)  # the follower holds shards 2 and 3
    cluster.procs[0].send_signal(signal.SIGKILL)
    code = wait_exit(cluster.procs[1], 20)
    assert code not in (None, 0), cluster.log(1)[-2000:]
    assert "process 0 (the leader) is gone" in cluster.log(1)


def test_a_follower_that_dies_fails_the_request_and_process_0_exits(cluster):
    cluster.wait_ready()
    model_id = get_json(cluster.port, "/v1/models")[1]["data"][0]["id"]
    answer = {}

    def long_request():
        answer["status"], answer["body"] = post(cluster.port, "/v1/completions", dict(
            model=model_id, prompt=PROMPT, max_tokens=50, temperature=0, ignore_eos=True,
            n=4))
    def requests_until_refused():  # many long requests in a row: one is in flight when
        for _ in range(50):          # the follower goes
            try:
                long_request()
            except OSError:  # process 0 has exited
                return
    client = threading.Thread(target=requests_until_refused, daemon=True)
    client.start()
    time.sleep(2)
    cluster.procs[1].send_signal(signal.SIGKILL)
    started = time.monotonic()
    code = wait_exit(cluster.procs[0], 30)
    assert code == 1, cluster.log(0)[-3000:]
    assert time.monotonic() - started < 15
    client.join(10)
    # Whichever notices first: the watcher ("process 1 (a follower) is gone") or the step's
    # collective (gloo: connection reset); either way an error, never a hang.
    body = str(answer["body"])
    assert answer["status"] >= 500 and ("a follower) is gone" in body
                                        or "engine failed" in body), answer
    assert "process 1 (a follower) is gone" in cluster.log(0)
