"""Side by side on this machine: our server, llama.cpp's llama-server and a Hugging Face
transformers baseline, the same demo model and the same requests, --rounds times: in each
round every server in turn runs alone on the machine (started, every level, stopped), or
with --all-up all of them stay up and take turns level by level. Each runs its defaults
(ours: `xlaserve serve` with no flags) unless --ours-args / --llama-args add some.

    python scripts/bench_side_by_side.py [--levels 1:4,16:16,64:64] [--only ours,llama.cpp,hf]
    python scripts/bench_side_by_side.py --dataset multi-turn --levels 16:16 \
        --only ours,ours-nocache,llama.cpp

--dataset multi-turn (a shared system prompt, conversations resending their history) or
few-shot (prompts sharing worked examples), from scripts/bench_conversations.py, measure
prefix caching: `ours-nocache` is our server with --no-enable-prefix-caching. For
multi-turn, NUM_PROMPTS is the number of conversations.

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

import bench_conversations as bc  # noqa: E402
import bench_serving as bs  # noqa: E402

LLAMA_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "xlaserve" / "llama.cpp"


def markers(name: str = "side-by-side") -> tuple[str, str]:
    """The comments around a generated section of docs/benchmarks.md."""
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


BEGIN, END = markers()
SERVERS = ("ours", "ours-nocache", "llama.cpp", "hf")


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


# Per docs section: the issue whose goals the ratios are held to, and its goals per level
# (output tok/s, median TTFT, median TPOT).
RATIO_GOALS = {
    "side-by-side": ("issue 24", {1: ("", "", " [<= 1.0]"), 16: (" [>= 3]", "", ""),
                                  64: (" [>= 4]", "", "")}),
    "side-by-side-multi-turn": ("issue 18", {16: (" [>= 3]", "", "")}),
}


def context_len(args) -> int:
    """Tokens one sequence may need: a whole conversation for multi-turn."""
    if args.dataset == "multi-turn":
        return args.system_len + args.num_turns * (args.user_len + args.output_len + 16) + 32
    if args.dataset == "few-shot":
        return args.num_examples * (args.user_len + args.input_len // 4 + 12) + 64 + \
            args.output_len
    return args.input_len + args.output_len + 16


def server_command(name: str, args, port: int | str, hf_dir: Path) -> list[str]:
    max_len = context_len(args)
    if name in ("ours", "ours-nocache"):
        off = ["--no-enable-prefix-caching"] if name == "ours-nocache" else []
        return [sys.executable, "-m", "serving", "serve", "--port", str(port),
                "--max-num-seqs", str(args.slots), *off, *shlex.split(args.ours_args)]
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
    if args.dataset == "multi-turn":  # a warm-up conversation, then the level's
        asyncio.run(bc.run_conversations(server.base_url, model, [warmup], max_concurrency=1,
                                         quiet=True))
        r = asyncio.run(bc.run_conversations(server.base_url, model, requests,
                                             max_concurrency=conc))
    else:
        asyncio.run(bs.run_benchmark(server.base_url, "/v1/completions", model, [warmup],
                                     max_concurrency=1, num_warmups=0, quiet=True))
        r = asyncio.run(bs.run_benchmark(server.base_url, "/v1/completions", model, requests,
                                         max_concurrency=conc, seed=args.seed, num_warmups=0))
    for key in ("input_lens", "output_lens", "ttfts", "itls"):
        r.pop(key, None)
    return r | {"server": server.name, "sweep_value": conc, "startup_s": ready, "round": rnd}


def run_all_up(names, plan, args, hf_dir: Path, log_dir: Path) -> list[dict]:
    """Every server up at once, started one after another, taking turns level by level."""
    runs = []
    with contextlib.ExitStack() as stack:
        live = {name: start_server(stack, name, args, hf_dir, log_dir) for name in names}
        for rnd, conc, (warmup, *requests) in plan:
            for name in names:
                runs.append(run_level(live[name], conc, warmup, requests, args, rnd))
    return runs


def run_one_at_a_time(names, plan, args, hf_dir: Path, log_dir: Path) -> list[dict]:
    """Per round, each server alone on the machine: started, every level of the round, then
    stopped, so an idle server's threads and memory never share the machine with the one
    measured (docs/benchmarks.md, "Fast defaults", measures what that changes)."""
    runs = []
    for rnd in sorted({p[0] for p in plan}):
        for name in names:
            with contextlib.ExitStack() as stack:
                live = start_server(stack, name, args, hf_dir, log_dir)
                for r, conc, (warmup, *requests) in plan:
                    if r == rnd:
                        runs.append(run_level(live, conc, warmup, requests, args, rnd))
    return runs


METRICS = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "p99_itl_ms")
TURN_METRICS = ("median_ttft_first_turn_ms", "median_ttft_later_turns_ms")  # multi-turn only


def summarize(runs: list[dict]) -> list[dict]:
    """One row per server and level: each metric's median over the rounds, failures summed."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["server"], r["sweep_value"]), []).append(r)
    rows = []
    for rs in groups.values():
        row = {k: v for k, v in rs[0].items() if k != "round"}
        row |= {m: statistics.median(r[m] for r in rs) for m in METRICS + TURN_METRICS
                if m in rs[0]}
        row |= {"failed": sum(r["failed"] for r in rs), "rounds": len(rs)}
        rows.append(row)
    return rows


