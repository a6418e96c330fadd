"""int8 weight matmul on CPUs with a scale per group: `x @ W` with W in GGUF's Q8_0 form
(int8 codes and a scale d per group of 32 values of k and per column: W = d * code), by our
C++ kernel (cpu/q8_0_matmul.cc).

The codes are packed once, at load, in panels of 16 columns (`pack_panels`), in
q8_matmul's byte order; d stays float16 or float32 (float16 gives the same bits either way).
Each row of x is rounded to int16 per group of 32 with a scale of its own, as for the int4
kernel, each group's products are summed as integers and the groups are added in order
with one FMA each; `q8_0_matmul_reference` is the same product in plain jnp, to the bit.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_ffi, q8_matmul_cpu
from pallas_kernels.q4_matmul_cpu import fma_chain, quantize_groups, scale_dtype

PANEL = 16  # columns per panel
GROUP = 32  # values of k per scale


def pack_panels(codes, d):
    """codes int8[K, N], d float[K // 32, N] -> (int8[K, N] holding the panels, pairs of k
    side by side: flat[p, k // 2, j, k % 2] = codes[k, 16p + j]; d as [N // 16, K // 32, 16]
    in `scale_dtype(d)`: float16 stays float16, any other float becomes float32).

    The codes keep the [in, out] shape (Flax checks a weight's shape against its
    declaration); only the order of the bytes differs."""
    K, N = jnp.shape(codes)
    if K % GROUP or N % PANEL:
        raise ValueError(f"q8_0_matmul takes K % {GROUP} == 0 and N % {PANEL} == 0, "
                         f"not [{K}, {N}]")
    packed = q8_matmul_cpu.pack_panels(jnp.asarray(codes, jnp.int8))
    dp = jnp.asarray(d).astype(scale_dtype(d)).reshape(K // GROUP, N // PANEL, PANEL)
    return packed, dp.transpose(1, 0, 2)


def unpack_panels(packed, dp):
    """The inverse of `pack_panels`: (codes int8[K, N], d [K // 32, N])."""
    K, N = packed.shape
    return q8_matmul_cpu.unpack_panels(packed), dp.transpose(1, 0, 2).reshape(K // GROUP, N)


def q8_0_matmul(x, packed, dp):
    """x: float[..., K] @ the packed weight [K, N] -> [..., N] in x's dtype."""
    N = packed.shape[1]
    return cpu_ffi.matmul("q8_0_matmul", x, N, packed, dp.reshape(-1))


def q8_0_matmul_reference(x, codes, d):
    """The kernel's product from unpacked codes int8[K, N] and d float16 or float32
    [K // 32, N], in plain jnp, group by group in the kernel's order: the same bits."""
    K, N = codes.shape
    d32 = jnp.asarray(d).astype(scale_dtype(d)).astype(jnp.float32)
    y = fma_chain(*_reference_terms(x.reshape(-1, K), jnp.asarray(codes), d32))
    return y.reshape(*x.shape[:-1], N).astype(x.dtype)


@jax.jit
def _reference_terms(x, codes, d):
    """x [T, K], codes [K, N], float32 d [G, N] -> the kernel's a, b [G, T, N]: per group g,
    y += float(s) * (d * dx)."""
    (T, K), N = x.shape, codes.shape[1]
    G = K // GROUP
    xq, xs = quantize_groups(x.astype(jnp.float32))
    sums = jnp.einsum("tgk,gkn->gtn", xq.reshape(T, G, GROUP).astype(jnp.int32),
                      codes.reshape(G, GROUP, N).astype(jnp.int32),
                      preferred_element_type=jnp.int32)
    return sums.astype(jnp.float32), d[:, None] * xs.T[..., None]
