"""Load test for any OpenAI-compatible server (ours, llama.cpp's llama-server, vLLM), measured
the way `vllm bench serve` measures.

    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --model M \\
        --tokenizer DIR --dataset random --input-len 128 --output-len 128 \\
        --num-prompts 64 --max-concurrency 16 [--save-result out.json]
    python scripts/bench_serving.py ... --sweep 1,4,16 --plot sweep.png
    python scripts/bench_serving.py ... --dataset multi-turn --num-prompts 16 \
        --num-turns 4 --system-len 1000 --max-concurrency 16   (16 conversations)
    python scripts/bench_serving.py ... --dataset few-shot --num-examples 8

The multi-turn and few-shot datasets (scripts/bench_conversations.py) share prompt prefixes
the way chat traffic does, for servers with a prefix cache.

Every request streams with stream_options.include_usage. Definitions (vLLM's):
  TTFT  send -> first SSE chunk with a non-empty `choices` (even if its text is empty)
  ITL   gaps between consecutive such chunks (a chunk carrying several tokens is one sample)
  E2EL  send -> last such chunk (a trailing usage-only chunk does not count)
  TPOT  (E2EL - TTFT) / (output_tokens - 1), per request, only when output_tokens > 1
Output tokens come from usage.completion_tokens when the server sends it, else from the number
of chunks with non-empty text. Input tokens come from usage.prompt_tokens when sent, else from
the dataset's count. Duration runs from the first dispatch to the last completion.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # loaded by path in tests
from bench_datasets import (WORDS, SampleRequest, arrival_gaps, arrival_times,  # noqa: E402,F401
                            chat_lengths, fit_token_length, load_tokenizer, make_prompt,
                            plain_token_ids, random_dataset, synthetic_chat_dataset,
                            words_text)

# -- metric math ---------------------------------------------------------------------------------

@dataclass
class RequestOutput:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # s
    latency: float = 0.0  # E2EL, s
    itl: list[float] = field(default_factory=list)  # s
    start: float = 0.0  # perf_counter at send
    error: str = ""
    text: str = ""  # the generated text (a multi-turn conversation sends it back)


def chunk_timing(start: float, chunk_times: list[float]) -> tuple[float, list[float], float]:
    """(ttft, itl, e2el) from the send time and the arrival times of content chunks."""
    ttft = chunk_times[0] - start
    itl = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    return ttft, itl, chunk_times[-1] - start


def tpot(latency: float, ttft: float, output_tokens: int) -> float | None:
    """Time per output token after the first; None when there is at most one token."""
    if output_tokens <= 1:
        return None
    return (latency - ttft) / (output_tokens - 1)


def _stats(prefix: str, values_s: list[float], percentiles) -> dict:
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    if ms.size == 0:
        ms = np.zeros(1)
    out = {f"mean_{prefix}_ms": float(ms.mean()), f"median_{prefix}_ms": float(np.median(ms)),
           f"std_{prefix}_ms": float(ms.std())}
    for p in percentiles:
        out[f"p{p:g}_{prefix}_ms"] = float(np.percentile(ms, p))
    return out


def summarize(outputs: list[RequestOutput], duration: float, percentiles=(99,)) -> dict:
    """The report's numbers. TTFT/TPOT are per successful request, ITL per chunk gap."""
    ok = [o for o in outputs if o.success]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    tpots = [t for o in ok if (t := tpot(o.latency, o.ttft, o.output_tokens)) is not None]
    result = {
        "duration": duration, "completed": len(ok), "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
    }
    result |= _stats("ttft", [o.ttft for o in ok], percentiles)
    result |= _stats("tpot", tpots, percentiles)
    result |= _stats("itl", [x for o in ok for x in o.itl], percentiles)
    result |= _stats("e2el", [o.latency for o in ok], percentiles)
    return result


