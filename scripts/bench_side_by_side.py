"""Side by side on this machine: our server, llama.cpp's llama-server and a Hugging Face
transformers baseline, the same demo model and the same requests, the servers taking turns
level by level, --rounds times.

    python scripts/bench_side_by_side.py [--levels 1:4,16:16,64:64] [--only ours,llama.cpp,hf]

Each level is CONCURRENCY:NUM_PROMPTS; each level of each round sends NUM_PROMPTS prompts of
its own, the same to every server, from one seeded random dataset (fixed --input-len /
--output-len, ignore_eos, greedy) to /v1/completions with scripts/bench_serving.py. Writes
the table between the markers in docs/benchmarks.md (the rest of the file is kept),
docs/benchmarks.png and docs/benchmarks.json. It is a benchmark, not a test.

llama-server is built once (CPU, Release) from the llama.cpp sources inside the llama-cpp-python
sdist on PyPI, into ~/.cache/xlaserve/llama.cpp (outside the repository). The HF baseline is
scripts/hf_baseline_server.py.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_serving as bs  # noqa: E402

LLAMA_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "xlaserve" / "llama.cpp"
BEGIN, END = "<!-- side-by-side:begin -->", "<!-- side-by-side:end -->"
SERVERS = ("ours", "llama.cpp", "hf")


# -- llama.cpp -----------------------------------------------------------------------------------

def ensure_llama_server(cache: Path = LLAMA_CACHE, jobs: int = 2) -> Path:
    """The llama-server binary, built from the llama-cpp-python sdist's vendored llama.cpp."""
    binary = cache / "build" / "bin" / "llama-server"
    if binary.is_file():
        return binary
    src = cache / "src"
    src.mkdir(parents=True, exist_ok=True)
    if not list(src.glob("llama_cpp_python-*.tar.gz")):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "llama-cpp-python", "-d", str(src)], check=True)
    sdist = sorted(src.glob("llama_cpp_python-*.tar.gz"))[-1]
    tree = src / sdist.name.removesuffix(".tar.gz")
    if not tree.is_dir():
        with tarfile.open(sdist) as tar:
            tar.extractall(src, filter="data")
    llama = tree / "vendor" / "llama.cpp"
    started = time.perf_counter()
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    # No curl/openssl (no downloads at run time), no web UI (its prebuilt assets are fetched
    # from the network), static, only the server target.
    subprocess.run(["cmake", "-S", str(llama), "-B", str(cache / "build"), *gen,
                    "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DBUILD_SHARED_LIBS=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"], check=True)
    subprocess.run(["cmake", "--build", str(cache / "build"), "--target", "llama-server",
                    f"-j{jobs}"], check=True)
    print(f"llama-server: built in {time.perf_counter() - started:.0f} s -> {binary}")
    return binary


# -- server processes ----------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server subprocess on a loopback port: started, waited on (/health 200), stopped."""

    def __init__(self, name: str, cmd: list[str], port: int, log_dir: Path, env=None):
        self.name, self.cmd, self.port = name, cmd, port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{name}.log"
        self.env = env
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Server":
        print(f"[{self.name}] {shlex.join(self.cmd)}  (log: {self.log_path})", flush=True)
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=self.env, cwd=ROOT)
        return self

    def wait_healthy(self, timeout: float) -> float:
        started = time.perf_counter()
        while time.perf_counter() - started < timeout:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text()[-3000:]
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.perf_counter() - started
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.name} not healthy after {timeout:.0f} s")

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def server_command(name: str, args, port: int | str, hf_dir: Path) -> list[str]:
    max_len = args.input_len + args.output_len + 16
    if name == "ours":
        return [sys.executable, "-m", "serving", "serve", "--port", str(port),
                "--max-num-seqs", str(args.slots), *shlex.split(args.ours_args)]
    if name == "llama.cpp":
        from model.demo import demo_gguf_path
        return [str(ensure_llama_server()), "-m", str(demo_gguf_path()), "--host", "127.0.0.1",
                "--port", str(port), "--parallel", str(args.slots), "-c", str(args.slots * max_len),
                "-t", str(args.threads), "-tb", str(args.threads), *shlex.split(args.llama_args)]
    return [sys.executable, str(ROOT / "scripts" / "hf_baseline_server.py"), "--model", str(hf_dir),
            "--port", str(port), "--max-batch", str(args.slots), "--threads", str(args.threads)]


# -- the run -------------------------------------------------------------------------------------

