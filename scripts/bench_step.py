"""Time one compiled forward step of a model over the paged cache, per bucket shape.

Each shape is TOKENSxROWSxPAGES (a step's token bucket, page-table rows and pages per row).
When TOKENS <= ROWS the step is decode: one token for each of TOKENS requests at position
--context. Otherwise it is one request's prefill chunk of TOKENS tokens from position 0. Prints
the best and median of --repeats runs of the same compiled program, with the cache donated as
the engine does. Sampling is not included.

    python scripts/bench_step.py                                   # the demo model, float32
    python scripts/bench_step.py --shapes 1x1x16,64x64x16 --attention-backend reference
    python scripts/bench_step.py --no-attention        # the matmuls and the rest alone
"""
from __future__ import annotations

import argparse
import sys
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
from serving.sizing import resolve_model_dir  # noqa: E402


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
    p.add_argument("--no-attention", action="store_true",
                   help="attention replaced by the identity: what the rest of a step costs")
    args = p.parse_args()
    if args.no_attention:
        import model.transformer
        model.transformer.paged_attention = lambda q, *args, **kwargs: q
    model_dir = resolve_model_dir(args.model)
    cfg, params = load_model(model_dir, args.dtype, progress=False, quantize=args.quantize)
    params = prepare_params(params)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
