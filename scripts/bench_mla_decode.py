"""MLA decode on this device: the latent-attention Pallas kernel checked against its reference
(pallas_kernels/latent_attention_pallas.py), then timed at DeepSeek-V3's per-rank shapes.

Decode MLA is bound by reading the latent: each query token reads context x W x itemsize bytes
of its request's pages per layer (W = R + Dr = 576 for V3, bf16: 1,152 B a token). The table
gives the kernel's time, those bytes per second, their share of the measured copy bandwidth
(a streaming read + write, pallas_kernels/benchmark.py) and the TFLOP/s of the absorbed form
(2 x H x (W + R) per query and key: at H=128 the work nears the GPU's compute bound).

    PYTHONPATH=. python scripts/bench_mla_decode.py                   # GPU: check + V3 sweep
    PYTHONPATH=. JAX_PLATFORMS=cpu python scripts/bench_mla_decode.py --smoke   # interpreter

Each program chains --iters kernel calls in a loop (the next query waits on the last output);
best of --repeats. Rows are printed (and appended to --out) as they finish; --max-seconds
stops before a case that would not fit. --tune then times tile variants of a few cases.
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.benchmark import copy_bandwidth  # noqa: E402
from pallas_kernels.block_sizes import LatentAttentionBlockSizes  # noqa: E402
from pallas_kernels.latent_attention_pallas import (  # noqa: E402
    latent_block_sizes_for, latent_paged_attention, latent_paged_attention_reference)
from pallas_kernels.testing import random_case  # noqa: E402
from scripts.bench_kernels import Table  # noqa: E402  (printed, and appended to --out)

SCALE = 0.135  # V3's softmax scale (notes: (d_n + d_r)^-0.5 x mscale^2)
COLUMNS = ("case", "H", "batch", "ctx", "page", "tiles", "us", "latent GB/s", "% copy",
           "TFLOP/s", "compile s")


@dataclass(frozen=True)
class Shape:
    """`batch` requests decoding one token each over `ctx` cached latent rows."""
    heads: int
    batch: int
    ctx: int
    R: int = 512
    Dr: int = 64
    page_size: int = 64
    cache: str = "bfloat16"

    @property
    def name(self) -> str:
        return f"h{self.heads}-b{self.batch}-c{self.ctx}"

    @property
    def latent_bytes(self) -> int:
        item = jnp.dtype(self.cache).itemsize
        per_row = (self.R + self.Dr) * item + (4 if item == 1 else 0)  # + the row's scale
        return self.batch * self.ctx * per_row

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.ctx * self.heads * (2 * self.R + self.Dr)


def v3_sweep(page_size: int) -> list[Shape]:
    """TP8's 16 heads per rank (memory bound) beside all 128 heads (near the compute bound);
    long contexts and big batches first, so a sweep cut by --max-seconds keeps those."""
    order = [(32, 8192), (128, 8192), (128, 1024), (32, 1024), (1, 8192), (1, 1024)]
    return [Shape(h, b, c, page_size=page_size) for b, c in order for h in (16, 128)]


def smoke_sweep() -> list[Shape]:
    return [Shape(4, b, c, R=32, Dr=8, page_size=4) for b, c in ((4, 64), (1, 16))]


def make_inputs(s: Shape, seed: int = 0):
    """(q [B, H, W], latent [1, pages, page_size, 1, W], positions, req_indices, page_table,
    latent_scale) for `s`, drawn on the device (a GB-sized cache would take long in numpy)."""
    W, P = s.R + s.Dr, -(-s.ctx // s.page_size)
    num_pages = 1 + s.batch * P
    ids = np.random.default_rng(seed).permutation(np.arange(1, num_pages)).astype(np.int32)
    page_table = jnp.asarray(ids[:s.batch * P].reshape(s.batch, P))
    kq, kl, ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(kq, (s.batch, s.heads, W), jnp.float32).astype(jnp.bfloat16)
    cache = jnp.dtype(s.cache)
    shape = (1, num_pages, s.page_size, 1, W)
    scale = None
    if cache.itemsize == 1:
        latent = (jax.random.normal(kl, shape, jnp.float32) * 20).astype(cache)
        scale = jax.random.uniform(ks, shape[:-1], jnp.float32, 0.01, 0.05)
    else:
        latent = jax.random.normal(kl, shape, jnp.float32).astype(cache)
    positions = jnp.full((s.batch,), s.ctx - 1, jnp.int32)
    req_indices = jnp.arange(s.batch, dtype=jnp.int32)
    return q, latent, positions, req_indices, page_table, scale


def timed(fn, q, *rest, iters: int, repeats: int) -> tuple[float, float]:
    """(seconds per call, compile seconds) of fn(q, *rest) -> [T, H, R]: `iters` calls in one
    loop, each query updated in place by one element of the last output (no copy of q, and
    no call can be hoisted out of the loop), best of `repeats` programs."""
    def chain(q, *rest):
        def body(_, q):
            out = fn(q, *rest)
            return q.at[0, 0, 0].add((out[0, 0, 0] * 1e-30).astype(q.dtype))
        return jax.lax.fori_loop(0, iters, body, q)

    start = time.perf_counter()
    run = jax.jit(chain).lower(q, *rest).compile()
    jax.block_until_ready(run(q, *rest))
    compile_s = time.perf_counter() - start
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run(q, *rest))
        best = min(best, time.perf_counter() - start)
    return best / iters, compile_s


def kernel_fn(s: Shape, sizes, interpret: bool):
    def fn(q, latent, positions, req_indices, page_table, scale):
        return latent_paged_attention(q, latent, 0, positions, req_indices, page_table, SCALE,
                                      scale, value_dim=s.R, sizes=sizes, interpret=interpret)
    return fn


def bench(table: Table, s: Shape, bw: float, args, sizes=None) -> float:
    """Times one case and writes its row -> seconds per call."""
    q, latent, *rest = make_inputs(s)
    used = sizes or latent_block_sizes_for(q.shape, rest[2].shape, s.page_size, s.R,
                                           latent.dtype)
    seconds, compile_s = timed(kernel_fn(s, used, args.interpret), q, latent, *rest,
                               iters=args.iters, repeats=args.repeats)
    gbps = s.latent_bytes / seconds / 1e9
    tiles = (f"q{used.block_q}/h{used.block_h}/kv{used.block_kv}/s{used.num_splits}"
             f"/w{used.num_warps}/st{used.num_stages}")
    table.line(f"| {s.name} | {s.heads} | {s.batch} | {s.ctx} | {s.page_size} | {tiles} | "
               f"{seconds * 1e6:.1f} | {gbps:.1f} | {100 * gbps * 1e9 / bw:.0f} | "
               f"{s.flops / seconds / 1e12:.1f} | {compile_s:.1f} |")
    return seconds


# Native checks: (heads, R, Dr, page size, cache, q_lens, ctx_lens, tokens, requests, pages,
# forced tiles or None). Ragged contexts, one padding token, int8 / fp8 rows with scales, a
# prefill chunk beside decodes, one split and several.
V3_CHECKS = [
    (16, 512, 64, 16, "bfloat16", [1] * 4, [1, 100, 555, 1000], 4, 4, 64, None),
    (128, 512, 64, 64, "int8", [1] * 3, [64, 65, 700], 4, 4, 16, None),
    (16, 512, 64, 64, "float8_e4m3fn", [40, 1, 1], [300, 77, 1000], 64, 4, 16, None),
]
# With --tune: a tile of the tuning sweep (32 heads a program, 8 warps, 4 splits) too.
TUNE_CHECK = (128, 512, 64, 16, "bfloat16", [1, 1], [2000, 37], 2, 2, 128,
              LatentAttentionBlockSizes(1, 32, 32, 4, num_warps=8))
SMOKE_CHECKS = [
    (4, 32, 8, 4, "bfloat16", [1] * 3, [1, 13, 40], 4, 4, 16, None),
    (4, 32, 8, 4, "int8", [9, 1], [30, 5], 16, 2, 8, None),
]


def check(table: Table, checks, interpret: bool) -> int:
    """Kernel against the reference; returns the number of mismatches."""
    failures = 0
    for i, (H, R, Dr, ps, cache, q_lens, ctx_lens, T, B, P, sizes) in enumerate(checks):
        case = random_case(np.random.default_rng(i), q_lens=q_lens, ctx_lens=ctx_lens,
                           num_tokens=T, num_reqs=B, pages_per_req=P, num_heads=H,
                           num_kv_heads=1, head_dim=R + Dr, page_size=ps, dtype=jnp.bfloat16,
                           kv_dtype=jnp.dtype(cache))
        positions = case.positions.at[sum(q_lens):].set(-1)
        args = (case.q, case.k_cache, case.layer, positions, case.req_indices,
                case.page_table, SCALE, case.k_scale)
        out = latent_paged_attention(*args, value_dim=R, sizes=sizes, interpret=interpret,
                                     poison=True)
        ref = latent_paged_attention_reference(*args, value_dim=R)
        out, ref = np.asarray(out.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))
        err = np.abs(out - ref)
        ok = bool(np.isfinite(out).all() and (err <= 2e-2 + 2e-2 * np.abs(ref)).all())
        failures += not ok
        table.line(f"# check H={H} R={R} Dr={Dr} page {ps} {cache} q_lens={q_lens} "
                   f"ctx={ctx_lens} tiles={sizes or 'auto'}: max |err| "
                   f"{np.nanmax(err):.2e} -> {'ok' if ok else 'MISMATCH'}")
    return failures


def tune(table: Table, shapes, bw: float, args, started: float) -> None:
    """Tile variants around the default for a few cases (for block_sizes.TUNED's
    "mla_decode"); the fastest per case is printed last."""
    table.line("# tile tuning (decode): candidates for block_sizes.TUNED['<GPU>']['mla_decode']")
    for s in shapes:
        q_shape, pt_shape = (s.batch, s.heads, s.R + s.Dr), (s.batch, -(-s.ctx // s.page_size))
        base = latent_block_sizes_for(q_shape, pt_shape, s.page_size, s.R, s.cache)
        variants = [base] + [replace(base, block_h=h, block_q=1, num_warps=w)
                             for h in (16, 32, 64) for w in (4, 8) if h <= s.heads]
        variants += [replace(base, block_kv=kv) for kv in (16, 64)]
        variants += [replace(base, num_splits=n) for n in (base.num_splits * 2,
                                                          max(1, base.num_splits // 2))]
        best = None
        for sizes in dict.fromkeys(variants):  # in order, without repeats
            if time.perf_counter() - started > args.max_seconds:
                table.line("# stopped tuning: --max-seconds reached")
                break
            try:
                seconds = bench(table, s, bw, args, sizes)
            except Exception as e:  # a tile Triton cannot fit must not end the sweep
                table.line(f"# {s.name} {sizes}: FAILED {type(e).__name__}: {str(e)[:200]}")
                continue
            if best is None or seconds < best[0]:
                best = (seconds, sizes)
        if best:
            table.line(f"# best for {s.name}: {best[1]} ({best[0] * 1e6:.1f} us; default "
                       f"{base})")
        if time.perf_counter() - started > args.max_seconds:
            return


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes (H=4, R=32, Dr=8) in the interpreter: checks it on a CPU")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--no-check", action="store_true", help="skip the comparison")
    p.add_argument("--tune", action="store_true", help="then tile variants, time permitting")
    p.add_argument("--iters", type=int, default=20, help="kernel calls per program")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-seconds", type=float, default=float("inf"))
    p.add_argument("--out", type=Path, help="append the table to this file")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore", DeprecationWarning)  # the Pallas Triton backend's notice
    started = time.perf_counter()
    on_gpu = jax.default_backend() == "gpu"
    args.interpret = not on_gpu
    if args.smoke:
        args.iters, args.repeats = 2, 1
    table = Table(args.out)
    bw = copy_bandwidth()
    table.line(f"# bench_mla_decode on {jax.devices()[0].device_kind} "
               f"({jax.default_backend()}{', interpreter' if args.interpret else ''}), jax "
               f"{jax.__version__}; copy bandwidth {bw / 1e9:.1f} GB/s (read + write)")
    failures = 0
    if not args.no_check:
        checks = SMOKE_CHECKS if args.smoke else V3_CHECKS + [TUNE_CHECK] * args.tune
        failures += check(table, checks, args.interpret)
    shapes = smoke_sweep() if args.smoke else v3_sweep(args.page_size)
    table.line("| " + " | ".join(COLUMNS) + " |")
    table.line("|---|" + "---:|" * (len(COLUMNS) - 2) + "---:|")
    last_s = 0.0
    for s in shapes:
        if time.perf_counter() - started + last_s > args.max_seconds:
            table.line(f"# stopped before {s.name}: --max-seconds {args.max_seconds:.0f}")
            break
        t0 = time.perf_counter()
        try:
            bench(table, s, bw, args)
        except Exception as e:  # one failing case must not hide the others
            failures += 1
            table.line(f"# {s.name}: FAILED {type(e).__name__}: {str(e)[:300]}")
        last_s = time.perf_counter() - t0
    table.line("# us per call (best of --repeats programs of --iters calls); latent GB/s: "
               "batch x ctx x W x itemsize over that time; % copy: of the copy bandwidth")
    if args.tune:
        tune(table, shapes[:1] + [s for s in shapes if s.heads >= 128][:1], bw, args, started)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
