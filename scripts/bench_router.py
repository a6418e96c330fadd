"""xlaserve workers behind a fleet router (vllm-router or sglang-router), measured with
scripts/bench_serving.py: what the router adds over a worker reached directly, and what
cache-aware routing gains over round robin on multi-turn chat (prefix hit rate, TTFT).

    python scripts/bench_router.py [--router vllm-router] [--worker-flags "..."] \\
        [--num-prompts 16] [--num-turns 4] [--system-len 600] [--max-concurrency 8]

Starts two `xlaserve serve` workers (the demo model unless --worker-flags names another),
then for each case resets both prefix caches, runs the workload and reads every worker's
/metrics before and after. Cases: one worker direct; the router in front of that one worker
(round robin: the router's own latency); both workers behind round robin and behind
cache_aware on the multi-turn workload. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import bench_serving  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, method: str = "GET", timeout: float = 5) -> str:
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[0]} exited with {proc.returncode}")
        try:
            http(url + "/health")
            return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"{url} not healthy in {timeout:.0f} s")


def counter(url: str, name: str) -> float:
    """A counter's total over its series (every engine rank)."""
    total = 0.0
    for line in http(url + "/metrics").splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})


def router_cmd(kind: str, policy: str, workers: list[str], port: int) -> list[str]:
    exe = str(Path(sys.executable).parent / kind)
    head = [exe, "launch"] if kind == "sglang-router" else [exe]
    return [*head, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
            "--policy", policy, "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(free_port())]


def run_case(name: str, base_url: str, workers: list[str], bench_args: list[str]) -> dict:
    for w in workers:
        http(w + "/reset_prefix_cache", "POST")
    hits = [counter(w, "xlaserve:prefix_cache_hits_total") for w in workers]
    queries = [counter(w, "xlaserve:prefix_cache_queries_total") for w in workers]
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        code = bench_serving.main(["--base-url", base_url, *bench_args,
                                   "--save-result", out.name])
        result = json.load(open(out.name))
    result = result[0] if isinstance(result, list) else result
    hit = sum(counter(w, "xlaserve:prefix_cache_hits_total") for w in workers) - sum(hits)
    asked = (sum(counter(w, "xlaserve:prefix_cache_queries_total") for w in workers)
             - sum(queries))
    return {"case": name, "ok": code == 0, "req/s": result["request_throughput"],
            "out tok/s": result["output_throughput"],
            "median TTFT ms": result["median_ttft_ms"], "p99 TTFT ms": result["p99_ttft_ms"],
            "median TPOT ms": result["median_tpot_ms"],
            "prefix hit rate": hit / asked if asked else 0.0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--router", default="vllm-router", choices=["vllm-router", "sglang-router"])
    p.add_argument("--worker-flags", default="", help="extra `xlaserve serve` flags")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--num-turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=600)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=8)
    args = p.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="bench-router-"))
    procs = []
    try:
        ports = [free_port(), free_port()]
        workers = [f"http://127.0.0.1:{port}" for port in ports]
        for i, port in enumerate(ports):
            procs.append(start([sys.executable, "-m", "serving", "serve", "--port", str(port),
                                "--disable-log-stats", "--disable-access-log",
                                *shlex.split(args.worker_flags)], logs / f"worker{i}.log"))
        for url, proc in zip(workers, procs):
            wait_healthy(url, proc, 600)
        # named, not asked of the router: sglang-router answers /v1/models as text/plain
        model = ["--model", json.loads(http(workers[0] + "/v1/models"))["data"][0]["id"]]
        random = [*model, "--dataset", "random", "--input-len", "256", "--output-len",
                  str(args.output_len), "--num-prompts", str(4 * args.num_prompts),
                  "--max-concurrency", str(args.max_concurrency)]
        chat = [*model, "--dataset", "multi-turn", "--num-prompts", str(args.num_prompts),
                "--num-turns", str(args.num_turns), "--system-len", str(args.system_len),
                "--output-len", str(args.output_len),
                "--max-concurrency", str(args.max_concurrency)]
        rows = []
        cases = [(None, workers[:1], random, "random: one worker, direct"),
                 ("round_robin", workers[:1], random, "random: that worker behind the router"),
                 (None, workers[:1], chat, "multi-turn: one worker, direct"),
                 ("round_robin", workers, chat, "multi-turn: two workers, round_robin"),
                 ("cache_aware", workers, chat, "multi-turn: two workers, cache_aware")]
        for policy, behind, bench, name in cases:
            if policy is None:
                rows.append(run_case(name, behind[0], behind, bench))
                continue
            port = free_port()
            router = start(router_cmd(args.router, policy, behind, port),
                           logs / f"router-{policy}-{len(behind)}.log")
            try:
                wait_healthy(f"http://127.0.0.1:{port}", router, 60)
                rows.append(run_case(name, f"http://127.0.0.1:{port}", behind, bench))
            finally:
                router.kill()
                router.wait()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    keys = list(rows[0])
    print(f"\n{args.router}; logs in {logs}\n")
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v)
                                for v in r.values()) + " |")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
