"""Embeddings throughput: `xlaserve serve --task embed` against the transformers baseline
(scripts/hf_baseline_server.py's /v1/embeddings), on the demo model, inputs of about 128
tokens, C concurrent clients each sending one input per request. The servers run one at a time.

    python scripts/bench_embeddings.py [--concurrency 1,16,64] [--requests-per-client 4]
        [--update-doc docs/benchmarks.md]

Prints inputs per second, median latency and the ratio per level; with --update-doc the table
replaces the "embeddings" section of that file.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.bench_side_by_side import (Server, commit, free_port, machine,  # noqa: E402
                                        update_doc)

TEXT = ("The history of the city goes back to a small settlement on an island in the river, "
        "where fishermen and traders met to exchange goods. Over the centuries it grew into a "
        "centre of learning, commerce and government, with bridges, markets, churches and "
        "schools. ")


def inputs(tokenizer, n: int, tokens: int = 128) -> list[str]:
    """n distinct texts of about `tokens` tokens each (distinct, so nothing is shared)."""
    base = tokenizer.encode(TEXT * 8)
    return [f"{i}: " + tokenizer.decode(base[:tokens - 3]) for i in range(n)]


async def run_level(base_url: str, model: str, texts: list[str], conc: int) -> dict:
    import aiohttp
    latencies: list[float] = []
    queue = list(texts)

    async def client(session):
        while queue:
            text = queue.pop()
            started = time.perf_counter()
            async with session.post(f"{base_url}/v1/embeddings",
                                    json={"model": model, "input": text}) as r:
                body = await r.json()
                assert r.status == 200 and len(body["data"][0]["embedding"]) > 0, body
            latencies.append(time.perf_counter() - started)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(client(session) for _ in range(min(conc, 4))))  # warm
        queue[:] = texts
        latencies.clear()
        started = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(conc)))
        wall = time.perf_counter() - started
    return {"inputs_per_s": len(texts) / wall, "p50_ms": 1e3 * statistics.median(latencies)}


def serve(name: str, hf_dir: Path, port: int, log_dir: Path) -> Server:
    if name == "xlaserve":
        cmd = [str(ROOT / ".venv/bin/xlaserve"), "serve", "--task", "embed", "--port", str(port),
               "--disable-access-log", "--disable-log-stats"]
    else:
        cmd = [sys.executable, str(ROOT / "scripts/hf_baseline_server.py"), "--model",
               str(hf_dir), "--port", str(port), "--threads", "2"]
    return Server(name, cmd, port, log_dir)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--min-requests", type=int, default=32)
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--update-doc", default=None)
    args = p.parse_args(argv)
    from model import demo
    from transformers import AutoTokenizer
    hf_dir = demo.fetch_demo_model(demo.cache_dir() / "demo" / "SmolLM2-135M-Instruct-hf")
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    levels = [int(c) for c in args.concurrency.split(",")]
    log_dir = Path("/tmp/bench_embeddings")
    log_dir.mkdir(exist_ok=True)
    results: dict[str, dict[int, dict]] = {}
    for name in ("xlaserve", "transformers"):
        with contextlib.ExitStack() as stack:
            port = free_port()
            server = stack.enter_context(serve(name, hf_dir, port, log_dir))
            server.wait_healthy(args.start_timeout)
            model = "SmolLM2-135M-Instruct"
            for conc in levels:
                n = max(args.min_requests, conc * args.requests_per_client)
                r = asyncio.run(run_level(server.base_url, model, inputs(tokenizer, n), conc))
                results.setdefault(name, {})[conc] = r
                print(f"[{name}] {conc:>3} clients: {r['inputs_per_s']:7.1f} inputs/s, "
                      f"p50 {r['p50_ms']:7.1f} ms", flush=True)
    lines = ["<!-- embeddings:begin -->", "## Embeddings throughput (issue 33)", "",
             "`python scripts/bench_embeddings.py`: the demo model, inputs of about 128 tokens, "
             "one input per request, C concurrent clients; `xlaserve serve --task embed` (its "
             "defaults: LAST pooling, normalized) against scripts/hf_baseline_server.py "
             "(transformers float32, batches of up to 64). "
             f"Machine: {machine()}; commit {commit()}.", "",
             "| clients | xlaserve inputs/s | p50 ms | transformers inputs/s | p50 ms | ratio |",
             "|---|---|---|---|---|---|"]
    for conc in levels:
        ours, base = results["xlaserve"][conc], results["transformers"][conc]
        lines.append(f"| {conc} | {ours['inputs_per_s']:.1f} | {ours['p50_ms']:.0f} | "
                     f"{base['inputs_per_s']:.1f} | {base['p50_ms']:.0f} | "
                     f"{ours['inputs_per_s'] / base['inputs_per_s']:.2f}x"
                     + (" [goal >= 5x]" if conc == 64 else "") + " |")
    lines.append("<!-- embeddings:end -->")
    section = "\n".join(lines)
    print(section)
    if args.update_doc:
        update_doc(Path(args.update_doc), section, "embeddings")
    return 0


if __name__ == "__main__":
    sys.exit(main())
