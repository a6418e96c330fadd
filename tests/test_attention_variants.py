"""Attention sinks and soft-capping in every attention backend (docs/architecture.md,
"Kernels and their references").

The reference is checked against a per-token softmax written out in numpy; every other
backend against the reference on engine-shaped steps, with and without a sliding window.
The Pallas kernels run in the interpreter here and are cross-lowered for CUDA.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.block_sizes import AttentionBlockSizes
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention_blocked import ragged_paged_attention_blocked
from pallas_kernels.ragged_paged_attention_cpu import ragged_paged_attention_cpu
from pallas_kernels.ragged_paged_attention_kernel import ragged_paged_attention
from pallas_kernels.ragged_paged_attention_pages import ragged_paged_attention_pages
from pallas_kernels.testing import random_case
from tests.test_kernel_lowering import TRITON_CALL, attention_args, lower_for_cuda
from tests.test_kernels import INTERPRET, NATIVE

pytestmark = pytest.mark.jax_cache  # tests/jax_cache.py

cpu_only = pytest.mark.skipif(NATIVE, reason="a CPU path; the GPU run checks the kernels")

SCALE = 0.3
# (window, soft_cap, sinks): each variant alone, together, and with a window.
VARIANTS = [(0, 2.0, False), (0, 0.0, True), (0, 1.5, True), (9, 2.0, True)]


def _case(seed, *, heads=6, kv_heads=2, head_dim=16, page_size=16, dtype=jnp.float32,
          kv_dtype=None, q_lens=(1, 5, 1), ctx_lens=(40, 23, 17), tokens=8, reqs=4,
          pages=3):
    rng = np.random.default_rng(seed)
    case = random_case(rng, q_lens=list(q_lens), ctx_lens=list(ctx_lens), num_tokens=tokens,
                       num_reqs=reqs, pages_per_req=pages, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
                       dtype=dtype, kv_dtype=kv_dtype)
    # Sinks large enough to take a real share of each row's weight.
    sinks = jnp.asarray(rng.normal(1.0, 2.0, heads), jnp.float32)
    return case, sinks


def _run(fn, case, sinks, window, soft_cap, has_sinks, **kw):
    return fn(*case.args(jnp.int32(window), SCALE), sinks=sinks if has_sinks else None,
              soft_cap=soft_cap, **kw)


def _naive(case, sinks, window, soft_cap):
    """Each real token against its request's keys, one softmax per head, in numpy."""
    q = np.asarray(case.q, np.float32)
    k, v = (np.asarray(a[case.layer], np.float32) for a in (case.k_cache, case.v_cache))
    T, H, D = q.shape
    G = H // k.shape[2]
    out = np.zeros_like(q)
    for t in range(T):
        pos, req = int(case.positions[t]), int(case.req_indices[t])
        keys = np.arange(pos + 1)
        if window:
            keys = keys[keys >= pos - window + 1]
        pages = np.asarray(case.page_table)[req][keys // k.shape[1]]
        kk, vv = k[pages, keys % k.shape[1]], v[pages, keys % k.shape[1]]  # [S, K, D]
        for h in range(H):
            s = kk[:, h // G] @ q[t, h] * SCALE
            if soft_cap:
                s = soft_cap * np.tanh(s / soft_cap)
            m = max(s.max(), float(sinks[h]))
            e = np.exp(s - m)
            out[t, h] = e @ vv[:, h // G] / (e.sum() + np.exp(float(sinks[h]) - m))
    return out


@pytest.mark.parametrize("window", [0, 9])
def test_reference_is_the_written_out_softmax(window):
    case, sinks = _case(1)
    got = _run(ragged_paged_attention_reference, case, sinks, window, 1.5, True)
    want = _naive(case, sinks, window, 1.5)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
    # Both variants move the result well past the tolerance the kernels are held to.
    plain = ragged_paged_attention_reference(*case.args(jnp.int32(window), SCALE))
    assert np.abs(np.asarray(plain) - want).max() > 1e-2
    for soft_cap, has_sinks in ((1.5, False), (0.0, True)):
        one = _run(ragged_paged_attention_reference, case, sinks, window, soft_cap, has_sinks)
        assert np.abs(np.asarray(one) - want).max() > 1e-2


def _matches_reference(fn, case, sinks, tol=1e-4, rows=None, **kw):
    for window, soft_cap, has_sinks in VARIANTS:
        want = np.asarray(_run(ragged_paged_attention_reference, case, sinks, window, soft_cap,
                               has_sinks), np.float32)
        got = np.asarray(_run(fn, case, sinks, window, soft_cap, has_sinks, **kw).astype(
            jnp.float32))
        n = rows or len(got)
        np.testing.assert_allclose(got[:n], want[:n], atol=tol, rtol=tol,
                                   err_msg=f"window={window} cap={soft_cap} sinks={has_sinks}")


@cpu_only
@pytest.mark.parametrize("kv_dtype", [None, jnp.int8])
def test_blocked_matches_reference(kv_dtype):
    # 7 real tokens of 8; the decode form (tokens <= rows) and the looped form (more tokens).
    for reqs in (8, 2):
        q_lens, ctx = ((1, 5, 1), (40, 23, 17)) if reqs == 8 else ((6, 1), (30, 44))
        case, sinks = _case(2, kv_dtype=kv_dtype, reqs=reqs, q_lens=q_lens, ctx_lens=ctx)
        _matches_reference(jax.jit(ragged_paged_attention_blocked, static_argnums=(8,),
                                   static_argnames=("soft_cap",)), case, sinks, rows=7)


@cpu_only
@pytest.mark.parametrize("dtype,kv_dtype", [(jnp.float32, None), (jnp.bfloat16, jnp.bfloat16),
                                            (jnp.float32, jnp.float8_e4m3fn)])
def test_cpu_kernel_matches_reference(dtype, kv_dtype):
    # a decode past several chunks of 32 keys, a prefill chunk, and an odd head dim
    case, sinks = _case(3, dtype=dtype, kv_dtype=kv_dtype, head_dim=20,
                        q_lens=(1, 7), ctx_lens=(90, 60), pages=6, reqs=2)
    fn = jax.jit(ragged_paged_attention_cpu, static_argnums=(8,), static_argnames=("soft_cap",))
    assert "xlaserve_paged_attention" in fn.lower(
        *case.args(jnp.int32(0), SCALE), sinks=sinks, soft_cap=1.0).as_text()
    _matches_reference(fn, case, sinks, tol=1e-4 if dtype == jnp.float32 else 2e-2)


@pytest.mark.parametrize("kernel,sizes", [
    (ragged_paged_attention, AttentionBlockSizes(4, 16, 1)),
    (ragged_paged_attention, AttentionBlockSizes(4, 16, 3)),  # sinks in combine_splits
    (ragged_paged_attention_pages, AttentionBlockSizes(4, 16, 1)),
    (ragged_paged_attention_pages, AttentionBlockSizes(4, 32, 2)),
], ids=["kernel-direct", "kernel-splits", "pages-direct", "pages-splits"])
def test_pallas_kernels_match_reference(kernel, sizes):
    case, sinks = _case(4)
    _matches_reference(kernel, case, sinks, interpret=INTERPRET, sizes=sizes)


@cpu_only
@pytest.mark.parametrize("kernel", [ragged_paged_attention, ragged_paged_attention_pages])
@pytest.mark.parametrize("splits", [1, 4])
def test_variants_lower_for_cuda(kernel, splits):
    args = attention_args(16, 8, 16, 32, 8, 128, jnp.bfloat16, None, 16)

    def fn(q, k, v, layer, pos, req, pt, window, ks, vs, sinks):
        return kernel(q, k, v, layer, pos, req, pt, window, 0.125, ks, vs, sinks=sinks,
                      soft_cap=50.0, sizes=AttentionBlockSizes(2, 32, splits), interpret=False)

    text = lower_for_cuda(fn, *args, jax.ShapeDtypeStruct((32,), jnp.float32)).as_text()
    assert text.count(TRITON_CALL) == 1
