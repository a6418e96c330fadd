"""The MLA latent-attention Pallas kernel against its jnp reference, and its CUDA lowering at
DeepSeek-V3's shapes (docs/architecture.md, "Kernels and their references").

On CPU the kernel runs in the Pallas interpreter on small shapes (R=32, Dr=8 and a few heads;
one case at V3's R=512, Dr=64). With XLASERVE_KERNELS_NATIVE=1 the same comparisons run the
compiled kernel on a GPU. Outputs start as NaN buffers aliased into the kernel, so an element
it never writes fails the test in both modes.
"""
from __future__ import annotations

import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.block_sizes import LatentAttentionBlockSizes, latent_attention_block_sizes
from pallas_kernels.latent_attention_pallas import (latent_block_sizes_for,
                                                    latent_paged_attention,
                                                    latent_paged_attention_reference)
from pallas_kernels.testing import random_case
from tests.test_kernel_lowering import DEVICE, lower_for_cuda

pytestmark = pytest.mark.jax_cache  # tests/jax_cache.py

NATIVE = os.environ.get("XLASERVE_KERNELS_NATIVE") == "1"
INTERPRET = not NATIVE
F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
INT8, FP8 = jnp.int8, jnp.float8_e4m3fn
TOL = {F32: 1e-4, BF16: 2e-2, F16: 5e-3}
FAST_COMPILE = {"xla_backend_optimization_level": 0} if INTERPRET else None
SCALE = 0.3


def _cfg(name, heads, R, Dr, page_size, pages, reqs, tokens, dtype, kv=None, sizes=None):
    return pytest.param(dict(heads=heads, R=R, Dr=Dr, page_size=page_size, pages=pages,
                             reqs=reqs, tokens=tokens, dtype=dtype, kv=kv, sizes=sizes),
                        id=name)


# sizes: (block_q, block_h, block_kv, num_splits), or None for block_sizes' own choice.
CONFIGS = [
    _cfg("h4-p4-f32-auto", 4, 32, 8, 4, 8, 3, 8, F32),
    _cfg("h4-p16-bf16-split3", 4, 32, 8, 16, 4, 4, 8, BF16, sizes=(4, 4, 16, 3)),
    _cfg("h6-p4-f32-int8-split2", 6, 32, 8, 4, 8, 3, 8, F32, INT8, sizes=(2, 8, 16, 2)),
    _cfg("h4-p16-bf16-fp8-heads-split", 4, 32, 8, 16, 4, 2, 16, BF16, FP8, sizes=(8, 2, 32, 1)),
    _cfg("h8-p16-f16-int8-prefill-auto", 8, 32, 8, 16, 4, 2, 16, F16, INT8),
    _cfg("h4-p4-f32-no-rope", 4, 32, 0, 4, 8, 2, 8, F32, sizes=(4, 4, 16, 2)),
    _cfg("h4-p16-f32-odd-widths", 4, 24, 12, 16, 4, 3, 8, F32),
    _cfg("h16-v3-width-p16-bf16-auto", 16, 512, 64, 16, 4, 2, 2, BF16),
]


def _case(c, rng, q_lens, ctx_lens, pad_position):
    """A step in the engine's layout; padding tokens at `pad_position` (-1: skipped, 0: the
    engine's own padding at position 0 of the last request row)."""
    case = random_case(rng, q_lens=q_lens, ctx_lens=ctx_lens, num_tokens=c["tokens"],
                       num_reqs=c["reqs"], pages_per_req=c["pages"], num_heads=c["heads"],
                       num_kv_heads=1, head_dim=c["R"] + c["Dr"], page_size=c["page_size"],
                       dtype=c["dtype"], kv_dtype=c["kv"])
    positions = np.asarray(case.positions).copy()
    positions[sum(q_lens):] = pad_position
    return (case.q, case.k_cache, jnp.int32(case.layer), jnp.asarray(positions),
            case.req_indices, case.page_table, SCALE, case.k_scale)


