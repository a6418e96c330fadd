"""Attention of a ragged batch of query tokens over a paged KV cache: the pure-jnp reference.

Each query token belongs to one request (a row of the page table) and attends causally to the
keys at positions 0..its own position of that request, optionally within a sliding window.
Two variants of the scores every backend takes as keyword arguments:
- soft_cap (Gemma 2): scores become cap * tanh(scores / cap), after the scale and before the
  mask; 0 leaves them as they are.
- sinks (gpt-oss): one learned logit per query head that joins the softmax's denominator
  only, as a key whose value is zero; None for none.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def ragged_paged_attention_reference(q, k_cache, v_cache, layer, positions, req_indices,
                                     page_table, sliding_window, scale: float,
                                     k_scale=None, v_scale=None, *, sinks=None,
                                     soft_cap: float = 0.0):
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
      sinks: optional float32[H], each query head's sink logit.
      soft_cap: static float, 0 for none.
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
    scores = cap_scores(scores, soft_cap)
    key_pos = jnp.arange(S)[None, :]
    visible = key_pos <= positions[:, None]
    window_start = jnp.where(sliding_window > 0, positions[:, None] - sliding_window + 1, 0)
    visible &= key_pos >= window_start
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    probs = softmax_with_sinks(scores, sinks, (1, K, H // K, 1))
    out = jnp.einsum("tkgs,tskd->tkgd", probs, v,
                     precision=jax.lax.Precision.HIGHEST)
    return out.reshape(T, H, D).astype(q.dtype)


def cap_scores(scores, soft_cap: float):
    """Soft-capping: cap * tanh(scores / cap); soft_cap 0 changes nothing."""
    return scores if not soft_cap else soft_cap * jnp.tanh(scores / soft_cap)


def softmax_with_sinks(scores, sinks, sink_shape):
    """Softmax over the last axis, with each head's sink logit (sinks float32[H] reshaped to
    sink_shape, broadcasting against scores) in the denominator; sinks None: plain softmax."""
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1)
    sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(sink_shape),
                            scores.shape[:-1] + (1,))
    return jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
