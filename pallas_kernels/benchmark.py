"""Timing the attention kernels against memory bandwidth (scripts/bench_kernels.py).

Decode attention is memory bound: its floor is the time to read the K/V pages in use (plus the
queries and the output) at the device's bandwidth, measured here as the throughput of a large
streaming read + write (`copy_bandwidth`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.block_sizes import AttentionBlockSizes
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention_kernel import block_sizes_for, ragged_paged_attention
from pallas_kernels.ragged_paged_attention_pages import (page_block_sizes,
                                                        ragged_paged_attention_pages)
from pallas_kernels.testing import Case, layout


def timed(fn, *args, iters: int = 20, reps: int = 3) -> float:
    """Seconds per call of fn(*args) -> array like args[0]: `iters` calls chained inside one
    program (each call's input depends on the last output, so none is hoisted or skipped),
    best of `reps` runs. Per-call dispatch overhead is thereby excluded."""
    def chain(x, *rest):
        def body(_, carry):
            out = fn(x + carry * jnp.asarray(1e-6, x.dtype), *rest)
            return out.astype(x.dtype)
        return jax.lax.fori_loop(0, iters, body, jnp.zeros_like(x))

    run = jax.jit(chain)
    jax.block_until_ready(run(*args))  # compile + warm up
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(run(*args))
        best = min(best, time.perf_counter() - start)
    return best / iters


def copy_bandwidth(nbytes: int | None = None, iters: int = 10, reps: int = 3) -> float:
    """Bytes/s of a streaming read + write of a large array (x -> x + 1) on the default device."""
    if nbytes is None:
        nbytes = (1 << 30) if jax.default_backend() == "gpu" else (64 << 20)
    run = jax.jit(lambda x: jax.lax.fori_loop(0, iters, lambda _, y: y + 1, x))
    x = jnp.zeros(nbytes // 4, jnp.float32)
    jax.block_until_ready(run(x))
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(run(x))
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes * iters / best


@dataclass(frozen=True)
class Shape:
    """One benchmark problem: requests of q_len new tokens over ctx keys each."""
    name: str
    batch: int
    ctx: int
    q_len: int = 1
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype: str = "bfloat16"
    kv_dtype: str | None = None  # "int8" / "float8_e4m3fn": quantized K/V with scales
    # The attention variants (pallas_kernels/ragged_paged_attention.py): a sliding window of
    # this many keys (0: none), one sink logit per query head, a soft cap (0: none).
    window: int = 0
    sinks: bool = False
    soft_cap: float = 0.0

    @property
    def num_tokens(self) -> int:
        return self.batch * self.q_len


def _next_bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def make_case(s: Shape, seed: int = 0) -> Case:
    """The engine's layout for `s` (tokens and requests padded to power-of-two buckets), with
    the cache drawn on the device (multi-GB caches would take minutes in numpy)."""
    T, R = _next_bucket(s.num_tokens), _next_bucket(s.batch)
    P = _next_bucket(-(-s.ctx // s.page_size))
    num_pages = 1 + s.batch * P
    rng = np.random.default_rng(seed)
    ids = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    page_table = np.zeros((R, P), np.int32)
    page_table[:s.batch] = ids[:s.batch * P].reshape(s.batch, P)
    positions, req_indices = layout([s.q_len] * s.batch, [s.ctx] * s.batch, T, R)
    kq, kk, kv, ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    shape = (1, num_pages, s.page_size, s.kv_heads, s.head_dim)
    dtype = jnp.dtype(s.dtype)
    q = jax.random.normal(kq, (T, s.heads, s.head_dim), jnp.float32).astype(dtype)
    k_scale = v_scale = None
    if s.kv_dtype:
        kvd = jnp.dtype(s.kv_dtype)
        k = (jax.random.normal(kk, shape, jnp.float32) * 20).astype(kvd)
        v = (jax.random.normal(kv, shape, jnp.float32) * 20).astype(kvd)
        k_scale = jax.random.uniform(ks, shape[:-1], jnp.float32, 0.01, 0.05)
        v_scale = k_scale * 0.5
    else:
        k = jax.random.normal(kk, shape, jnp.float32).astype(dtype)
        v = jax.random.normal(kv, shape, jnp.float32).astype(dtype)
    return Case(q, k, v, jnp.asarray(positions), jnp.asarray(req_indices),
                jnp.asarray(page_table), k_scale, v_scale, layer=0)


def bytes_moved(s: Shape) -> int:
    """Bytes attention must move at least: the K/V (and scales) in use, queries, outputs. With
    a window, the keys its queries can see."""
    kv_item = jnp.dtype(s.kv_dtype or s.dtype).itemsize
    per_key = 2 * s.kv_heads * (s.head_dim * kv_item + (4 if s.kv_dtype else 0))
    qo = 2 * s.num_tokens * s.heads * s.head_dim * jnp.dtype(s.dtype).itemsize
    keys = min(s.ctx, s.window + s.q_len - 1) if s.window else s.ctx
    return s.batch * keys * per_key + qo


def attention_fn(s: Shape, backend: str, sizes: AttentionBlockSizes | None = None):
    """(q, case arrays...) -> out, for `timed`."""
    sinks = jnp.linspace(-1.0, 1.0, s.heads, dtype=jnp.float32) if s.sinks else None

    def run(q, k, v, pos, req, pt, ks, vs):
        args = (q, k, v, 0, pos, req, pt, s.window, q.shape[-1] ** -0.5, ks, vs)
        variants = dict(sinks=sinks, soft_cap=s.soft_cap)
        if backend == "reference":
            return ragged_paged_attention_reference(*args, **variants)
        kernel = ragged_paged_attention_pages if backend == "pallas_pages" else \
            ragged_paged_attention
        return kernel(*args, **variants, sizes=sizes, interpret=jax.default_backend() != "gpu")
    return run


def reference_fits(s: Shape, limit_bytes: int) -> bool:
    """The reference gathers every token's whole history in float32: skip it when huge."""
    T, P = _next_bucket(s.num_tokens), _next_bucket(-(-s.ctx // s.page_size))
    return T * P * s.page_size * s.kv_heads * s.head_dim * 4 * 2 <= limit_bytes


def bench_shape(s: Shape, backends, copy_bw: float, sizes=None, ref_limit=1 << 30) -> dict:
    case = make_case(s)
    args = (case.q, case.k_cache, case.v_cache, case.positions, case.req_indices,
            case.page_table, case.k_scale, case.v_scale)
    row = dict(case=s.name, T=_next_bucket(s.num_tokens), batch=s.batch, ctx=s.ctx,
               q_len=s.q_len, G=s.heads // s.kv_heads, D=s.head_dim, page=s.page_size,
               kv=s.kv_dtype or s.dtype)
    nbytes = bytes_moved(s)
    for backend in backends:
        if backend == "reference" and not reference_fits(s, ref_limit):
            row[f"{backend}_ms"] = None
            continue
        seconds = timed(attention_fn(s, backend, sizes), *args)
        row[f"{backend}_ms"] = seconds * 1e3
        row[f"{backend}_GBps"] = nbytes / seconds / 1e9
        row[f"{backend}_pct_copy"] = 100 * nbytes / seconds / copy_bw
    for backend, choose, column in (("pallas", block_sizes_for, "tiles"),
                                    ("pallas_pages", page_block_sizes, "page_tiles")):
        if backend in backends:
            used = sizes or choose(case.q.shape, s.kv_heads, case.page_table.shape,
                                   s.page_size)
            row[column] = (f"q{used.block_q}/kv{used.block_kv}/s{used.num_splits}"
                           f"/w{used.num_warps}/st{used.num_stages}")
    return row


def tuning_variants(base: AttentionBlockSizes) -> list[AttentionBlockSizes]:
    """A small neighbourhood of the default decode tiles (for TUNED in block_sizes.py)."""
    out = [base]
    for block_kv in (32, 64, 128):
        for warps, stages in ((4, 2), (4, 3), (8, 2)):
            v = replace(base, block_kv=block_kv, num_warps=warps, num_stages=stages)
            if v not in out:
                out.append(v)
    for splits in (max(1, base.num_splits // 2), base.num_splits * 2):
        v = replace(base, num_splits=splits)
        if v not in out:
            out.append(v)
    return out