def scenarios(c, rng):
    """(q_lens, ctx_lens, padding position): decodes at page edges, a prompt beside decodes,
    a chunk of a long context, random ragged mixes."""
    ps, T, R = c["page_size"], c["tokens"], c["reqs"]
    max_ctx = c["pages"] * ps
    edges = [n for n in (1, ps - 1, ps, ps + 1, max_ctx, 2 * ps + 1) if 1 <= n <= max_ctx]
    n = min(R, T)
    out = [([1] * n, [edges[i % len(edges)] for i in range(n)], -1)]
    prompt = min(T - (n - 1), max_ctx)
    out.append(([prompt] + [1] * (n - 1), [prompt] + [max_ctx - i for i in range(1, n)], 0))
    if T > 2:
        out.append(([min(T - 1, max_ctx)], [max_ctx], -1))  # one padding token
    for _ in range(2):
        k = int(rng.integers(1, n + 1))
        ctx = [int(x) for x in rng.integers(1, max_ctx + 1, k)]
        budget, q = T, []
        for cl in ctx:
            nq = int(rng.integers(1, min(cl, max(1, budget - (k - len(q) - 1))) + 1))
            q.append(nq)
            budget -= nq
        out.append((q, ctx, -1 if sum(q) < T else 0))
    return out


def _sizes(c):
    return None if c["sizes"] is None else LatentAttentionBlockSizes(*c["sizes"])


def _check(out, ref, dtype, what):
    out = np.asarray(out.astype(jnp.float32))
    ref = np.asarray(ref.astype(jnp.float32))
    assert np.isfinite(out).all(), f"{what}: unwritten (NaN) or non-finite outputs"
    np.testing.assert_allclose(out, ref, atol=TOL[dtype], rtol=TOL[dtype], err_msg=what)


_compiled = {}


def _kernel_fn(c):
    """One compiled program per config, reused by every scenario (same shapes, new data)."""
    key = repr(sorted((k, str(v)) for k, v in c.items()))
    if key not in _compiled:
        def f(q, latent, layer, pos, req, pt, scale, ls):
            return latent_paged_attention(q, latent, layer, pos, req, pt, scale, ls,
                                          value_dim=c["R"], interpret=INTERPRET,
                                          sizes=_sizes(c), poison=True)
        _compiled[key] = jax.jit(f, static_argnums=(6,), compiler_options=FAST_COMPILE)
    return _compiled[key]


@pytest.mark.parametrize("c", CONFIGS)
def test_kernel_matches_reference(c):
    rng = np.random.default_rng(zlib.crc32(repr(sorted((k, str(v)) for k, v in c.items()))
                                           .encode()))
    fn = _kernel_fn(c)
    ref_fn = jax.jit(latent_paged_attention_reference, static_argnums=(6,),
                     static_argnames=("value_dim",))
    for q_lens, ctx_lens, pad in scenarios(c, rng):
        args = _case(c, rng, q_lens, ctx_lens, pad)
        what = f"q_lens={q_lens} ctx={ctx_lens} pad_position={pad}"
        out, ref = fn(*args), ref_fn(*args, value_dim=c["R"])
        assert out.shape == (c["tokens"], c["heads"], c["R"]) and out.dtype == c["dtype"]
        _check(out, ref, c["dtype"], what)
        if pad < 0 and sum(q_lens) < c["tokens"]:
            assert (np.asarray(out[sum(q_lens):].astype(F32)) == 0).all(), what


def test_check_catches_a_wrong_element_and_the_rope_columns():
    """Negative controls: one corrupted element fails the comparison, and the data is such
    that dropping the rope part of the score (or the scale of a quantized row) changes it."""
    c = CONFIGS[2].values[0]
    rng = np.random.default_rng(7)
    args = _case(c, rng, [1, 3, 2], [9, 30, 17], -1)
    ref = latent_paged_attention_reference(*args, value_dim=c["R"])
    out = _kernel_fn(c)(*args)
    _check(out, ref, F32, "control")
    with pytest.raises(AssertionError):
        _check(out.at[2, 3, 5].add(0.01), ref, F32, "one corrupted element")
    q, latent = args[0], args[1]
    no_rope = latent_paged_attention_reference(q.at[..., c["R"]:].set(0), *args[1:],
                                               value_dim=c["R"])
    with pytest.raises(AssertionError):
        _check(no_rope, ref, F32, "rope columns dropped")
    flat = latent_paged_attention_reference(*args[:7], jnp.ones_like(args[7]),
                                            value_dim=c["R"])
    with pytest.raises(AssertionError):
        _check(flat, ref, F32, "row scales dropped")
    assert latent.shape[3:] == (1, c["R"] + c["Dr"])


