"""The short depthwise causal convolution in front of a linear-attention mixer, over a
packed, ragged step, with a carried state per request row.

Step layout: row r's tokens are the slots [query_start[r], query_start[r+1]) in position
order; slots from query_start[R] on are padding (their req_indices say R-1, so
query_start[R], not req_indices, tells them apart).

Weight convention: `weight` is [K, C] and tap j multiplies the input K-1-j tokens back, so
weight[K-1] is the current token's tap and weight[0] the oldest. transformers keeps
conv1d.weight as [C, 1, K] in the same tap order (F.conv1d is a cross-correlation over the
input padded by K-1 on the left), so the loader stores `conv1d.weight[:, 0, :].T`.

The state is each row's last K-1 inputs before the step, oldest first: column s of
conv_state[r] is the input K-1-s tokens back. transformers' cache keeps K columns of
which the first is never read; we keep only the K-1 that matter. K >= 2.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_conv(x, weight, bias, conv_state, query_start, req_indices):
    """SiLU(depthwise causal conv) of each row's tokens, continuing from its carried state.

    x: [T, C] in the model dtype; weight: [K, C] (see the module's convention); bias: [C]
    or None; conv_state: [R, K-1, C], each row's last K-1 inputs before this step, oldest
    first; query_start: i32[R+1]; req_indices: i32[T].
    -> (y [T, C] in x's dtype, padding slots 0; new conv_state [R, K-1, C] in
    conv_state's dtype: each row's last K-1 inputs of (old state ++ this step's tokens), so a
    row with fewer than K-1 new tokens shifts its old window and a row with none keeps it).

    Numerics as transformers' causal_conv1d_fn / causal_conv1d_update: the inputs are cast to
    the weight's dtype, the taps summed (in float32 at least, as torch's conv accumulates)
    with the bias, the sum rounded to the weight's dtype, SiLU, then cast to x's dtype.
    """
    T, C = x.shape
    K = weight.shape[0]
    R = conv_state.shape[0]
    wdt = weight.dtype
    acc_dt = jnp.promote_types(wdt, jnp.float32)
    rows = jnp.arange(R)

    # Index of each tap's input in the row's (state ++ step tokens) sequence, where the
    # step's first token sits at K-1: token i's tap j reads index local(i) + j.
    start = query_start[req_indices]                                      # [T]
    idx = (jnp.arange(T) - start)[:, None] + jnp.arange(K)[None, :]       # [T, K]
    from_x = x[jnp.clip(start[:, None] + idx - (K - 1), 0, T - 1)]        # [T, K, C]
    from_state = conv_state[req_indices[:, None], jnp.clip(idx, 0, K - 2)]
    window = jnp.where((idx < K - 1)[..., None], from_state.astype(wdt), from_x.astype(wdt))

    window = window.astype(acc_dt)
    w = weight.astype(acc_dt)
    acc = (jnp.zeros((T, C), acc_dt) if bias is None
           else jnp.broadcast_to(bias.astype(wdt).astype(acc_dt), (T, C)))
    for j in range(K):  # a fixed order: oldest tap first
        acc = acc + window[:, j] * w[j]
    y = jax.nn.silu(acc.astype(wdt)).astype(x.dtype)
    y = jnp.where((jnp.arange(T) < query_start[R])[:, None], y, jnp.zeros_like(y))

    # The new window: the last K-1 of the row's K-1 + n inputs, i.e. indices n .. n+K-2.
    n = query_start[1:] - query_start[:-1]                                # [R]
    idx = n[:, None] + jnp.arange(K - 1)[None, :]                         # [R, K-1]
    old = conv_state[rows[:, None], jnp.clip(idx, 0, K - 2)]
    new = x[jnp.clip(query_start[:-1, None] + idx - (K - 1), 0, T - 1)]
    new_state = jnp.where((idx < K - 1)[..., None], old, new.astype(conv_state.dtype))
    return y, new_state
