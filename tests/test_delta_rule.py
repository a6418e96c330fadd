"""The Gated DeltaNet mixer's math over packed, ragged steps (model/linear_attention/)
against transformers' torch functions (Qwen3-Next), called per row with batch 1.

Padding slots carry random inputs and req_indices R-1, a real row: its output and state
must still match the oracle. The chunked form cuts rows at absolute multiples of 64, so a
prefill split at such a multiple must give the same bits as one step.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import (
    causal_conv1d_fn, causal_conv1d_update, torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule)

from model.linear_attention.delta_rule import CHUNK, gated_delta_rule
from model.linear_attention.short_conv import causal_conv

pytestmark = pytest.mark.jax_cache  # tests/jax_cache.py

H, DK, DV = 4, 16, 16
SCALE = DK ** -0.5  # a power of two: our pre-scaled q is bit-for-bit the oracle's
# (tokens, first position) per row. Row 0 has none, rows 1 and 4 start at 0 (zero state),
# the others mid-grid with a random state; row 6 spans three grid chunks; the last row is
# the one padding slots claim, and it crosses a multiple of 64 with 5 tokens.
ROWS = [(0, 10), (1, 0), (5, 7), (63, 30), (64, 0), (65, 100), (150, 20), (5, 62)]
T_STEP = 384  # 353 tokens, 31 padding slots

_rule = jax.jit(gated_delta_rule, static_argnames="chunked")
_conv = jax.jit(causal_conv)


def _layout(rows, T):
    """-> query_start i32[R+1], req_indices i32[T] (padding: R-1), positions i32[T]."""
    R = len(rows)
    qs = np.zeros(R + 1, np.int32)
    req = np.full(T, R - 1, np.int32)
    pos = np.zeros(T, np.int32)
    for r, (n, p0) in enumerate(rows):
        qs[r + 1] = qs[r] + n
        req[qs[r]:qs[r + 1]] = r
        pos[qs[r]:qs[r + 1]] = np.arange(p0, p0 + n)
    assert qs[R] <= T
    return qs, req, pos


def _normed(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def _inputs(rng, rows, T):
    """Random step inputs (q unscaled, as the oracle takes it) and incoming states."""
    R = len(rows)
    q = _normed(rng.normal(size=(T, H, DK))).astype(np.float32)
    k = _normed(rng.normal(size=(T, H, DK))).astype(np.float32)
    v = rng.normal(size=(T, H, DV)).astype(np.float32)
    g = (-0.5 * np.log1p(np.exp(rng.normal(size=(T, H))))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.normal(size=(T, H))))).astype(np.float32)
    state = (0.5 * rng.normal(size=(R, H, DK, DV))).astype(np.float32)
    state[[r for r, (_, p0) in enumerate(rows) if p0 == 0]] = 0
    return q, k, v, g, beta, state


def _ours(inputs, layout, chunked):
    q, k, v, g, beta, state = inputs
    out, new = _rule(q * np.float32(SCALE), k, v, g, beta, state, *layout, chunked=chunked)
    return np.asarray(out), np.asarray(new)


def _oracle(inputs, rows, qs, fn):
    """Each row alone through transformers' function: outputs [qs[R], H, DV], states."""
    q, k, v, g, beta, state = (torch.from_numpy(np.asarray(x)) for x in inputs)
    outs, states = [], state.clone()
    for r, (n, _) in enumerate(rows):
        if n == 0:
            continue
        s = slice(qs[r], qs[r + 1])
        o, st = fn(q[None, s], k[None, s], v[None, s], g[None, s], beta[None, s],
                   initial_state=state[r:r + 1], output_final_state=True,
                   use_qk_l2norm_in_kernel=False)
        outs.append(o[0])
        states[r] = st[0]
    return torch.cat(outs).numpy(), states.numpy()


@functools.cache
def _packed_case():
    layout = _layout(ROWS, T_STEP)
    inputs = _inputs(np.random.default_rng(0), ROWS, T_STEP)
    oracles = {name: _oracle(inputs, ROWS, layout[0], fn) for name, fn in
               (("recurrent", torch_recurrent_gated_delta_rule),
                ("chunk", torch_chunk_gated_delta_rule))}
    return layout, inputs, oracles


@pytest.mark.parametrize("chunked", [False, True], ids=["serial", "chunked"])
def test_packed_step_matches_oracle(chunked):
    (qs, req, pos), inputs, oracles = _packed_case()
    out, state = _ours(inputs, (qs, req, pos), chunked)
    n = qs[-1]
    assert not out[n:].any(), "padding slots must produce zeros"
    np.testing.assert_array_equal(state[0], inputs[-1][0])  # a row without tokens keeps its state
    for name, (o_out, o_state) in oracles.items():
        np.testing.assert_allclose(out[:n], o_out, atol=1e-5, rtol=1e-5, err_msg=name)
        # The last row is the one padding slots name: its state is its own tokens' only.
        np.testing.assert_allclose(state, o_state, atol=1e-5, rtol=1e-5, err_msg=name)


def test_serial_and_chunked_agree():
    layout, inputs, _ = _packed_case()
    serial, chunked = _ours(inputs, layout, False), _ours(inputs, layout, True)
    for a, b in zip(serial, chunked):
        np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5)