def parse_levels(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        conc, _, n = item.partition(":")
        out.append((int(conc), int(n or max(8, 2 * int(conc)))))
    return out


def start_server(stack: contextlib.ExitStack, name: str, args, hf_dir: Path,
                 log_dir: Path) -> tuple[Server, str, float]:
    """Starts one server and waits for it: (server, its model name, seconds to healthy)."""
    port = free_port()
    server = stack.enter_context(Server(name, server_command(name, args, port, hf_dir), port,
                                        log_dir))
    ready = server.wait_healthy(args.start_timeout)
    print(f"[{name}] healthy after {ready:.0f} s", flush=True)
    return server, asyncio.run(bs.first_model(server.base_url)), ready


def run_level(live: tuple[Server, str, float], conc: int, warmup, requests, args,
              rnd: int) -> dict:
    """One level on one server. The warm-up request has a prompt of its own: llama-server
    keeps each slot's last prompt and skips the prefill of a prompt it has seen."""
    server, model, ready = live
    print(f"\n[{server.name}] round {rnd + 1}: concurrency {conc}, {len(requests)} prompts",
          flush=True)
    asyncio.run(bs.run_benchmark(server.base_url, "/v1/completions", model, [warmup],
                                 max_concurrency=1, num_warmups=0, quiet=True))
    r = asyncio.run(bs.run_benchmark(server.base_url, "/v1/completions", model, requests,
                                     max_concurrency=conc, seed=args.seed, num_warmups=0))
    for key in ("input_lens", "output_lens", "ttfts", "itls"):
        r.pop(key)
    return r | {"server": server.name, "sweep_value": conc, "startup_s": ready, "round": rnd}


METRICS = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "p99_itl_ms")


def summarize(runs: list[dict]) -> list[dict]:
    """One row per server and level: each metric's median over the rounds, failures summed."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["server"], r["sweep_value"]), []).append(r)
    rows = []
    for rs in groups.values():
        row = {k: v for k, v in rs[0].items() if k != "round"}
        row |= {m: statistics.median(r[m] for r in rs) for m in METRICS}
        row |= {"failed": sum(r["failed"] for r in rs), "rounds": len(rs)}
        rows.append(row)
    return rows


def paired_ratios(runs: list[dict], conc: int, key: str) -> list[float]:
    """ours / llama.cpp of one metric at one level, one ratio per round: both servers ran that
    level back to back, so a drift in the machine's speed between rounds cancels out."""
    by = {(r["server"], r["sweep_value"], r["round"]): r for r in runs}
    return [a[key] / b[key] for (s, c, rnd), a in sorted(by.items())
            if s == "ours" and c == conc and (b := by.get(("llama.cpp", c, rnd)))]


