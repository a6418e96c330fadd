"""Times one layer's paged attention per backend (reference, blocked, cpu) on engine-shaped
steps of SmolLM2-135M (9 query / 3 KV heads of 64, page size 16, 16-page tables, float32
cache), each backend jitted alone.

    PYTHONPATH=. JAX_PLATFORMS=cpu python scripts/bench_attention_cpu.py
    PYTHONPATH=. JAX_PLATFORMS=cpu python scripts/bench_attention_cpu.py --backends blocked,cpu \
        --repeats 7 --dtype bfloat16

Prints ms per call: the median over --repeats rounds of --runs calls (the spread, min-max,
in brackets), since a shared CPU makes single rounds noisy.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from model.attention import BACKENDS, paged_attention  # noqa: E402
from pallas_kernels.testing import random_case  # noqa: E402

# name: (tokens, page-table rows, q_lens, ctx_lens); decode contexts are ~250 of the 256 the
# 16-page tables hold.
SHAPES = {
    "decode-1": (1, 1, [1], [250]),
    "decode-16": (16, 16, [1] * 16, None),
    "decode-64": (64, 64, [1] * 64, None),
    "prefill-256in64": (256, 64, [256], [256]),
}


def make_case(shape: str, args, rng):
    T, R, q_lens, ctx = SHAPES[shape]
    if ctx is None:
        ctx = [int(x) for x in rng.integers(240, 257, len(q_lens))]
    return random_case(rng, q_lens=q_lens, ctx_lens=ctx, num_tokens=T, num_reqs=R,
                       pages_per_req=args.pages, num_heads=args.heads,
                       num_kv_heads=args.kv_heads, head_dim=args.head_dim, page_size=16,
                       dtype=jnp.dtype(args.dtype), kv_dtype=args.kv_dtype,
                       num_layers=args.layers)


def time_backend(backend: str, case, args) -> list[float]:
    """ms per call for each round."""
    scale = args.head_dim ** -0.5

    @jax.jit
    def step(q, k, v, k_scale, v_scale, layer, positions, req_indices, page_table):
        cache = SimpleNamespace(k=k, v=v)
        if k_scale is not None:
            cache.k_scale, cache.v_scale = k_scale, v_scale
        batch = SimpleNamespace(positions=positions, req_indices=req_indices,
                                page_table=page_table)
        return paged_attention(q, cache, layer, batch, jnp.int32(args.window), scale,
                               backend=backend)

    operands = (case.q, case.k_cache, case.v_cache, case.k_scale, case.v_scale,
                jnp.int32(case.layer), case.positions, case.req_indices, case.page_table)
    step(*operands).block_until_ready()
    rounds = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for _ in range(args.runs):
            out = step(*operands)
        out.block_until_ready()
        rounds.append((time.perf_counter() - t0) / args.runs * 1e3)
    return rounds


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="reference,blocked,cpu")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--runs", type=int, default=50, help="calls per timed round")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds")
    p.add_argument("--dtype", default="float32", help="q and K/V dtype")
    p.add_argument("--kv-dtype", default=None, help="int8 or float8_e4m3fn: a quantized cache")
    p.add_argument("--window", type=int, default=0, help="sliding window, 0 for none")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--pages", type=int, default=16, help="pages per page-table row")
    p.add_argument("--layers", type=int, default=30, help="layers in the cache array")
    args = p.parse_args()
    backends = args.backends.split(",")
    for b in backends:
        if b not in BACKENDS:
            p.error(f"unknown backend {b!r}; choose from {', '.join(BACKENDS)}")
    print(f"# {jax.devices()[0].device_kind}, dtype {args.dtype}, kv {args.kv_dtype or args.dtype}"
          f", {args.heads}/{args.kv_heads} heads of {args.head_dim}, window {args.window}; "
          f"ms per call, median of {args.repeats} x {args.runs} [min-max]")
    print(f"{'shape':<18}" + "".join(f"{b:>24}" for b in backends))
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        case = make_case(shape, args, rng)
        cells = []
        for b in backends:
            r = time_backend(b, case, args)
            cells.append(f"{statistics.median(r):.3f} [{min(r):.3f}-{max(r):.3f}]")
        print(f"{shape:<18}" + "".join(f"{c:>24}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
