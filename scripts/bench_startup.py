"""Start-up time of `xlaserve serve` on the demo model: cold (no compiled programs, no built CPU
kernels) and warm (a restart over the cache the cold start left), each to /health 200.

    python scripts/bench_startup.py [--out DIR] [--throughput] [-- extra serve flags]

The cold start runs under an empty XDG_CACHE_HOME that holds only the converted demo weights
(linked from the real cache, so nothing is fetched or converted) and an empty CPU kernel
folder. The server's own log lines about programs compiled / loaded are printed with the
times. --throughput adds a short scripts/bench_serving.py run at 1 and 16 streams against the
warm server, to check that start-up changes cost no speed.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REAL_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "xlaserve"
DEMO = "SmolLM2-135M-Instruct"
# Lines of the server's log worth showing next to the numbers.
INTERESTING = re.compile(r"program|compiled|loaded|ready|warm|cache|phase|took", re.I)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def start(env: dict, port: int, extra: list[str], log_path: Path):
    cmd = [sys.executable, "-m", "serving", "serve", "--port", str(port), "--grace-period", "1",
           *extra]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, log


def time_to_healthy(env: dict, extra: list[str], log_path: Path, timeout: float):
    port = free_port()
    started = time.perf_counter()
    proc, log = start(env, port, extra, log_path)
    while not healthy(port):
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; see {log_path}")
        if time.perf_counter() - started > timeout:
            proc.kill()
            raise SystemExit(f"not healthy after {timeout:.0f} s; see {log_path}")
        time.sleep(0.2)
    return time.perf_counter() - started, proc, log, port


def stop(proc, log) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()


def show_log(log_path: Path) -> None:
    for line in log_path.read_text(errors="replace").splitlines():
        if INTERESTING.search(line) and "%|" not in line:
            print("   ", line.strip()[-200:])


def throughput(port: int) -> None:
    tokenizer = REAL_CACHE / "demo" / DEMO
    for streams in (1, 16):
        cmd = [sys.executable, "scripts/bench_serving.py", "--base-url",
               f"http://127.0.0.1:{port}", "--tokenizer", str(tokenizer), "--input-len", "128",
               "--output-len", "64", "--num-prompts", str(max(4, 2 * streams)),
               "--max-concurrency", str(streams)]
        print(f"## bench_serving, {streams} stream(s): {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, cwd=ROOT, check=False)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="keep the caches and logs here (default: temp)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--throughput", action="store_true")
    p.add_argument("--warm-only", action="store_true",
                   help="keep the caches already in --out and time restarts only")
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    out = Path(args.out or tempfile.mkdtemp(prefix="xlaserve-startup-"))
    cache = out / "cache"
    weights = REAL_CACHE / "demo" / DEMO
    if not weights.is_dir():
        raise SystemExit(f"convert the demo model first (no {weights})")
    if not args.warm_only:
        if cache.exists():
            shutil.rmtree(cache)
        (cache / "xlaserve" / "demo").mkdir(parents=True)
        (cache / "xlaserve" / "demo" / DEMO).symlink_to(weights)
    env = dict(os.environ, XDG_CACHE_HOME=str(cache),
               XLASERVE_CPU_KERNEL_DIR=str(cache / "xlaserve" / "cpu-kernels"),
               PYTHONPATH=str(ROOT), TQDM_DISABLE="1")
    results = {}
    for run in ("warm",) if args.warm_only else ("cold", "warm"):
        log_path = out / f"{run}.log"
        seconds, proc, log, port = time_to_healthy(env, extra, log_path, args.timeout)
        results[run] = seconds
        print(f"{run} start: /health 200 after {seconds:.1f} s ({log_path})", flush=True)
        show_log(log_path)
        if run == "warm" and args.throughput:
            throughput(port)
        stop(proc, log)
    print(", ".join(f"{k} {v:.1f} s" for k, v in results.items()), f"(caches in {cache})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
