"""Soak test: mixed traffic for a set time, then proof that nothing was lost or leaked.

    python scripts/soak.py --duration 600                      # starts the demo model server
    python scripts/soak.py --duration 30 -- --max-model-len 256  # args after -- go to serve
    python scripts/soak.py --url http://127.0.0.1:8000 --pid 1234 --duration 600

Clients send completions and chat requests, streaming or not, with random sampling
parameters; a share of them disconnect part-way (streams after a few events, others after a
short wait). Each request must end one of three ways: finished (every choice has a
finish_reason), aborted by its own client, or with an error the client can see (an error
status in OpenAI's envelope, or an error event in its stream). Anything else is lost: a
timeout, a connection the server dropped, a stream without [DONE].

Afterwards: the KV cache must be empty and no request running or waiting (/metrics); the
finished choices the server counted must equal those the clients received; resident memory
of the server (after a warm-up phase, against the end) is reported. Exit 1 if anything was
lost or leaked or any answer was a 5xx.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["The capital of France is", "Once upon a time", "Write a haiku about the sea.",
           "List three prime numbers.", "Why is the sky blue?", "def fibonacci(n):",
           "Translate 'good morning' into German.", "The best way to learn is"]
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")


def parse_args(argv=None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=120, help="seconds of traffic")
    p.add_argument("--warmup", type=float, default=None,
                   help="seconds of traffic before the starting RSS is taken "
                        "(default: a tenth of --duration, at most 30)")
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--pid", type=int, default=None, help="with --url: its process, for RSS")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--disconnect-share", type=float, default=0.2)
    p.add_argument("--stream-share", type=float, default=0.5)
    p.add_argument("--request-timeout", type=float, default=300,
                   help="an answer slower than this counts as lost (a hang)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.server_args = server_args
    if args.warmup is None:
        args.warmup = min(30.0, args.duration / 10)
    return args


# -- requests -------------------------------------------------------------------------------

def random_body(rng: random.Random, model: str, max_tokens: int) -> tuple[str, dict]:
    """A completions or chat request with random sampling parameters."""
    body = {"model": model, "max_tokens": rng.randint(1, max_tokens),
            "temperature": rng.choice([0.0, round(rng.uniform(0.2, 1.5), 2)]),
            "ignore_eos": rng.random() < 0.5, "n": rng.choice([1, 1, 1, 2])}
    options = {"top_p": lambda: round(rng.uniform(0.5, 1.0), 2),
               "top_k": lambda: rng.randint(1, 50),
               "min_p": lambda: round(rng.uniform(0.0, 0.2), 2),
               "presence_penalty": lambda: round(rng.uniform(-1, 1), 2),
               "frequency_penalty": lambda: round(rng.uniform(-1, 1), 2),
               "repetition_penalty": lambda: round(rng.uniform(0.8, 1.3), 2),
               "seed": lambda: rng.randint(0, 2 ** 32), "stop": lambda: [" the", "\n\n"],
               "logit_bias": lambda: {str(rng.randint(0, 1000)): rng.choice([-5, 5])}}
    for name, value in options.items():
        if rng.random() < 0.25:
            body[name] = value()
    prompt = rng.choice(PROMPTS)
    if rng.random() < 0.5:
        if rng.random() < 0.2:
            body["logprobs"] = rng.randint(0, 5)
        return "/v1/completions", {**body, "prompt": prompt}
    if rng.random() < 0.2:
        body.update(logprobs=True, top_logprobs=rng.randint(0, 5))
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}


async def read_stream(resp: aiohttp.ClientResponse, n: int, abort_after: int | None) -> str:
    """'finished', 'aborted', 'error' (an error event) or 'lost: why'."""
    finished, events = set(), 0
    async for line in resp.content:
        if not line.strip():
            continue
        if not line.startswith(b"data: "):
            return f"lost: not an SSE line {line[:60]!r}"
        data = line[6:].strip()
        if data == b"[DONE]":
            return "finished" if len(finished) == n else "lost: [DONE] before every choice ended"
        event = json.loads(data)
        if "error" in event:
            return "error"
        for choice in event.get("choices", []):
            if choice.get("finish_reason") is not None:
                finished.add(choice["index"])
        events += 1
        if abort_after is not None and events >= abort_after:
            resp.close()  # the client goes away mid-stream
            return "aborted"
    return "lost: the stream ended without [DONE]"


async def answer(session, url: str, body: dict, stream: bool,
                 abort_after: int | None) -> tuple[str, int]:
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            error = json.loads(await resp.read())
            ok = set(error) == {"error"} and {"message", "type", "param",
                                              "code"} <= set(error["error"])
            return ("error" if ok else "lost: an error outside the envelope"), resp.status
        if stream:
            return await read_stream(resp, body["n"], abort_after), 200
        choices = (await resp.json())["choices"]
        ended = all(c["finish_reason"] is not None for c in choices)
        return ("finished" if ended and len(choices) == body["n"]
                else "lost: a choice without finish_reason"), 200


async def one_request(session, url: str, path: str, body: dict, stream: bool,
                      disconnect: bool, rng: random.Random, timeout: float) -> tuple[str, int]:
    """(outcome, HTTP status or 0). A client that disconnects leaves a stream after one to
    three events, any other request after 0.2 to 1 s."""
    body = {**body, "stream": stream}
    if disconnect:  # long enough that the server cannot finish before the client leaves
        body.update(max_tokens=64, ignore_eos=True)
        body.pop("stop", None)
    abort_after = rng.randint(1, 3) if disconnect and stream else None
    patience = rng.uniform(0.2, 1.0) if disconnect and not stream else None
    try:
        async with asyncio.timeout(timeout):
            try:
                async with asyncio.timeout(patience):
                    return await answer(session, url + path, body, stream, abort_after)
            except TimeoutError:  # only patience's own deadline lands here
                return "aborted", 0
    except TimeoutError:
        return "lost: no answer within --request-timeout", 0
    except (aiohttp.ClientError, json.JSONDecodeError) as e:
        return f"lost: {type(e).__name__}", 0


class Tally:
    def __init__(self):
        self.outcomes: Counter = Counter()  # (outcome, kind) -> requests
        self.statuses: Counter = Counter()
        self.finished_choices = 0
        self.lost: list[str] = []

    def add(self, outcome: str, status: int, kind: str, n: int) -> None:
        self.outcomes[(outcome.split(":")[0], kind)] += 1
        if status:
            self.statuses[status] += 1
        if outcome == "finished":
            self.finished_choices += n
        if outcome.startswith("lost"):
            self.lost.append(outcome)


async def client(session, url: str, model: str, args, rng: random.Random, deadline: float,
                 tally: Tally) -> None:
    while time.monotonic() < deadline:
        path, body = random_body(rng, model, args.max_tokens)
        stream = rng.random() < args.stream_share
        disconnect = rng.random() < args.disconnect_share
        outcome, status = await one_request(session, url, path, body, stream, disconnect, rng,
                                            args.request_timeout)
        kind = ("stream" if stream else "whole") + (" (client leaves)" if disconnect else "")
        tally.add(outcome, status, kind, body["n"])


async def traffic(url: str, model: str, args, seconds: float, seed: int, headers) -> Tally:
    tally = Tally()
    deadline = time.monotonic() + seconds
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
        await asyncio.gather(*(client(session, url, model, args, random.Random(seed * 1000 + i),
                                      deadline, tally) for i in range(args.concurrency)))
    return tally


# -- the server ---------------------------------------------------------------------------------

def scrape(url: str, headers) -> dict[str, float]:
    """Our series by name (finished_reason folded in), without the model_name label."""
    import urllib.request
    req = urllib.request.Request(url + "/metrics", headers=headers)
    with urllib.request.urlopen(req, timeout=30) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            reason = s.labels.get("finished_reason")
            out[s.name + (f"[{reason}]" if reason else "")] = s.value
    return out


def wait_idle(url: str, headers, timeout: float = 120) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url, headers)
        if all(m.get(f"xlaserve:{g}", 0) == 0 for g in GAUGES) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


def start_server(server_args: list[str], api_key: str | None) -> tuple[subprocess.Popen, str]:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "serving", *server_args, "--port", str(port)]
    if api_key:
        cmd += ["--api-key", api_key]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sys.stderr, stderr=sys.stderr)
    url = f"http://127.0.0.1:{port}"
    import urllib.request
    for _ in range(6000):  # warm-up compiles every program on a cold cache
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.2)
    raise SystemExit("the server did not become healthy")


def model_of(url: str, headers) -> str:
    import urllib.request
    req = urllib.request.Request(url + "/v1/models", headers=headers)
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())["data"][0]["id"]


# -- report ------------------------------------------------------------------------------------

def delta(after: dict, before: dict, name: str) -> int:
    return round(after.get(name, 0) - before.get(name, 0))


def report(args, tally: Tally, before: dict, after: dict, rss: list[float | None],
           elapsed: float) -> bool:
    sent = sum(tally.outcomes.values())
    by = Counter()
    for (outcome, _), n in tally.outcomes.items():
        by[outcome] += n
    server_finished = sum(delta(after, before, f"xlaserve:request_success_total[{r}]")
                          for r in ("stop", "length"))
    leaked = any(after.get(f"xlaserve:{g}", 0) for g in GAUGES)
    five_xx = sum(n for status, n in tally.statuses.items() if status >= 500)
    rows = [("duration (s)", f"{elapsed:.0f} (+{args.warmup:.0f} warm-up)"),
            ("clients", args.concurrency),
            ("requests", sent),
            ("requests per second", f"{sent / elapsed:.1f}")]
    rows += [(f"  {outcome}: {kind}", n) for (outcome, kind), n in sorted(tally.outcomes.items())]
    rows += [("finished", by["finished"]), ("aborted by their client", by["aborted"]),
             ("visible errors", f"{by['error']} (statuses {dict(tally.statuses)})"),
             ("lost", by["lost"]),
             ("choices finished: clients / server", f"{tally.finished_choices} / "
                                                     f"{server_finished}"),
             ("aborts counted by the server",
              delta(after, before, "xlaserve:request_success_total[abort]")),
             ("tokens generated", delta(after, before, "xlaserve:generation_tokens_total")),
             ("after: running / waiting / KV cache usage",
              " / ".join(f"{after.get(f'xlaserve:{g}', 0):g}" for g in GAUGES)),
             ("pages leaked", "yes" if leaked else 0)]
    if rss[0] is not None and rss[1] is not None:
        growth = rss[1] - rss[0]
        rows.append(("server RSS after warm-up / at end (MiB)",
                     f"{rss[0]:.0f} / {rss[1]:.0f} ({growth:+.0f} MiB, "
                     f"{100 * growth / rss[0]:+.1f}%)"))
    print("\n| soak | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    for why, n in Counter(tally.lost).most_common(5):
        print(f"lost {n}x: {why}")
    ok = not by["lost"] and not leaked and not five_xx and \
        tally.finished_choices == server_finished
    print("soak: PASS" if ok else "soak: FAIL")
    return ok


def main(argv=None) -> int:
    args = parse_args(argv)
    proc = None
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url, pid = args.url, args.pid
    if url is None:
        proc, url = start_server(args.server_args, args.api_key)
        pid = proc.pid
    try:
        model = model_of(url, headers)
        asyncio.run(traffic(url, model, args, args.warmup, args.seed + 1, headers))
        before = wait_idle(url, headers)
        rss_start = rss_mib(pid)
        started = time.monotonic()
        tally = asyncio.run(traffic(url, model, args, args.duration, args.seed, headers))
        elapsed = time.monotonic() - started
        after = wait_idle(url, headers)
        ok = report(args, tally, before, after, [rss_start, rss_mib(pid)], elapsed)
    finally:
        if proc is not None:
            proc.terminate()
            code = proc.wait(timeout=120)
            print(f"soak: the server exited with {code}")
            if code != 0:
                ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
