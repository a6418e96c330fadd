"""4-bit weight matmul on CPUs: `x @ W` with W in GGUF's Q4_1 form (codes 0..15, a scale d
and offset m per group of 32 values of k and per column: W = d * code + m), by our C++ kernel
(cpu/q4_matmul.cc).

The codes are packed once, at load, two to a byte in panels of 16 columns (`pack_panels`);
a decode step reads 0.625 bytes a weight. d and m are float16, or float32 for formats whose
per-group scales float16 cannot hold (GGUF's Q4_K multiplies a float16 by a 6-bit integer);
a float16 scale gives the same bits either way. Each row of x is rounded to int16 per group
of 32 with a scale of its own (int8 activations, llama.cpp's Q8_1, flip the demo model's
greedy answers), and each group's products are summed as integers; `q4_matmul_reference` is
the same product in plain jnp, to the bit.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_ffi
from pallas_kernels.host_layout import array_module, placed

PANEL = 16  # columns per panel
GROUP = 32  # values of k per scale and offset
XQMAX = 32767  # the activations' int16 range


def scale_dtype(*scales):
    """The dtype the kernels take scales in: float16 when every one of `scales` is float16,
    else float32 (exact for float16 and bfloat16 ones)."""
    f16 = all(np.dtype(s.dtype) == np.float16 for s in scales)
    return jnp.dtype(jnp.float16 if f16 else jnp.float32)


def pack_panels(codes, d, m):
    """codes uint8[K, N] (0..15), d, m float[K // 32, N] -> (uint4[K, N] holding the kernel's
    byte order, [N // 16, K // 32, 16] twice in `scale_dtype(d, m)`).

    Byte [p][g][h][j][i] of the codes holds column 16p + j's code of k = 32g + 4h + i in its
    low nibble and of k = 32g + 16 + 4h + i in its high one. A uint4 array keeps the
    [in, out] shape (Flax checks a weight's shape against its declaration) in half the bytes:
    element 2b is byte b's low nibble."""
    K, N = codes.shape
    G, P = K // GROUP, N // PANEL
    xp = array_module(codes, d, m)  # numpy for weights on one device (host_layout.py)
    c = xp.asarray(codes).astype(np.uint8).reshape(G, 2, 4, 4, P, PANEL)  # g, half, h, i, p, j
    c = c.transpose(4, 0, 2, 5, 3, 1)  # p, g, h, j, i, half
    packed = c.reshape(K, N).astype(jnp.uint4)
    dtype = scale_dtype(d, m)

    def panels(s):
        return placed(xp.asarray(s).astype(dtype).reshape(G, P, PANEL).transpose(1, 0, 2), s)
    return placed(packed, codes), panels(d), panels(m)


def unpack_panels(packed, dp, mp):
    """The inverse of `pack_panels`."""
    K, N = packed.shape
    G, P = K // GROUP, N // PANEL
    c = packed.astype(jnp.uint8).reshape(P, G, 4, PANEL, 4, 2).transpose(1, 5, 2, 4, 0, 3)

    def groups(s):
        return s.transpose(1, 0, 2).reshape(G, N)
    return c.reshape(K, N), groups(dp), groups(mp)


def q4_matmul(x, packed, dp, mp):
    """x: float[..., K] @ the packed weight [K, N] -> [..., N] in x's dtype. dp and mp as
    `pack_panels` makes them (float16 or float32, the same for both)."""
    N = packed.shape[1]
    return cpu_ffi.matmul("q4_matmul", x, N, packed, dp.reshape(-1), mp.reshape(-1))


def quantize_groups(x):
    """float32[T, K] -> (int16 values [T, K], float32 scales [T, K // 32]) as the kernel rounds
    them: x ~ scale * values per group of 32. A group of zeros has scale 0; a row with an inf
    or a NaN, NaN."""
    T, K = x.shape
    g = x.reshape(T, K // GROUP, GROUP)
    finite = jnp.all(jnp.isfinite(x), axis=-1)[:, None, None]
    g = jnp.where(finite, g, 0.0)
    amax = jnp.max(jnp.abs(g), axis=-1, keepdims=True)
    inv = jnp.where(amax > 0, jnp.float32(XQMAX) / amax, 0.0)
    values = jnp.round(g * inv).astype(jnp.int16).reshape(T, K)
    # XLA turns a division by a broadcast scalar into a product with its reciprocal, which
    # rounds differently; behind the barrier the divisor is an array like any other.
    qmax = jax.lax.optimization_barrier(jnp.full(amax.shape, XQMAX, jnp.float32))
    scale = jnp.where(finite, amax / qmax, jnp.nan)[..., 0]
    return values, scale


def fma_chain(a, b):
    """float32 a, b [S, ...] -> float32[...]: y = a[s] * b[s] + y for s = 0, 1, ... from
    y = 0, each step rounded once, as the kernels' FMA instructions round it. jnp has no
    FMA, and XLA contracts a product and a sum into one only in some programs."""
    with jax.enable_x64(True):
        return _fma_chain(a, b)


def _fma64(a, b, c):
    """In float64 the product of two float32s is exact (24 + 24 bits) and TwoSum gives the
    sum's rounding error; the sum rounded to odd there (its last bit set when inexact), then
    to nearest float32, is a * b + c rounded to nearest once (53 >= 24 + 2 bits). Whatever
    XLA contracts here rounds the same: the product needs no rounding."""
    a, b, c = (v.astype(jnp.float64) for v in (a, b, c))
    p = a * b
    s = p + c
    t = s - p
    e = (p - (s - t)) + (c - t)  # s + e == p + c exactly
    even = (jax.lax.bitcast_convert_type(s, jnp.int64) & 1) == 0
    odd = jnp.nextafter(s, jnp.where(e > 0, jnp.inf, -jnp.inf))
    return jnp.where((e != 0) & even & jnp.isfinite(s), odd, s).astype(jnp.float32)


@jax.jit
def _fma_chain(a, b):
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    y0 = jnp.zeros(jnp.broadcast_shapes(a.shape, b.shape)[1:], jnp.float32)
    return jax.lax.scan(lambda y, ab: (_fma64(*ab, y), None), y0, (a, b))[0]


def q4_matmul_reference(x, codes, d, m):
    """The kernel's product from unpacked codes uint8[K, N] and d, m float16 or float32
    [K // 32, N], in plain jnp, group by group in the kernel's order: the same bits."""
    K, N = codes.shape
    dtype = scale_dtype(d, m)
    d32, m32 = (jnp.asarray(s).astype(dtype).astype(jnp.float32) for s in (d, m))
    y = fma_chain(*_reference_terms(x.reshape(-1, K), jnp.asarray(codes), d32, m32))
    return y.reshape(*x.shape[:-1], N).astype(x.dtype)


@jax.jit
def _reference_terms(x, codes, d, m):
    """x [T, K], codes [K, N], float32 d, m [G, N] -> the kernel's a, b [2G, T, N]: per group
    g, y += float(s) * (d * dx), then y += m * (dx * sum(xq))."""
    (T, K), N = x.shape, codes.shape[1]
    G = K // GROUP
    xq, xs = quantize_groups(x.astype(jnp.float32))
    xq = xq.reshape(T, G, GROUP).astype(jnp.int32)
    sums = jnp.einsum("tgk,gkn->gtn", xq, codes.reshape(G, GROUP, N).astype(jnp.int32),
                      preferred_element_type=jnp.int32)
    xsum = xs * jnp.sum(xq, axis=-1).astype(jnp.float32)  # [T, G]
    a = jnp.stack([sums.astype(jnp.float32), jnp.broadcast_to(m[:, None], (G, T, N))], 1)
    b = jnp.stack([d[:, None] * xs.T[..., None],
                   jnp.broadcast_to(xsum.T[..., None], (G, T, N))], 1)
    return a.reshape(2 * G, T, N), b.reshape(2 * G, T, N)
