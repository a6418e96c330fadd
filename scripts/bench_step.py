"""Time one compiled forward step of a model over the paged cache, per bucket shape.

Each shape is TOKENSxROWSxPAGES (a step's token bucket, page-table rows and pages per row).
When TOKENS <= ROWS the step is decode: one token for each of TOKENS requests at position
--context. Otherwise it is one request's prefill chunk of TOKENS tokens from position 0. Prints
the best and median of --repeats runs of the same compiled program, with the cache donated as
the engine does. Sampling is not included.

    python scripts/bench_step.py                                   # the demo model, float32
    python scripts/bench_step.py --shapes 1x1x16,64x64x16 --attention-backend reference
    python scripts/bench_step.py --no-attention        # the matmuls and the rest alone
    python scripts/bench_step.py --shapes 64x64x16 --profile   # where a step's time goes
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from model.attention import resolve_backend  # noqa: E402
from model.batch import Batch  # noqa: E402
from model.checkpoint import load_model  # noqa: E402
from model.kv_cache import KVCache  # noqa: E402
from model.runtime_params import prepare_params  # noqa: E402
from model.transformer import forward  # noqa: E402
from serving.engine.sizing import resolve_model_dir  # noqa: E402


def step_batch(T: int, R: int, P: int, page_size: int, num_pages: int, context: int, rng):
    if T <= R:  # decode: token i belongs to request i
        reqs, pos = np.arange(T), np.full(T, min(context, P * page_size) - 1)
        logits_indices = np.arange(R) % T
    else:  # one request's chunk
        reqs, pos = np.zeros(T, int), np.arange(T) % (P * page_size)
        logits_indices = np.full(R, T - 1)
    table = rng.permutation(np.arange(1, num_pages))[:R * P].reshape(R, P)
    slots = table[reqs, pos // page_size] * page_size + pos % page_size
    arrays = (rng.integers(0, 1000, T), pos, slots, reqs, table, logits_indices)
    return Batch(*(jax.numpy.asarray(a, np.int32) for a in arrays))


def profile(program, params, cache, batch, repeats: int):
    """Runs the step `repeats` times under jax.profiler; -> (ms per step by op kind, cache).
    Our kernels are named by their FFI target (q8_matmul by its output width), XLA's ops by
    their fusion kind. The time of a call is the calling thread's: a kernel's pool workers
    run inside it."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(repeats):
                logits, cache = program(params, cache, batch)
                logits.block_until_ready()
        path = glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)[0]
        with gzip.open(path) as f:
            events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    hlo = program.as_text()
    kind = {m[1]: m[2] for m in re.finditer(r"%?([\w.-]+) = [^\n]*custom_call_target="
                                             r"\"(\w+)\"", hlo)}
    for m in re.finditer(r"%?([\w.-]+) = f32\[\d+,(\d+)\][^\n]*custom_call_target="
                         r"\"xlaserve_q8_matmul\"", hlo):
        kind[m[1]] = f"xlaserve_q8_matmul N={m[2]}"
    threads = {(e["pid"], e["tid"]) for e in events if e.get("ph") == "M"
               and e.get("name") == "thread_name" and "XLA" in e["args"]["name"]}
    totals = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and (e["pid"], e["tid"]) in threads \
                and not e["name"].startswith(("ThunkExecutor", "end:")):
            totals[kind.get(e["name"], re.sub(r"[.\d]+$", "", e["name"]))] += e["dur"] / 1e3
    return {k: v / repeats for k, v in totals.most_common()}, cache


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the demo checkpoint)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--quantize", default=None)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--kv-cache-dtype", default=None,
                   help="auto, int8, fp8, or a float dtype such as bfloat16 (default: auto)")
    p.add_argument("--shapes", default="1x1x16,8x8x16,16x16x16,64x64x16,256x64x16")
    p.add_argument("--context", type=int, default=200, help="decode position + 1")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--no-pack", action="store_true",
                   help="leave the weights to XLA's dot (no CPU matmul kernels)")
    p.add_argument("--profile", action="store_true",
                   help="also the step's time by op (kernel or XLA fusion), under jax.profiler")
    p.add_argument("--no-attention", action="store_true",
                   help="attention replaced by the identity: what the rest of a step costs")
    args = p.parse_args()
    if args.no_attention:
        import model.transformer
        model.transformer.paged_attention = lambda q, *args, **kwargs: q
    model_dir = resolve_model_dir(args.model)
    cfg, params = load_model(model_dir, args.dtype, progress=False, quantize=args.quantize)
    params = prepare_params(params, pack=False if args.no_pack else None)
    backend = resolve_backend(args.attention_backend)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    num_pages = 1 + max(R * P for _, R, P in shapes)
    cache = KVCache.zeros(cfg, num_pages, args.page_size, args.kv_cache_dtype)
    step = jax.jit(partial(forward, cfg=cfg, backend=backend), donate_argnums=(1,))
    rng = np.random.default_rng(0)
    print(f"{model_dir.name} {cfg.dtype} quantize={args.quantize} attention={backend}")
    print("| tokens | rows | pages | compile (s) | best (ms) | median (ms) | tokens/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for T, R, P in shapes:
        batch = step_batch(T, R, P, args.page_size, num_pages, args.context, rng)
        started = time.perf_counter()
        program = step.lower(params, cache, batch).compile()
        compile_s = time.perf_counter() - started
        logits, cache = program(params, cache, batch)
        logits.block_until_ready()
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            logits, cache = program(params, cache, batch)
            logits.block_until_ready()
            times.append(time.perf_counter() - started)
        best, median = min(times), float(np.median(times))
        print(f"| {T} | {R} | {P} | {compile_s:.1f} | {best * 1e3:.1f} | {median * 1e3:.1f} | "
              f"{T / best:.0f} |", flush=True)
        if args.profile:
            by_op, cache = profile(program, params, cache, batch, args.repeats)
            shown = {k: v for k, v in by_op.items() if v >= 0.05}
            print(f"  {T}x{R}x{P} by op, ms per step (summed over XLA's threads: "
                  f"{sum(by_op.values()):.1f}): " +
                  ", ".join(f"{k} {v:.1f}" for k, v in shown.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