def paired_ratios(runs: list[dict], conc: int, key: str) -> list[float]:
    """ours / llama.cpp of one metric at one level, one ratio per round: both servers ran that
    level in the same round, so a drift in the machine's speed between rounds cancels out."""
    by = {(r["server"], r["sweep_value"], r["round"]): r for r in runs}
    return [a[key] / b[key] for (s, c, rnd), a in sorted(by.items())
            if s == "ours" and c == conc and (b := by.get(("llama.cpp", c, rnd)))]


def _ms(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _ratio(values: list[float]) -> str:
    """The median of the rounds' ratios, and their range when there are several."""
    text = f"{statistics.median(values):.2f}"
    return text + (f" ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else "")


def render_section(runs: list[dict], meta: dict, name: str = "side-by-side",
                   plot: str = "benchmarks.png") -> str:
    begin, end = markers(name)
    results = summarize(runs)
    by = {(r["server"], r["sweep_value"]): r for r in results}
    levels = sorted({r["sweep_value"] for r in results})
    servers = [s for s in SERVERS if any(r["server"] == s for r in results)]
    rounds = max(r["rounds"] for r in results)
    turns_head = (" TTFT first turns (ms) | TTFT later turns (ms) |"
                  if TURN_METRICS[0] in results[0] else "")
    turns = ("every server up, each level run on every server back to back"
             if meta.get("all_up") else "in each round every server alone on the machine in turn")
    how = (f"{rounds} rounds, {turns}; each figure is the median over the rounds"
           if rounds > 1 else f"one round, {turns}")
    lines = [begin, "", f"Run {meta['date']} on {meta['machine']}; "
             f"commit {meta['commit']}; {meta['workload']}; {how}; load average "
             f"{meta.get('load_end', 0):.1f} at the end.", "",
             "| streams | prompts | server | output tok/s | median TTFT (ms) | median TPOT (ms) "
             "| p99 ITL (ms) | failed |" + turns_head,
             "|---:|---:|---|---:|---:|---:|---:|---:|" + "---:|" * (2 if turns_head else 0)]
    for conc in levels:
        for s in servers:
            if (r := by.get((s, conc))):
                turns = "".join(f" {_ms(r[m])} |" for m in TURN_METRICS if m in r)
                lines.append(f"| {conc} | {r['num_prompts']} | {s} | {r['output_throughput']:.1f} "
                             f"| {_ms(r['median_ttft_ms'])} | {_ms(r['median_tpot_ms'])} "
                             f"| {_ms(r['p99_itl_ms'])} | {r['failed']} |{turns}")
    if "ours" in servers and "llama.cpp" in servers:
        issue, goals = RATIO_GOALS.get(name, ("", {}))
        lines += ["", "Ratios, ours / llama.cpp, the median of the rounds' ratios"
                  + (" (their range)" if rounds > 1 else "")
                  + (f"; {issue}'s goal in brackets:" if issue else ":"),
                  "", "| streams | output tok/s | median TTFT | median TPOT |",
                  "|---:|---:|---:|---:|"]
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
    lines += ["", f"![output tok/s against median TPOT and TTFT]({plot})", "", end]
    return "\n".join(lines)


def update_doc(path: Path, section: str, name: str = "side-by-side") -> None:
    # A new file gets a title and the section; docs/benchmarks.md holds how we measure.
    begin, end = markers(name)
    text = path.read_text() if path.exists() else f"# Benchmarks\n\n{begin}\n{end}\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
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


def make_plan(args, levels, tokenizer) -> list[tuple[int, int, list]]:
    """(round, concurrency, [warm-up, *requests]) per level and round; for multi-turn the
    items are conversations, and each level and round gets a system prompt of its own."""
    total = args.rounds * sum(n + 1 for _, n in levels)
    if args.dataset == "multi-turn":
        items = iter(c for i in range(args.rounds * len(levels))
                     for c in bc.multi_turn_dataset(
                         max(n for _, n in levels) + 1, args.num_turns, args.system_len,
                         args.user_len, args.output_len, args.seed + i, tokenizer))
        return [(rnd, conc, [next(items) for _ in range(n + 1)])
                for rnd in range(args.rounds) for conc, n in levels]
    if args.dataset == "few-shot":
        items = iter(bc.few_shot_dataset(total, args.num_tasks, args.num_examples,
                                         args.input_len // 4, args.user_len, args.output_len,
                                         args.seed, tokenizer))
    else:
        items = iter(bs.random_dataset(total, args.input_len, args.output_len, args.seed,
                                       tokenizer))
    return [(rnd, conc, [next(items) for _ in range(n + 1)])
            for rnd in range(args.rounds) for conc, n in levels]


def workload(args) -> str:
    if args.dataset == "multi-turn":
        return (f"multi-turn chat: a shared system prompt of {args.system_len} tokens, "
                f"{args.num_turns} turns per conversation of {args.user_len}-token user "
                f"messages and {args.output_len} output tokens (ignore_eos, greedy), each turn "
                f"resending the history, /v1/chat/completions, seed {args.seed}")
    if args.dataset == "few-shot":
        return (f"few-shot prompts: {args.num_tasks} preambles of {args.num_examples} examples, "
                f"a {args.user_len}-token question each, {args.output_len} output tokens "
                f"(ignore_eos, greedy), /v1/completions, seed {args.seed}")
    return (f"random prompts of {args.input_len} tokens, {args.output_len} output "
            f"tokens (ignore_eos, greedy), /v1/completions, seed {args.seed}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", default="1:4,16:16,64:64", help="CONCURRENCY:PROMPTS,...")
    p.add_argument("--only", default=",".join(SERVERS), help="servers to run, comma-separated")
    p.add_argument("--input-len", type=int, default=130)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset", default="random", choices=["random", "multi-turn", "few-shot"])
    p.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per conversation")
    p.add_argument("--system-len", type=int, default=1000, help="multi-turn: system prompt tokens")
    p.add_argument("--user-len", type=int, default=30,
                   help="multi-turn: tokens per user message; few-shot: per question")
    p.add_argument("--num-examples", type=int, default=8, help="few-shot: examples per prompt")
    p.add_argument("--num-tasks", type=int, default=4, help="few-shot: distinct preambles")
    p.add_argument("--slots", type=int, default=64, help="max sequences / slots / batch per server")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp and torch threads")
    p.add_argument("--ours-args", default="",
                   help="extra flags for `xlaserve serve` (default: none, so its defaults run: "
                        "for the demo on a CPU int4 weights, an int8 head, a float16 KV cache)")
    p.add_argument("--llama-args", default="", help="extra flags for llama-server")
    p.add_argument("--rounds", type=int, default=3,
                   help="times each level runs on each server, servers taking turns")
    p.add_argument("--all-up", action="store_true",
                   help="keep every server up at once, taking turns level by level (default: "
                        "only the server measured is up, servers taking turns round by round)")
    p.add_argument("--start-timeout", type=float, default=1800.0)
    p.add_argument("--docs", default=str(ROOT / "docs"))
    args = p.parse_args(argv)

    from model.demo import cache_dir, fetch_demo_model
    hf_dir = fetch_demo_model(cache_dir() / "demo" / "SmolLM2-135M-Instruct-hf")
    levels = parse_levels(args.levels)
    # Every round and level gets prompts of its own (and one for its warm-up): a server with a
    # prefix cache (llama-server) would otherwise skip the prefill of prompts seen before.
    plan = make_plan(args, levels, bs.load_tokenizer(str(hf_dir)))
    docs = Path(args.docs)
    docs.mkdir(parents=True, exist_ok=True)
    log_dir = LLAMA_CACHE.parent / "bench-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    names = [s for s in SERVERS if s in args.only.split(",")]
    if "llama.cpp" in names:
        ensure_llama_server()
    meta = {"date": datetime.date.today().isoformat(), "machine": machine(), "commit": commit(),
            "all_up": args.all_up,
            "workload": workload(args),
            "commands": {s: shlex.join(server_command(s, args, "PORT", hf_dir)).replace(
                str(Path.home()), "~").replace(str(ROOT) + "/", "") for s in names}}
    runs = run_all_up(names, plan, args, hf_dir, log_dir) if args.all_up else \
        run_one_at_a_time(names, plan, args, hf_dir, log_dir)
    meta["load_end"] = os.getloadavg()[0]
    # The chat datasets get sections and files of their own next to the random one's.
    name = "side-by-side" + ("" if args.dataset == "random" else f"-{args.dataset}")
    stem = "benchmarks" + ("" if args.dataset == "random" else f"-{args.dataset}")
    json.dump({"meta": meta, "results": runs}, open(docs / f"{stem}.json", "w"), indent=1)
    results = summarize(runs)
    series = {s: sorted((r for r in results if r["server"] == s), key=lambda r: r["sweep_value"])
              for s in names}
    bs.plot_sweep(series, str(docs / f"{stem}.png"), label_key="sweep_value",
                  title=f"demo model, {meta['workload'].split(',')[0]}; labels: streams")
    section = render_section(runs, meta, name, f"{stem}.png")
    update_doc(docs / "benchmarks.md", section, name)
    print("\n" + section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
