"""Mamba2's recurrence over packed, ragged steps (model/linear_attention/ssd.py): each row's
outputs and new state against a float64 loop of the recurrence, padding slots touching
nothing, and a row's bits the same whichever rows share its step and however long the
step is (a step of one token is the case XLA:CPU compiles differently)."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from model.linear_attention.ssd import ssd_serial

pytestmark = pytest.mark.jax_cache  # tests/jax_cache.py

H, P, N, G = 6, 16, 16, 2
_ssd = jax.jit(ssd_serial)


def _inputs(rng, T, R):
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    return dict(x=f(T, H, P), dt=np.abs(f(T, H)) + np.float32(0.01),
                A=-np.exp(f(H)), B=f(T, G, N), C=f(T, G, N), D=f(H),
                state=f(R, H, P, N))


def _oracle(x, dt, A, B, C, D, state, query_start):
    """The recurrence token by token in float64, row by row."""
    state = state.astype(np.float64).copy()
    y = np.zeros(x.shape)
    heads_group = np.arange(H) // (H // G)
    for r in range(len(query_start) - 1):
        for t in range(query_start[r], query_start[r + 1]):
            b, c = B[t][heads_group], C[t][heads_group]  # [H, N]
            state[r] = (state[r] * np.exp(dt[t] * A)[:, None, None]
                        + (dt[t][:, None] * x[t])[:, :, None] * b[:, None, :])
            y[t] = np.einsum("hpn,hn->hp", state[r], c) + D[:, None] * x[t]
    return y, state


def test_matches_the_recurrence():
    """Rows of 3, 0, 1 and 7 tokens, then 5 padding slots claimed by the last row."""
    rng = np.random.default_rng(0)
    counts = [3, 0, 1, 7]
    query_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    T = int(query_start[-1]) + 5
    req = np.concatenate([np.repeat(np.arange(4), counts), [3] * 5]).astype(np.int32)
    a = _inputs(rng, T, 4)
    y, state = _ssd(**a, query_start=query_start, req_indices=req)
    want_y, want_state = _oracle(**a, query_start=query_start)
    np.testing.assert_allclose(np.asarray(y), want_y, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(state), want_state, rtol=1e-4, atol=1e-5)
    assert not np.asarray(y)[query_start[-1]:].any()  # padding slots give zeros
    assert (np.asarray(state)[1] == a["state"][1]).all()  # a row without tokens keeps its state


def test_a_row_alone_equals_the_row_batched():
    """One decode token alone, then beside other rows in steps of 2 and 8 slots."""
    rng = np.random.default_rng(1)
    for _ in range(10):
        a = _inputs(rng, 8, 4)
        runs = []
        for T, R in ((1, 1), (2, 2), (8, 4)):
            query_start = np.minimum(np.arange(R + 1), T).astype(np.int32)
            req = np.minimum(np.arange(T), R - 1).astype(np.int32)
            sliced = {k: v if k in ("A", "D") else v[:R] if k == "state" else v[:T]
                      for k, v in a.items()}
            y, state = _ssd(**sliced, query_start=query_start, req_indices=req)
            runs.append((np.asarray(y)[0], np.asarray(state)[0]))
        for y, state in runs[1:]:
            assert (y == runs[0][0]).all() and (state == runs[0][1]).all()
