"""A real `python -m serving serve` on a random-weight model, as a user starts it: waits for
/health, sends one streamed /v1/completions request (token-id prompt: a dummy model has no
tokenizer), checks the SSE stream, stops the server with SIGTERM. One result line to --out.

    PYTHONPATH=. python scripts/serve_check.py --shape 8b --folder /tmp/llama-8b   # GPU
    PYTHONPATH=. python scripts/serve_check.py --shape tiny --folder /tmp/tiny     # CPU
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_decode import LLAMA_8B, TINY  # noqa: E402

# One step program to compile (and, on a GPU, the memory plan's compile of the same shape):
# an 8B program takes tens of seconds.
SERVE_FLAGS = ["--load-format", "dummy", "--max-model-len", "1024", "--max-num-seqs", "8",
               "--max-num-batched-tokens", "64", "--token-buckets", "64",
               "--request-buckets", "8", "--page-buckets", "64", "--compilation-cache-dir", ""]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, proc: subprocess.Popen, deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before /health")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError("no 200 from /health in time")


def streamed_completion(port: int, model: str, max_tokens: int) -> tuple[int, float, list]:
    """-> (completion tokens the usage chunk reports, seconds to the first chunk, finish
    reasons). A model without a tokenizer streams no text, so the tokens are counted by
    the final usage chunk."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"model": model, "prompt": list(range(10, 42)), "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
            "ignore_eos": True}
    started = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    tokens, first, reasons, done = 0, None, [], False
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            break
        chunk = json.loads(data)
        first = first or time.perf_counter() - started
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        for choice in chunk.get("choices", []):
            if choice.get("finish_reason"):
                reasons.append(choice["finish_reason"])
    if not done:
        raise RuntimeError("the stream ended without [DONE]")
    return tokens, first or float("nan"), reasons


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=["8b", "tiny"], default="8b")
    ap.add_argument("--folder", type=Path, required=True)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=58, help="seconds to a healthy server")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    (args.folder / "config.json").write_text(json.dumps(LLAMA_8B if args.shape == "8b" else TINY))
    port = free_port()
    cmd = [sys.executable, "-m", "serving", "serve", str(args.folder), "--port", str(port),
           *SERVE_FLAGS]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        wait_healthy(port, proc, started + args.timeout)
        ready = time.monotonic() - started
        tokens, ttft, reasons = streamed_completion(port, str(args.folder), args.max_tokens)
        ok = tokens == args.max_tokens and reasons == ["length"]
        line = (f"serve {args.shape}: ready in {ready:.1f} s, streamed {tokens} tokens "
                f"(first after {ttft * 1e3:.0f} ms), finish {reasons}: "
                f"{'ok' if ok else 'UNEXPECTED'}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
    print(line, flush=True)
    if args.out:
        with args.out.open("a") as f:
            f.write(line + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
