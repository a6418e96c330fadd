"""4-bit weight matmul on CPUs: `x @ W` with W in GGUF's Q4_1 form (codes 0..15, a float16
scale d and offset m per group of 32 values of k and per column: W = d * code + m), by our
C++ kernel (cpu/q4_matmul.cc).

The codes are packed once, at load, two to a byte in panels of 16 columns (`pack_panels`);
a decode step reads 0.625 bytes a weight. Each row of x is rounded to int16 per group of 32
with a scale of its own (int8 activations, llama.cpp's Q8_1, flip the demo model's greedy
answers), and each group's products are summed as integers;
`q4_matmul_reference` is the same product in plain jnp.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_ffi

PANEL = 16  # columns per panel
GROUP = 32  # values of k per scale and offset
XQMAX = 32767  # the activations' int16 range


def pack_panels(codes, d, m):
    """codes uint8[K, N] (0..15), d, m float16[K // 32, N] -> (uint4[K, N] holding the
    kernel's byte order, float16[N // 16, K // 32, 16] twice).

    Byte [p][g][h][j][i] of the codes holds column 16p + j's code of k = 32g + 4h + i in its
    low nibble and of k = 32g + 16 + 4h + i in its high one. A uint4 array keeps the
    [in, out] shape (Flax checks a weight's shape against its declaration) in half the bytes:
    element 2b is byte b's low nibble."""
    K, N = codes.shape
    G, P = K // GROUP, N // PANEL
    c = jnp.asarray(codes, jnp.uint8).reshape(G, 2, 4, 4, P, PANEL)  # g, half, h, i, p, j
    c = c.transpose(4, 0, 2, 5, 3, 1)  # p, g, h, j, i, half
    packed = c.reshape(K, N).astype(jnp.uint4)

    def panels(s):
        return jnp.asarray(s, jnp.float16).reshape(G, P, PANEL).transpose(1, 0, 2)
    return packed, panels(d), panels(m)


def unpack_panels(packed, dp, mp):
    """The inverse of `pack_panels`."""
    K, N = packed.shape
    G, P = K // GROUP, N // PANEL
    c = packed.astype(jnp.uint8).reshape(P, G, 4, PANEL, 4, 2).transpose(1, 5, 2, 4, 0, 3)

    def groups(s):
        return s.transpose(1, 0, 2).reshape(G, N)
    return c.reshape(K, N), groups(dp), groups(mp)


def q4_matmul(x, packed, dp, mp):
    """x: float[..., K] @ the packed weight [K, N] -> [..., N] in x's dtype."""
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
    scale = jnp.where(finite, amax / jnp.float32(XQMAX), jnp.nan)[..., 0]
    return values, scale


def q4_matmul_reference(x, codes, d, m):
    """The kernel's product from unpacked codes uint8[K, N] and d, m float16[K // 32, N], in
    plain jnp, group by group in the kernel's order."""
    K, N = codes.shape
    x2 = x.reshape(-1, K).astype(jnp.float32)
    xq, xs = quantize_groups(x2)
    G = K // GROUP
    sums = jnp.einsum("tgk,gkn->tgn", xq.reshape(-1, G, GROUP).astype(jnp.int32),
                      codes.reshape(G, GROUP, N).astype(jnp.int32),
                      preferred_element_type=jnp.int32)
    qsum = jnp.sum(xq.reshape(-1, G, GROUP).astype(jnp.int32), axis=-1)
    d32, m32 = d.astype(jnp.float32), m.astype(jnp.float32)
    y = jnp.zeros((x2.shape[0], N), jnp.float32)
    for g in range(G):
        y = y + sums[:, g].astype(jnp.float32) * (d32[g] * xs[:, g:g + 1])
        y = y + m32[g] * (xs[:, g:g + 1] * qsum[:, g:g + 1].astype(jnp.float32))
    return y.reshape(*x.shape[:-1], N).astype(x.dtype)
