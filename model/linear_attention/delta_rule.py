"""The gated delta rule (Gated DeltaNet's token mixer) over a packed, ragged step.

Per value head, token by token (transformers' torch_recurrent_gated_delta_rule):
    S <- exp(g_t) S;  u = S^T k_t;  delta = beta_t (v_t - u);  S <- S + k_t delta^T;
    o_t = S^T q_t
with S [dk, dv] the row's state. Two forms with one interface: the token-serial scan, the
readable reference, and the chunked (WY / UT-transform) form of
torch_chunk_gated_delta_rule, which does the work inside each chunk of CHUNK tokens with
matmuls and runs the serial scan over chunks only.

Step layout: row r's tokens are the slots [query_start[r], query_start[r+1]) with
consecutive positions; slots from query_start[R] on are padding (their req_indices say R-1)
and touch no state. A row whose step starts at position 0 comes with a zero state.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.scipy.linalg import solve_triangular

CHUNK = 64  # Gated DeltaNet's chunk, anchored at absolute positions
_HI = lax.Precision.HIGHEST


def gated_delta_rule(q, k, v, g, beta, state, query_start, req_indices, positions, *,
                     chunked: bool):
    """q, k: f32[T, H, dk] (L2-normalised, q already scaled by dk**-0.5, repeated to the H
    value heads); v: f32[T, H, dv]; g: f32[T, H] log decay (<= 0); beta: f32[T, H];
    state: f32[R, H, dk, dv], each row's state before this step; query_start: i32[R+1];
    req_indices: i32[T]; positions: i32[T], each token's position in its request.
    -> (out f32[T, H, dv], padding slots 0; new state f32[R, H, dk, dv]).
    """
    if chunked:
        return _chunked(q, k, v, g, beta, state, query_start, req_indices, positions)
    return _serial(q, k, v, g, beta, state, query_start, req_indices)


def _serial(q, k, v, g, beta, state, query_start, req_indices):
    """A scan over the T slots carrying all R rows' states; a token updates only its row."""
    T = q.shape[0]
    valid = jnp.arange(T) < query_start[-1]

    def step(states, xs):
        q_t, k_t, v_t, g_t, b_t, r, ok = xs                  # [H, d] / [H]
        s = states[r] * jnp.exp(g_t)[:, None, None]          # [H, dk, dv]
        u = jnp.einsum("hkv,hk->hv", s, k_t, precision=_HI)
        delta = b_t[:, None] * (v_t - u)
        s = s + k_t[:, :, None] * delta[:, None, :]
        o = jnp.einsum("hkv,hk->hv", s, q_t, precision=_HI)
        states = states.at[r].set(jnp.where(ok, s, states[r]))
        return states, jnp.where(ok, o, jnp.zeros_like(o))

    state, out = lax.scan(step, state, (q, k, v, g, beta, req_indices, valid))
    return out, state