def test_block_sizes_decode_splits_bounded_by_partials():
    """Decode tiles: 16 rows of heads, KV splits to fill the GPU at small batches, but never
    so many that the float32 partials outweigh half the latent bytes a token reads."""
    kw = dict(value_dim=512, width=576, cache_itemsize=2)
    one = latent_attention_block_sizes(num_tokens=1, num_reqs=1, max_context=8192,
                                       num_heads=16, **kw)
    assert one.block_h * one.block_q == 16 and one.num_splits == 32
    short = latent_attention_block_sizes(num_tokens=1, num_reqs=1, max_context=1024,
                                         num_heads=128, **kw)
    assert short.num_splits == 1  # 128 heads x 512 x 4 B of partials per split > 1k rows
    big = latent_attention_block_sizes(num_tokens=128, num_reqs=128, max_context=8192,
                                       num_heads=16, **kw)
    assert big.num_splits <= 8
    prefill = latent_attention_block_sizes(num_tokens=256, num_reqs=32, max_context=8192,
                                           num_heads=4, **kw)
    assert prefill.num_splits == 1 and prefill.block_q * prefill.block_h == 32


def test_bad_arguments_are_refused():
    q = jnp.zeros((4, 4, 40), F32)
    pt = jnp.zeros((2, 2), jnp.int32)
    idx = jnp.zeros(4, jnp.int32)
    with pytest.raises(ValueError, match="must be \\[L, P, page_size, 1, 40\\]"):
        latent_paged_attention(q, jnp.zeros((1, 4, 4, 2, 40), F32), 0, idx, idx, pt, 0.1,
                               value_dim=32, interpret=True)
    with pytest.raises(ValueError, match="value_dim 41"):
        latent_paged_attention(q, jnp.zeros((1, 4, 4, 1, 40), F32), 0, idx, idx, pt, 0.1,
                               value_dim=41, interpret=True)


# --- CUDA lowering on a CPU host at DeepSeek-V3's per-rank shapes ------------------------------

TRITON_CALL = "__gpu$xla.gpu.triton"
SDS = jax.ShapeDtypeStruct
V3_R, V3_DR = 512, 64


# (heads, page size, tokens, requests, pages per request, cache dtype): decode at batch 1 / 32
# / 128 over 1k-8k contexts (one split and several), a prefill-sized step, quantized caches.
V3_SHAPES = [
    (16, 16, 1, 1, 512, BF16),
    (16, 64, 32, 32, 16, BF16),
    (16, 16, 128, 128, 512, BF16),
    (128, 64, 1, 1, 128, BF16),
    (128, 16, 128, 128, 64, BF16),
    (16, 64, 256, 16, 32, BF16),
    (128, 64, 64, 8, 16, BF16),
    (16, 16, 32, 32, 128, INT8),
    (128, 64, 8, 8, 32, FP8),
]


@pytest.mark.parametrize("heads,page_size,T,R,P,cache_dtype", V3_SHAPES,
                         ids=[f"h{s[0]}-p{s[1]}-t{s[2]}-r{s[3]}-ctx{s[1] * s[4]}-"
                              f"{jnp.dtype(s[5]).name}" for s in V3_SHAPES])
def test_v3_shapes_lower_for_cuda(heads, page_size, T, R, P, cache_dtype):
    W = V3_R + V3_DR
    quantized = cache_dtype not in (BF16,)
    sizes = latent_block_sizes_for((T, heads, W), (R, P), page_size, V3_R, cache_dtype,
                                   device_kind=DEVICE.device_kind)
    args = [SDS((T, heads, W), BF16), SDS((2, 1024, page_size, 1, W), cache_dtype),
            SDS((), jnp.int32), SDS((T,), jnp.int32), SDS((T,), jnp.int32),
            SDS((R, P), jnp.int32)]
    if quantized:
        args.append(SDS((2, 1024, page_size, 1), F32))

    def fn(q, latent, layer, pos, req, pt, ls=None):
        return latent_paged_attention(q, latent, layer, pos, req, pt, 0.135, ls,
                                      value_dim=V3_R, sizes=sizes, interpret=False)

    lowered = lower_for_cuda(fn, *args)
    assert lowered.as_text().count(TRITON_CALL) == 1, sizes
    out = lowered.out_info
    assert out.shape == (T, heads, V3_R) and out.dtype == BF16


def test_v3_decode_tiles_cover_both_paths():
    """The shapes above exercise both the direct write (one split) and flash-decoding."""
    splits = {latent_block_sizes_for((T, h, V3_R + V3_DR), (R, P), ps, V3_R, dt,
                                     device_kind=DEVICE.device_kind).num_splits
              for h, ps, T, R, P, dt in V3_SHAPES}
    assert 1 in splits and max(splits) > 1
