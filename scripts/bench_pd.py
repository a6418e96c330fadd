"""Prefill/decode disaggregation against one colocated server, on 127.0.0.1: running streams
decode while long prompts arrive. Reports the streams' TPOT and ITL (what a long prefill
sharing their steps costs them), the long prompts' TTFT, and each KV pull's time against its
pages and bytes (from the decode instance's log).

    python scripts/bench_pd.py [--streams 4 --stream-tokens 160 --long-prompts 8
                                --long-words 600 --interval 2.0 --max-model-len 1024]

It starts the servers itself (`xlaserve serve`, the demo model): first one colocated server,
then a producer and a consumer; a long prompt goes to the producer with max_tokens 1, then
with its kv_transfer_params to the consumer, as a P/D proxy sends it. Both instances share
this machine's cores: on a small box the comparison says what the handshake costs, not what
separate machines would gain.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("river stone lantern orchard copper meadow harbor signal violet thunder ember "
         "canyon willow beacon marble falcon quartz saddle timber velvet").split()
PULL = re.compile(r"pulled (\d+) pages \((\d+) padded, ([\d.]+) MiB\) in ([\d.]+) ms")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(port: int, args, log: Path, kv_config: str | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "serving", "serve", "--port", str(port),
           "--max-model-len", str(args.max_model_len), "--max-num-seqs", "16",
           "--disable-log-stats"]
    if kv_config:
        cmd += ["--kv-transfer-config", kv_config]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)


async def wait_healthy(session, port: int, proc: subprocess.Popen) -> None:
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server on port {port} exited")
        try:
            async with session.get(f"http://127.0.0.1:{port}/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.5)


async def stream(session, port: int, prompt: str, max_tokens: int) -> list[float]:
    """A streaming completion; the arrival times of its content chunks."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    times = []
    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
        async for line in r.content:
            if line.startswith(b"data: {") and b'"choices":[{' in line:
                times.append(time.perf_counter())
    return times


async def post(session, port: int, body: dict) -> dict:
    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
        out = await r.json()
        if r.status != 200:
            raise RuntimeError(out)
        return out


async def long_prompt(session, i: int, args, prefill: int, decode: int | None) -> float:
    """TTFT of one long prompt: colocated (decode None), or through the P/D handshake."""
    rng = np.random.default_rng(i)  # every prompt its own: no prefix-cache hits
    words = args.long_words if i % 2 == 0 else args.long_words // 4  # two sizes of transfer
    prompt = f"{i}: " + " ".join(rng.choice(WORDS, words))
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    started = time.perf_counter()
    if decode is None:
        await post(session, prefill, {**body, "max_tokens": 1})
    else:
        pre = await post(session, prefill, {**body, "max_tokens": 1, "kv_transfer_params": {
            "do_remote_decode": True, "do_remote_prefill": False}})
        await post(session, decode, {**body, "max_tokens": 1,
                                     "kv_transfer_params": pre["kv_transfer_params"]})
    return time.perf_counter() - started


async def workload(args, prefill: int, decode: int | None, first: int) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        streams = [asyncio.create_task(stream(session, decode or prefill,
                                              f"Stream {k}: tell a long story.",
                                              args.stream_tokens))
                   for k in range(args.streams)]
        await asyncio.sleep(1.0)  # the streams are decoding
        longs = []
        for i in range(args.long_prompts):
            longs.append(asyncio.create_task(long_prompt(session, first + i, args, prefill,
                                                         decode)))
            await asyncio.sleep(args.interval)
        ttft = await asyncio.gather(*longs)
        times = await asyncio.gather(*streams)
    itl = np.concatenate([np.diff(t) for t in times])
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in times]
    return {"tpot_p50": np.percentile(tpot, 50), "tpot_p99": np.percentile(tpot, 99),
            "itl_p50": np.percentile(itl, 50), "itl_p99": np.percentile(itl, 99),
            "ttft_p50": np.percentile(ttft, 50), "ttft_p99": np.percentile(ttft, 99)}


async def run(args, folder: Path) -> None:
    results = {}
    port = free_port()
    proc = start(port, args, folder / "colocated.log")
    try:
        async with aiohttp.ClientSession() as s:
            await wait_healthy(s, port, proc)
        await workload(args, port, None, 0)  # warms the programs' first runs
        results["colocated"] = await workload(args, port, None, 1000)
    finally:
        stop(proc)
    p_port, d_port = free_port(), free_port()
    producer = start(p_port, args, folder / "producer.log",
                     f'{{"kv_role": "kv_producer", "kv_port": {free_port()}, '
                     '"kv_connector_extra_config": {"side_channel_port": 0}}')
    consumer = start(d_port, args, folder / "consumer.log",
                     '{"kv_role": "kv_consumer", "kv_port": 0}')
    try:
        async with aiohttp.ClientSession() as s:
            await wait_healthy(s, p_port, producer)
            await wait_healthy(s, d_port, consumer)
        await workload(args, p_port, d_port, 2000)
        results["P/D"] = await workload(args, p_port, d_port, 1000)
    finally:
        stop(producer)
        stop(consumer)
    print("| setup | streams TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) | long prompt TTFT "
          "p50 / p99 (s) |\n|---|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['tpot_p50'] * 1e3:.1f} / {r['tpot_p99'] * 1e3:.1f} | "
              f"{r['itl_p50'] * 1e3:.1f} / {r['itl_p99'] * 1e3:.1f} | "
              f"{r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} |")
    pulls = [tuple(map(float, m.groups())) for m in
             PULL.finditer((folder / "consumer.log").read_text(errors="replace"))]
    pulls = pulls[len(pulls) // 2:]  # the measured run's
    print("\n| pages (padded) | MiB | pulls | pull ms p50 (min-max) | ms per page | MiB/s |"
          "\n|---:|---:|---:|---:|---:|---:|")
    for pages, padded, mib in sorted({p[:3] for p in pulls}):
        ms = [p[3] for p in pulls if p[:3] == (pages, padded, mib)]
        mid = float(np.median(ms))
        print(f"| {pages:.0f} ({padded:.0f}) | {mib:.2f} | {len(ms)} | {mid:.1f} "
              f"({min(ms):.1f}-{max(ms):.1f}) | {mid / pages:.2f} | {mib / mid * 1e3:.0f} |")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=160)
    p.add_argument("--long-prompts", type=int, default=8)
    p.add_argument("--long-words", type=int, default=600)
    p.add_argument("--interval", type=float, default=2.0)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--log-dir", default=None, help="keep the servers' logs here")
    args = p.parse_args()
    folder = Path(args.log_dir or tempfile.mkdtemp(prefix="bench_pd_"))
    folder.mkdir(parents=True, exist_ok=True)
    asyncio.run(run(args, folder))
    print(f"\nlogs: {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
