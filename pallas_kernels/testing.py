"""Random ragged paged-attention problems, laid out as the engine lays out a step
(for the kernel tests and scripts/bench_kernels.py)."""
from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np


@dataclass
class Case:
    q: jnp.ndarray  # [T, H, D]
    k_cache: jnp.ndarray  # [L, num_pages, page_size, K, D]
    v_cache: jnp.ndarray
    positions: jnp.ndarray  # int32[T]
    req_indices: jnp.ndarray  # int32[T]
    page_table: jnp.ndarray  # int32[R, P]
    k_scale: jnp.ndarray | None = None  # float32[L, num_pages, page_size, K]
    v_scale: jnp.ndarray | None = None
    layer: int = 0

    def args(self, window: int, scale: float):
        return (self.q, self.k_cache, self.v_cache, self.layer, self.positions,
                self.req_indices, self.page_table, window, scale, self.k_scale, self.v_scale)


def layout(q_lens, ctx_lens, num_tokens: int, num_reqs: int):
    """Engine layout: request r's q_lens[r] newest tokens of its ctx_lens[r]; padding tokens
    last at position 0 of request R-1. -> (positions, req_indices) int32[T]."""
    assert len(q_lens) <= num_reqs and sum(q_lens) <= num_tokens
    pos, req = [], []
    for r, (nq, c) in enumerate(zip(q_lens, ctx_lens)):
        assert 1 <= nq <= c, (nq, c)
        pos += range(c - nq, c)
        req += [r] * nq
    pad = num_tokens - len(pos)
    return (np.asarray(pos + [0] * pad, np.int32),
            np.asarray(req + [num_reqs - 1] * pad, np.int32))


def random_case(rng: np.random.Generator, *, q_lens, ctx_lens, num_tokens: int, num_reqs: int,
                pages_per_req: int, num_heads: int, num_kv_heads: int, head_dim: int,
                page_size: int, dtype=jnp.float32, kv_dtype=None, num_layers: int = 2,
                extra_pages: int = 0, layer: int | None = None) -> Case:
    """A step of len(q_lens) real requests in a bucket (num_tokens, num_reqs, pages_per_req).
    Pages are shuffled; page 0 is the sink (unused request rows point at it, as in the engine).
    kv_dtype int8 / float8_e4m3fn: quantized K/V with per-(token, head) float32 scales."""
    assert max(ctx_lens) <= pages_per_req * page_size
    num_pages = 1 + num_reqs * pages_per_req + extra_pages
    shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
    page_table = np.zeros((num_reqs, pages_per_req), np.int32)
    ids = rng.permutation(np.arange(1, num_pages))
    for r, c in enumerate(ctx_lens):
        used = -(-c // page_size)
        page_table[r, :used] = ids[r * pages_per_req: r * pages_per_req + used]
    positions, req_indices = layout(q_lens, ctx_lens, num_tokens, num_reqs)
    q = rng.standard_normal((num_tokens, num_heads, head_dim), np.float32)
    k_scale = v_scale = None
    kv_dtype = jnp.dtype(kv_dtype or dtype)
    if kv_dtype == jnp.int8:
        k, v = (rng.integers(-127, 128, shape).astype(np.int8) for _ in range(2))
        k_scale, v_scale = (rng.uniform(0.002, 0.02, shape[:-1]).astype(np.float32)
                            for _ in range(2))
    elif kv_dtype == jnp.float8_e4m3fn:
        k, v = (jnp.asarray(np.clip(rng.standard_normal(shape, np.float32) * 100, -440, 440),
                            kv_dtype) for _ in range(2))
        k_scale, v_scale = (rng.uniform(0.002, 0.02, shape[:-1]).astype(np.float32)
                            for _ in range(2))
    else:
        k, v = (rng.standard_normal(shape, np.float32) for _ in range(2))
    as_j = lambda x: None if x is None else jnp.asarray(x)
    return Case(jnp.asarray(q, dtype), jnp.asarray(k, kv_dtype), jnp.asarray(v, kv_dtype),
                jnp.asarray(positions), jnp.asarray(req_indices), jnp.asarray(page_table),
                as_j(k_scale), as_j(v_scale),
                layer=num_layers - 1 if layer is None else layer)
