"""Mamba2's state-space recurrence (SSD) over a packed, ragged step, token by token.

Per head h of a row, with S [head_dim, state_size] the row's state, x_t [head_dim], the
time step dt_t > 0 and the decay A_h < 0 (transformers' mamba2_selective_state_update):
    S <- exp(dt_t A_h) S + dt_t x_t B_t^T;    y_t = S C_t + D_h x_t
B_t and C_t [state_size] are shared by the heads of a group: head h reads group
h // (heads / groups).

Step layout as model/linear_attention/delta_rule.py: row r's tokens are the slots
[query_start[r], query_start[r+1]); slots from query_start[R] on are padding and touch no
state. The scan's body has one shape whatever the step's bucket, so a row's numbers depend
only on its own tokens (batch invariance).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from model.rounding import rounded

_HI = lax.Precision.HIGHEST


def ssd_serial(x, dt, A, B, C, D, state, query_start, req_indices):
    """x: f32[T, H, P]; dt: f32[T, H] (softplus'd, clamped); A: f32[H] (< 0); B, C:
    f32[T, G, N]; D: f32[H]; state: f32[R, H, P, N], each row's state before this step;
    query_start: i32[R+1]; req_indices: i32[T].
    -> (y f32[T, H, P], padding slots 0; new state f32[R, H, P, N])."""
    T, H = dt.shape
    per_group = H // B.shape[1]
    valid = jnp.arange(T) < query_start[-1]

    def step(states, xs):
        x_t, dt_t, b_t, c_t, r, ok = xs
        b_t, c_t = (jnp.repeat(a, per_group, axis=0) for a in (b_t, c_t))  # [H, N]
        # dt A rounded before its exp: XLA:CPU's exp of a fused product moves with the shape
        decayed, update = rounded((states[r] * jnp.exp(rounded(dt_t * A))[:, None, None],
                                   (dt_t[:, None] * x_t)[:, :, None] * b_t[:, None, :]))
        s = decayed + update
        y = sum(rounded((jnp.einsum("hpn,hn->hp", s, c_t, precision=_HI), D[:, None] * x_t)))
        states = states.at[r].set(jnp.where(ok, s, states[r]))
        return states, jnp.where(ok, y, jnp.zeros_like(y))

    state, y = lax.scan(step, state, (x, dt, B, C, req_indices, valid))
    return y, state