def test_most_pieces():
    """Every row straddles a multiple of 64 with two tokens: 2R pieces in T = 2R slots
    (more than T // 64 + R)."""
    rows = [(2, 63), (2, 127), (2, 191), (2, 63 + 640)]
    layout = _layout(rows, 8)
    inputs = _inputs(np.random.default_rng(1), rows, 8)
    o_out, o_state = _oracle(inputs, rows, layout[0], torch_recurrent_gated_delta_rule)
    out, state = _ours(inputs, layout, True)
    np.testing.assert_allclose(out, o_out, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(state, o_state, atol=1e-5, rtol=1e-5)


def _split_run(inputs, split, chunked):
    """Row of 150 tokens from position 0, in one step or two (split > 0), each step packed
    with another row and padding so the bucket shapes differ. -> (out [150, H, DV], state)."""
    full = 150
    rng = np.random.default_rng(7)
    steps = ([(0, full)] if not split else [(0, split), (split, full)])
    outs, state = [], np.zeros((H, DK, DV), np.float32)
    for i, (a, b) in enumerate(steps):
        other = (3 + i, 5)
        rows = [other, (b - a, a)] if i % 2 == 0 else [(b - a, a), other, (0, 0)]
        me = 1 if i % 2 == 0 else 0
        T = (b - a) + other[0] + 16 * (i + 1)
        layout = _layout(rows, T)
        x = [rng.normal(size=(T,) + y.shape[1:]).astype(np.float32) for y in inputs[:5]]
        x[3], x[4] = -np.abs(x[3]), np.abs(x[4]) % 1  # a valid g, beta for the other row
        lo = layout[0][me]
        for y, src in zip(x, inputs[:5]):
            y[lo:lo + b - a] = src[a:b]
        st = np.zeros((len(rows), H, DK, DV), np.float32)
        st[me] = state
        out, new = _ours((*x, st), layout, chunked)
        outs.append(out[lo:lo + b - a])
        state = new[me]
    return np.concatenate(outs), state


@pytest.mark.parametrize("chunked", [False, True], ids=["serial", "chunked"])
def test_prefill_split(chunked):
    rows = [(150, 0)]
    inputs = _inputs(np.random.default_rng(3), rows, 150)
    one = _split_run(inputs, 0, chunked)
    o_out, o_state = _oracle(inputs, rows, np.array([0, 150]), torch_chunk_gated_delta_rule)
    np.testing.assert_allclose(one[0], o_out, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(one[1], o_state[0], atol=1e-5, rtol=1e-5)
    for split in (64, 128):  # at the grid: the same pieces, the same bits
        two = _split_run(inputs, split, chunked)
        for a, b in zip(one, two):
            np.testing.assert_array_equal(a, b, err_msg=f"split at {split}")
    two = _split_run(inputs, 100, chunked)  # mid-chunk: the same math, other roundings
    for a, b in zip(one, two):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


# --- the short convolution -------------------------------------------------------------

K, C = 4, 12
# (tokens, starts at position 0): row 0 none, rows 1 and 2 fewer than K-1 on a carried
# state (the window shifts), rows 3 and 5 from position 0, row 6 (padding's) carried.
CONV_ROWS = [(0, False), (1, False), (2, False), (5, True), (20, False), (3, True), (6, False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_conv_matches_oracle(dtype):
    rng = np.random.default_rng(5)
    R, T = len(CONV_ROWS), 48
    qs, req, _ = _layout([(n, 0) for n, _ in CONV_ROWS], T)
    x = torch.from_numpy(rng.normal(size=(T, C)).astype(np.float32)).to(dtype)
    w_hf = torch.from_numpy(rng.normal(size=(C, K)).astype(np.float32))  # conv1d.weight[:, 0]
    bias = torch.from_numpy(rng.normal(size=C).astype(np.float32))
    state = torch.from_numpy(rng.normal(size=(R, K - 1, C)).astype(np.float32)).to(dtype)
    for r, (_, zero) in enumerate(CONV_ROWS):
        if zero:
            state[r] = 0

    jdt = jnp.bfloat16 if dtype == torch.bfloat16 else jnp.float32
    y, new = _conv(jnp.asarray(x.float().numpy(), jdt), jnp.asarray(w_hf.T.numpy()),
                   jnp.asarray(bias.numpy()), jnp.asarray(state.float().numpy(), jdt), qs, req)
    y, new = np.asarray(y.astype(jnp.float32)), np.asarray(new.astype(jnp.float32))

    want_state = state.float().clone()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    for r, (n, zero) in enumerate(CONV_ROWS):
        if n == 0:
            continue
        xr = x[qs[r]:qs[r + 1]].T[None]  # [1, C, n]
        if zero:
            want = causal_conv1d_fn(xr, w_hf, bias, activation="silu")
            want_state[r] = torch.cat([torch.zeros(1, C, K - 1, dtype=dtype), xr],
                                      -1)[0, :, -(K - 1):].T.float()
        else:  # transformers' cache keeps K columns: a random first one is never read
            hf_state = torch.cat([torch.randn(1, C, 1).to(dtype), state[r].T[None]], -1)
            want = causal_conv1d_update(xr, hf_state, w_hf, bias, activation="silu")
            want_state[r] = hf_state[0, :, 1:].T.float()
        assert want.dtype == dtype
        np.testing.assert_allclose(y[qs[r]:qs[r + 1]], want[0].T.float().numpy(), **tol,
                                   err_msg=f"row {r}")
    assert not y[qs[-1]:].any(), "padding slots must produce zeros"
    np.testing.assert_array_equal(new, want_state.numpy())
