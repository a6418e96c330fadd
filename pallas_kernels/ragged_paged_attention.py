"""Attention of a ragged batch of query tokens over a paged KV cache: the pure-jnp reference.

Each query token belongs to one request (a row of the page table) and attends causally to the
keys at positions 0..its own position of that request, optionally within a sliding window.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def ragged_paged_attention_reference(q, k_cache, v_cache, layer, positions, req_indices,
                                     page_table, sliding_window, scale: float,
                                     k_scale=None, v_scale=None):
    """Attention for every query token, gathering each token's pages.

    Args:
      q: [T, H, D] queries.
      k_cache, v_cache: [L, P, page_size, K, D] paged cache, already holding this step's keys.
      layer: int32 scalar, which layer of the cache to read.
      positions: int32[T] absolute position of each query token in its sequence.
      req_indices: int32[T] row of `page_table` each token belongs to.
      page_table: int32[B, pages_per_req] page ids of each request, in sequence order.
      sliding_window: int32 scalar, 0 for full attention.
      k_scale, v_scale: optional float32[L, P, page_size, K]: the cache holds quantized values
        (int8 / float8_e4m3fn) and each (token, KV head) row means value * scale.
    Returns:
      [T, H, D] in q's dtype.
    """
    T, H, D = q.shape
    K = k_cache.shape[3]
    pages = page_table[req_indices]  # [T, pages_per_req]
    k = k_cache[layer, pages].reshape(T, -1, K, D).astype(jnp.float32)  # [T, S, K, D]
    v = v_cache[layer, pages].reshape(T, -1, K, D).astype(jnp.float32)
    if k_scale is not None:
        k = k * k_scale[layer, pages].reshape(T, -1, K, 1)
        v = v * v_scale[layer, pages].reshape(T, -1, K, 1)
    S = k.shape[1]
    qg = q.reshape(T, K, H // K, D).astype(jnp.float32)
    scores = jnp.einsum("tkgd,tskd->tkgs", qg, k,
                        precision=jax.lax.Precision.HIGHEST) * scale
    key_pos = jnp.arange(S)[None, :]
    visible = key_pos <= positions[:, None]
    window_start = jnp.where(sliding_window > 0, positions[:, None] - sliding_window + 1, 0)
    visible &= key_pos >= window_start
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("tkgs,tskd->tkgd", probs, v,
                     precision=jax.lax.Precision.HIGHEST)
    return out.reshape(T, H, D).astype(q.dtype)
