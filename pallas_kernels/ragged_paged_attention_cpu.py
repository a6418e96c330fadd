"""Ragged paged attention as a C++ kernel for CPUs (`pallas_kernels/cpu/paged_attention.cc`),
called through the XLA FFI: attention backend "cpu".

Same contract as `ragged_paged_attention_reference`. A task (up to 4 consecutive tokens of
one request against all KV heads, or one head when there are few tokens) streams the
request's keys straight out of the paged cache, 32 at a time, with an online softmax; K/V rows
are read in the cache's dtype and converted inside the dot products, and each is read once
for the G query heads that share it (and the tile's tokens). Tasks are spread over XLA:CPU's
own intra-op threads. Nothing is gathered or materialised, so a step costs what its tokens'
visible keys cost. At 64 streams the kernel waits mostly on reading those keys, which a 16-bit
cache halves.

Caches of float32, bfloat16 and float16, and int8 / float8_e4m3fn with per-(token, KV head)
scales, run in the kernel; other dtypes, or a machine where
`cpu_ffi.available("paged_attention")` is False, use the blocked XLA form.

One layer of SmolLM2-135M (9 query / 3 KV heads of 64, page size 16, 16-page tables, cache
of 30 layers), jitted alone on 2 CPU cores (scripts/bench_attention_cpu.py), ms per call,
float32 cache for cpu / blocked: 1 decode token 0.056 / 0.12; 16 decode tokens at ~250
context 0.32 / 2.0; 64 decode tokens at ~250 context 2.2 / 11.4; a 256-token chunk of one
request in a 64-row step 2.1 / 7.6. With a float16 cache the kernel takes 0.069 / 0.28 / 0.95
/ 2.1 ms. Runs on this shared machine vary by 20-30%.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_ffi
from pallas_kernels.ragged_paged_attention_blocked import ragged_paged_attention_blocked

TARGET = "xlaserve_paged_attention"
Q_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
KV_DTYPES = Q_DTYPES + (jnp.int8, jnp.float8_e4m3fn)


def supported(q, k_cache) -> bool:
    """Whether the C++ kernel takes these dtypes (and is built for this machine)."""
    return (jnp.dtype(q.dtype) in map(jnp.dtype, Q_DTYPES)
            and jnp.dtype(k_cache.dtype) in map(jnp.dtype, KV_DTYPES)
            and cpu_ffi.available("paged_attention"))


def ragged_paged_attention_cpu(q, k_cache, v_cache, layer, positions, req_indices, page_table,
                               sliding_window, scale: float, k_scale=None, v_scale=None, *,
                               sinks=None, soft_cap: float = 0.0):
    """q: [T, H, D] -> [T, H, D]; arguments as in `ragged_paged_attention_reference`.

    Real tokens match the reference. A token whose position is negative (no visible key) gets
    zeros where the reference gives NaN; out-of-range request rows, page ids and layers are
    clamped into range, as XLA's gathers clamp them.
    """
    if not supported(q, k_cache):
        return ragged_paged_attention_blocked(q, k_cache, v_cache, layer, positions,
                                              req_indices, page_table, sliding_window, scale,
                                              k_scale, v_scale, sinks=sinks, soft_cap=soft_cap)
    if k_scale is None:  # an empty operand: the kernel reads no scales
        k_scale = v_scale = jnp.zeros((0,), jnp.float32)
    sinks = jnp.zeros((0,), jnp.float32) if sinks is None else sinks
    f32 = lambda x: jnp.asarray(x, np.float32)
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype),
                            vmap_method="sequential")
    return call(q, k_cache, v_cache, k_scale.astype(jnp.float32), v_scale.astype(jnp.float32),
                i32(layer), i32(positions), i32(req_indices), i32(page_table),
                i32(sliding_window), f32(scale), f32(sinks), f32(soft_cap))