def _pieces(query_start, req_indices, positions):
    """Cuts each row's tokens at the multiples of CHUNK of their positions.

    A token at position p goes to slot p % CHUNK of its row's piece for grid chunk
    p // CHUNK, so a piece holds exactly the tokens of one grid chunk that are in this step,
    wherever the step starts. How many pieces at most: a row with n >= 1 tokens spans
    1 + (the multiples of CHUNK in its positions p0+1 .. p0+n-1) <= 1 + ceil((n-1)/CHUNK)
    <= 2 + n // CHUNK pieces (two partial ends plus the full chunks between them), so all
    rows together need at most 2R + T // CHUNK, and never more than T (a piece has a token).
    T // CHUNK + R is NOT enough: two rows of 2 tokens at positions 63, 64 need 4 pieces.
    -> (n_pieces, piece i32[T] (n_pieces for padding), slot i32[T], token_at i32[N, CHUNK]
    (T for an empty slot), piece_row i32[N], piece_valid bool[N]).
    """
    T = positions.shape[0]
    R = query_start.shape[0] - 1
    n_pieces = min(T, T // CHUNK + 2 * R)
    count = query_start[1:] - query_start[:-1]
    first = positions[jnp.clip(query_start[:-1], 0, T - 1)] // CHUNK
    last = positions[jnp.clip(query_start[1:] - 1, 0, T - 1)] // CHUNK
    pieces = jnp.where(count > 0, last - first + 1, 0)                    # per row
    offset = jnp.cumsum(pieces) - pieces
    valid = jnp.arange(T) < query_start[R]
    piece = jnp.where(valid, offset[req_indices] + positions // CHUNK - first[req_indices],
                      n_pieces)
    slot = positions % CHUNK
    token_at = jnp.full((n_pieces, CHUNK), T, jnp.int32).at[piece, slot].set(
        jnp.arange(T, dtype=jnp.int32), mode="drop")
    piece_row = jnp.zeros(n_pieces, jnp.int32).at[piece].set(req_indices, mode="drop")
    piece_valid = jnp.arange(n_pieces) < jnp.sum(pieces)
    return n_pieces, piece, slot, token_at, piece_row, piece_valid


def _intra_chunk(q, k, v, g, beta):
    """The work inside each piece, batched over pieces and heads, all [N, H, C, ...].

    The delta rule inside a chunk is (I + L) U = beta V with L[i, j] = beta_i (k_i . k_j)
    exp(G_i - G_j) for j < i (G the cumulative log decay): a unit-lower-triangular system.
    -> (u: the chunk's values corrected for each other, w: the decayed keys whose product
    with the incoming state that correction subtracts, attn: q_i . k_j exp(G_i - G_j) for
    j <= i, q_dec, k_dec: q and k decayed to the chunk's start and end, chunk_decay [N, H]).
    """
    C = q.shape[2]
    cum = jnp.cumsum(g, axis=-1)                                          # [N, H, C]
    causal = jnp.tril(jnp.ones((C, C), bool))
    # The strictly-upper entries (positive exponents) are masked before the exp.
    decay = jnp.exp(jnp.where(causal, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    k_beta = k * beta[..., None]
    system = jnp.einsum("nhid,nhjd->nhij", k_beta, k, precision=_HI) * decay
    rhs = jnp.concatenate([v * beta[..., None], k_beta * jnp.exp(cum)[..., None]], axis=-1)
    # One triangular solve for both right-hand sides; unit_diagonal ignores beta_i |k_i|^2.
    sol = solve_triangular(system, rhs, lower=True, unit_diagonal=True)
    u, w = sol[..., :v.shape[-1]], sol[..., v.shape[-1]:]
    attn = jnp.einsum("nhid,nhjd->nhij", q, k, precision=_HI) * decay
    q_dec = q * jnp.exp(cum)[..., None]
    k_dec = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    return u, w, attn, q_dec, k_dec, jnp.exp(cum[..., -1])


def _chunked(q, k, v, g, beta, state, query_start, req_indices, positions):
    """Gathers the pieces into [N, CHUNK, ...] (empty slots q=k=v=0, g=beta=0: they neither
    decay nor write), does the intra-chunk work batched, scans the pieces in order (each
    reads and writes its own row's state), and gathers the outputs back to the slots. A
    piece's arithmetic depends only on its own tokens and its row's incoming state."""
    T = q.shape[0]
    n_pieces, piece, slot, token_at, piece_row, piece_valid = _pieces(
        query_start, req_indices, positions)

    def gather(x):  # [T, H, ...] -> [N, H, CHUNK, ...], slot T reading zeros
        x = jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)])[token_at]
        return jnp.moveaxis(x, 1, 2)

    u, w, attn, q_dec, k_dec, chunk_decay = _intra_chunk(*map(gather, (q, k, v, g, beta)))

    def step(states, xs):
        u, w, attn, q_dec, k_dec, chunk_decay, r, ok = xs
        s = states[r]                                                     # [H, dk, dv]
        v_new = u - jnp.einsum("hcd,hdv->hcv", w, s, precision=_HI)
        o = (jnp.einsum("hcd,hdv->hcv", q_dec, s, precision=_HI)
             + jnp.einsum("hij,hjv->hiv", attn, v_new, precision=_HI))
        s_new = (s * chunk_decay[:, None, None]
                 + jnp.einsum("hcd,hcv->hdv", k_dec, v_new, precision=_HI))
        states = states.at[r].set(jnp.where(ok, s_new, s))
        return states, o

    state, out = lax.scan(step, state, (u, w, attn, q_dec, k_dec, chunk_decay,
                                        piece_row, piece_valid))
    out = out[jnp.clip(piece, 0, n_pieces - 1), :, slot]                  # [T, H, dv]
    valid = jnp.arange(T) < query_start[-1]
    return jnp.where(valid[:, None, None], out, jnp.zeros_like(out)), state