def _ms(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _ratio(values: list[float]) -> str:
    """The median of the rounds' ratios, and their range when there are several."""
    text = f"{statistics.median(values):.2f}"
    return text + (f" ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else "")


def render_section(runs: list[dict], meta: dict) -> str:
    results = summarize(runs)
    by = {(r["server"], r["sweep_value"]): r for r in results}
    levels = sorted({r["sweep_value"] for r in results})
    servers = [s for s in SERVERS if any(r["server"] == s for r in results)]
    rounds = max(r["rounds"] for r in results)
    how = (f"{rounds} rounds, each level run on every server back to back; each figure is the "
           "median over the rounds" if rounds > 1 else "one round")
    lines = [BEGIN, "", f"Run {meta['date']} on {meta['machine']}; "
             f"commit {meta['commit']}; {meta['workload']}; {how}; load average "
             f"{meta.get('load_end', 0):.1f} at the end.", "",
             "| streams | prompts | server | output tok/s | median TTFT (ms) | median TPOT (ms) "
             "| p99 ITL (ms) | failed |",
             "|---:|---:|---|---:|---:|---:|---:|---:|"]
    for conc in levels:
        for s in servers:
            if (r := by.get((s, conc))):
                lines.append(f"| {conc} | {r['num_prompts']} | {s} | {r['output_throughput']:.1f} "
                             f"| {_ms(r['median_ttft_ms'])} | {_ms(r['median_tpot_ms'])} "
                             f"| {_ms(r['p99_itl_ms'])} | {r['failed']} |")
    if "ours" in servers and "llama.cpp" in servers:
        lines += ["", "Ratios, ours / llama.cpp, the median of the rounds' ratios"
                  + (" (their range)" if rounds > 1 else "") + "; issue 7's goal in brackets:",
                  "", "| streams | output tok/s | median TTFT | median TPOT |",
                  "|---:|---:|---:|---:|"]
        goals = {1: ("", "", " [<= 1.5]"), 16: (" [>= 2]", " [< 1]", ""), 64: (" [>= 3]", "", "")}
        for conc in levels:
            cells = [paired_ratios(runs, conc, key) for key in
                     ("output_throughput", "median_ttft_ms", "median_tpot_ms")]
            if cells[0]:
                g = goals.get(conc, ("", "", ""))
                lines.append(f"| {conc} | " + " | ".join(
                    _ratio(c) + goal for c, goal in zip(cells, g)) + " |")
    lines += ["", "Server start-up to healthy (s): " + ", ".join(
        f"{s} {next(r['startup_s'] for r in results if r['server'] == s):.0f}" for s in servers),
        "", "Commands:", ""] + [f"- {s}: `{meta['commands'][s]}`" for s in servers]
    lines += ["", "![output tok/s against median TPOT and TTFT](benchmarks.png)", "", END]
    return "\n".join(lines)


def update_doc(path: Path, section: str) -> None:
    # A new file gets a title and the section; docs/benchmarks.md holds how we measure.
    text = path.read_text() if path.exists() else f"# Benchmarks\n\n{BEGIN}\n{END}\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + section + rest.split(END, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    path.write_text(text)


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    return f"{cpu}, {os.cpu_count()} cores visible (load average {os.getloadavg()[0]:.1f} at start)"


def commit() -> str:
    """HEAD, marked when the serving code has uncommitted changes (they ran, not HEAD)."""
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)
    head = git("rev-parse", "--short", "HEAD").stdout.strip() or "?"
    dirty = git("diff", "--quiet", "HEAD", "--", "serving", "model", "pallas_kernels", "quant")
    return head + (" + uncommitted changes" if dirty.returncode else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", default="1:4,16:16,64:64", help="CONCURRENCY:PROMPTS,...")
    p.add_argument("--only", default=",".join(SERVERS), help="servers to run, comma-separated")
    p.add_argument("--input-len", type=int, default=130)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slots", type=int, default=64, help="max sequences / slots / batch per server")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp and torch threads")
    p.add_argument("--ours-args", default="--quantize int8:lm_head --kv-cache-dtype float16",
                   help="extra flags for `xlaserve serve` (default: int8 weights and head, "
                        "the fastest form on a CPU, and a float16 KV cache as llama.cpp's)")
    p.add_argument("--llama-args", default="", help="extra flags for llama-server")
    p.add_argument("--rounds", type=int, default=3,
                   help="times each level runs on each server, servers taking turns level by level")
    p.add_argument("--start-timeout", type=float, default=1800.0)
    p.add_argument("--docs", default=str(ROOT / "docs"))
    args = p.parse_args(argv)

    from model.demo import cache_dir, fetch_demo_model
    hf_dir = fetch_demo_model(cache_dir() / "demo" / "SmolLM2-135M-Instruct-hf")
    levels = parse_levels(args.levels)
    # Every round and level gets prompts of its own (and one for its warm-up): a server with a
    # prefix cache (llama-server) would otherwise skip the prefill of prompts seen before.
    prompts = iter(bs.random_dataset(args.rounds * sum(n + 1 for _, n in levels),
                                     args.input_len, args.output_len, args.seed,
                                     bs.load_tokenizer(str(hf_dir))))
    plan = [(rnd, conc, [next(prompts) for _ in range(n + 1)])
            for rnd in range(args.rounds) for conc, n in levels]
    docs = Path(args.docs)
    docs.mkdir(parents=True, exist_ok=True)
    log_dir = LLAMA_CACHE.parent / "bench-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    names = [s for s in SERVERS if s in args.only.split(",")]
    if "llama.cpp" in names:
        ensure_llama_server()
    meta = {"date": datetime.date.today().isoformat(), "machine": machine(), "commit": commit(),
            "workload": f"random prompts of {args.input_len} tokens, {args.output_len} output "
                        f"tokens (ignore_eos, greedy), /v1/completions, seed {args.seed}",
            "commands": {s: shlex.join(server_command(s, args, "PORT", hf_dir)).replace(
                str(Path.home()), "~").replace(str(ROOT) + "/", "") for s in names}}
    runs = []
    with contextlib.ExitStack() as stack:  # all up at once, started one after another
        live = {name: start_server(stack, name, args, hf_dir, log_dir) for name in names}
        for rnd, conc, (warmup, *requests) in plan:
            for name in names:
                runs.append(run_level(live[name], conc, warmup, requests, args, rnd))
    meta["load_end"] = os.getloadavg()[0]
    json.dump({"meta": meta, "results": runs}, open(docs / "benchmarks.json", "w"), indent=1)
    results = summarize(runs)
    series = {s: sorted((r for r in results if r["server"] == s), key=lambda r: r["sweep_value"])
              for s in names}
    bs.plot_sweep(series, str(docs / "benchmarks.png"), label_key="sweep_value",
                  title=f"demo model, {meta['workload'].split(',')[0]}; labels: streams")
    section = render_section(runs, meta)
    update_doc(docs / "benchmarks.md", section)
    print("\n" + section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