def format_report(r: dict, percentiles=(99,)) -> str:
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label, value, fmt="{:<10.2f}"):
        lines.append(f"{label:<40}" + (fmt.format(value) if isinstance(value, float) else str(value)))

    row("Successful requests:", r["completed"])
    row("Failed requests:", r["failed"])
    if r.get("max_concurrency"):
        row("Maximum request concurrency:", r["max_concurrency"])
    if r.get("request_rate") not in (None, "inf", float("inf")):
        row("Request rate configured (RPS):", float(r["request_rate"]))
    row("Benchmark duration (s):", r["duration"])
    row("Total input tokens:", r["total_input_tokens"])
    row("Total generated tokens:", r["total_output_tokens"])
    row("Request throughput (req/s):", r["request_throughput"])
    row("Output token throughput (tok/s):", r["output_throughput"])
    row("Total token throughput (tok/s):", r["total_token_throughput"])
    for key, title, name in (("ttft", "Time to First Token", "TTFT"),
                             ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
                             ("itl", "Inter-token Latency", "ITL")):
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        row(f"Mean {name} (ms):", r[f"mean_{key}_ms"])
        row(f"Median {name} (ms):", r[f"median_{key}_ms"])
        for p in percentiles:
            row(f"P{p:g} {name} (ms):", r[f"p{p:g}_{key}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)


# -- the client ----------------------------------------------------------------------------------

def request_body(endpoint: str, model: str, req: SampleRequest, *, ignore_eos: bool,
                 temperature: float) -> dict:
    body = {"model": model, "max_tokens": req.output_len, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


def chunk_text(data: dict) -> str:
    choice = data["choices"][0]
    if "delta" in choice:
        return (choice["delta"] or {}).get("content") or ""
    return choice.get("text") or ""


async def send_request(session, url: str, body: dict, prompt_len: int) -> RequestOutput:
    out = RequestOutput(prompt_len=prompt_len)
    chunk_times, text_chunks, usage = [], 0, None
    out.start = time.perf_counter()
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return out
            async for raw in resp.content:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue  # blank separators, ": ping" comments, event: lines
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                now = time.perf_counter()
                data = json.loads(payload)
                if data.get("usage"):
                    usage = data["usage"]
                if data.get("choices"):
                    chunk_times.append(now)
                    piece = chunk_text(data)
                    text_chunks += bool(piece)
                    out.text += piece
    except Exception as e:  # noqa: BLE001 - any failure is one failed request, not a crash
        out.error = f"{type(e).__name__}: {e}"
        return out
    if not chunk_times:
        out.error = "no content chunk in the stream"
        return out
    out.ttft, out.itl, out.latency = chunk_timing(out.start, chunk_times)
    if usage and usage.get("completion_tokens") is not None:
        out.output_tokens = int(usage["completion_tokens"])
    else:
        out.output_tokens = text_chunks
    if usage and usage.get("prompt_tokens"):
        out.prompt_len = int(usage["prompt_tokens"])
    out.success = True
    return out


async def run_benchmark(base_url: str, endpoint: str, model: str, requests: list[SampleRequest],
                        *, request_rate: float = float("inf"), burstiness: float = 1.0,
                        max_concurrency: int | None = None, seed: int = 0, ignore_eos: bool = True,
                        temperature: float = 0.0, num_warmups: int = 1, percentiles=(99,),
                        quiet: bool = False) -> dict:
    import aiohttp

    url = base_url.rstrip("/") + endpoint
    names = model.split(",")  # several (LoRA adapters, say): requests take them in turn
    bodies = [request_body(endpoint, names[i % len(names)], r, ignore_eos=ignore_eos,
                           temperature=temperature) for i, r in enumerate(requests)]
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    # A new connection per request: llama-server closes idle keep-alive connections after 5 s,
    # and a pooled one it closed fails the next request (ServerDisconnectedError).
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        for i in range(num_warmups):  # also the "initial test request": fail fast if it fails
            w = await send_request(session, url, bodies[i % len(bodies)], 0)
            if not w.success:
                raise RuntimeError(f"warm-up request to {url} failed: {w.error}")
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def one(i: int) -> RequestOutput:
            if sem is None:
                return await send_request(session, url, bodies[i], requests[i].prompt_len)
            async with sem:
                return await send_request(session, url, bodies[i], requests[i].prompt_len)

        times = arrival_times(len(requests), request_rate, burstiness, seed)
        start = time.perf_counter()
        tasks = []
        for i, t in enumerate(times):
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    result = summarize(outputs, duration, percentiles)
    result |= {"base_url": base_url, "endpoint": endpoint, "model": model,
               "num_prompts": len(requests), "max_concurrency": max_concurrency,
               "request_rate": "inf" if math.isinf(request_rate) else request_rate,
               "burstiness": burstiness, "seed": seed,
               "errors": [o.error for o in outputs if not o.success][:10],
               "input_lens": [o.prompt_len for o in outputs],
               "output_lens": [o.output_tokens for o in outputs],
               "ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs]}
    if not quiet:
        for err in result["errors"]:
            print(f"error: {err}", file=sys.stderr)
        print(format_report(result, percentiles), flush=True)
    return result


# -- sweeps and plots ----------------------------------------------------------------------------

def plot_sweep(series: dict[str, list[dict]], path: str, label_key: str = "max_concurrency",
               title: str = "") -> None:
    """Output tok/s against median TPOT (left) and median TTFT (right), one line per server;
    each point is labelled with its concurrency (or rate)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.ticker
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, name in ((axes[0], "median_tpot_ms", "median TPOT (ms)"),
                          (axes[1], "median_ttft_ms", "median TTFT (ms)")):
        for label, points in series.items():
            xs = [p[key] for p in points]
            ys = [p["output_throughput"] for p in points]
            ax.plot(xs, ys, marker="o", label=label)
            for p, x, y in zip(points, xs, ys):
                ax.annotate(str(p.get(label_key)), (x, y), textcoords="offset points",
                            xytext=(4, 4), fontsize=8)
        ax.set_xlabel(name)
        ax.set_ylabel("output tokens/s")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.grid(True, alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sweep_table(points: list[dict], label: str) -> str:
    head = f"{label:>12} {'out tok/s':>10} {'req/s':>7} {'med TTFT ms':>12} {'med TPOT ms':>12} {'p99 ITL ms':>11}"
    rows = [head]
    for p in points:
        rows.append(f"{str(p['sweep_value']):>12} {p['output_throughput']:>10.1f} "
                    f"{p['request_throughput']:>7.2f} {p['median_ttft_ms']:>12.1f} "
                    f"{p['median_tpot_ms']:>12.1f} {p['p99_itl_ms']:>11.1f}")
    return "\n".join(rows)


# -- command line --------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None,
                   help="model name to send (default: first of /v1/models); comma-separated "
                        "names (LoRA adapters) are spread over the requests in turn")
    p.add_argument("--endpoint", default="/v1/completions",
                   choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--dataset", default="random",
                   choices=["random", "synthetic-chat", "multi-turn", "few-shot"])
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (random words without)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=2048, help="synthetic-chat length cap")
    p.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per conversation")
    p.add_argument("--system-len", type=int, default=1000,
                   help="multi-turn: tokens of the shared system prompt")
    p.add_argument("--user-len", type=int, default=30,
                   help="multi-turn: tokens per user message; few-shot: per question")
    p.add_argument("--num-examples", type=int, default=8, help="few-shot: examples per prompt")
    p.add_argument("--num-tasks", type=int, default=4, help="few-shot: distinct preambles")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    p.add_argument("--num-warmups", type=int, default=1)
    p.add_argument("--percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    p.add_argument("--save-result", default=None, help="write the result(s) as JSON here")
    p.add_argument("--sweep", default=None, help="comma-separated concurrencies (or rates)")
    p.add_argument("--sweep-over", default="concurrency", choices=["concurrency", "rate"])
    p.add_argument("--plot", default="bench_sweep.png", help="the sweep's PNG")
    return p


def build_dataset(args, tokenizer) -> list:
    """SampleRequests; for multi-turn, --num-prompts conversations."""
    import bench_conversations as bc
    if args.dataset == "multi-turn":
        return bc.multi_turn_dataset(args.num_prompts, args.num_turns, args.system_len,
                                     args.user_len, args.output_len, args.seed, tokenizer)
    if args.dataset == "few-shot":
        return bc.few_shot_dataset(args.num_prompts, args.num_tasks, args.num_examples,
                                   args.input_len // 4, args.user_len, args.output_len,
                                   args.seed, tokenizer)
    if args.dataset == "random":
        return random_dataset(args.num_prompts, args.input_len, args.output_len, args.seed, tokenizer)
    return synthetic_chat_dataset(args.num_prompts, args.input_len, args.output_len, args.seed,
                                  tokenizer, args.max_model_len)


async def first_model(base_url: str) -> str:
    import aiohttp
    async with aiohttp.ClientSession() as s, s.get(base_url.rstrip("/") + "/v1/models") as r:
        return (await r.json())["data"][0]["id"]


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    percentiles = tuple(float(x) for x in args.percentiles.split(","))
    requests = build_dataset(args, load_tokenizer(args.tokenizer))
    model = args.model or asyncio.run(first_model(args.base_url))
    common = dict(burstiness=args.burstiness, seed=args.seed, ignore_eos=args.ignore_eos,
                  temperature=args.temperature, num_warmups=args.num_warmups,
                  percentiles=percentiles)
    if args.dataset == "multi-turn":
        import bench_conversations as bc
        results = asyncio.run(bc.run_conversations(
            args.base_url, model, requests, max_concurrency=args.max_concurrency or 16,
            ignore_eos=args.ignore_eos, temperature=args.temperature))
    elif not args.sweep:
        result = asyncio.run(run_benchmark(
            args.base_url, args.endpoint, model, requests, request_rate=args.request_rate,
            max_concurrency=args.max_concurrency, **common))
        results = result
    else:
        results = []
        for value in (float(v) for v in args.sweep.split(",")):
            knobs = ({"max_concurrency": int(value), "request_rate": args.request_rate}
                     if args.sweep_over == "concurrency"
                     else {"max_concurrency": args.max_concurrency, "request_rate": value})
            print(f"\n--- {args.sweep_over} {value:g} ---", flush=True)
            r = asyncio.run(run_benchmark(args.base_url, args.endpoint, model, requests,
                                          **knobs, **common))
            r["sweep_value"] = int(value) if args.sweep_over == "concurrency" else value
            results.append(r)
        print("\n" + sweep_table(results, args.sweep_over))
        plot_sweep({model: results}, args.plot, label_key="sweep_value",
                   title=f"{args.dataset}, {args.num_prompts} prompts per point")
        print(f"plot: {args.plot}")
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(results, f, indent=1)
        print(f"result: {args.save_result}")
    failed = results["failed"] if isinstance(results, dict) else sum(r["failed"] for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
