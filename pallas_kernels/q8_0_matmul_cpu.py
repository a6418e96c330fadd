"""int8 weight matmul on CPUs with a scale per group: `x @ W` with W in GGUF's Q8_0 form
(int8 codes and a scale d per group of 32 values of k and per column: W = d * code) or in
its Q6_K form (the same in groups of 16, codes q - 32), and optionally an offset m per group
and column (W = d * code + m: GGUF's Q5_1 and Q5_K in groups of 32, Q2_K in groups of 16),
by our C++ kernel (cpu/q8_0_matmul.cc).

The codes are packed once, at load, in panels of 16 columns (`pack_panels`), in
q8_matmul's byte order; d and m stay float16 or float32 (float16 gives the same bits either
way). Each row of x is rounded to int16 per group of 32 with a scale of its own, as for the
int4 kernel, whatever the weights' group; each weight group's products are summed as
integers and the weight groups are added in order with one FMA each (in groups of 16, the
two halves of an activation group one after the other), an offset's term, m times dx times
the group's sum of the rounded x, with one more FMA right after its group's, as q4_matmul
adds it; `q8_0_matmul_reference` is the same product in plain jnp, to the bit. The weights'
group follows from the shapes (d has K / g rows); the kernel takes K % 32 == 0, so weights
in groups of 16 with K an odd multiple of 16 stay on the plain-XLA path (quant/packed.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_ffi, q8_matmul_cpu
from pallas_kernels.q4_matmul_cpu import GROUP, fma_chain, quantize_groups, scale_dtype

PANEL = 16  # columns per panel
WEIGHT_GROUPS = (16, 32)  # values of k per weight scale the kernel takes; GROUP per x scale


def fits(K: int, N: int, group: int) -> bool:
    """Whether the kernel takes a weight [K, N] in groups of `group` values of k."""
    return K % GROUP == 0 and N % PANEL == 0 and group in WEIGHT_GROUPS


def weight_group(K: int, scale_rows: int) -> int:
    """The weights' group: K over the rows of d, one of WEIGHT_GROUPS, or a clear error."""
    group = K // scale_rows if scale_rows else 0
    if group not in WEIGHT_GROUPS or group * scale_rows != K:
        raise ValueError(f"q8_0_matmul takes weights in groups of 16 or 32 values of k; "
                         f"got K = {K} with {scale_rows} rows of scales")
    return group


def pack_panels(codes, d, m=None):
    """codes int8[K, N], d (and offsets m, or None) float[K // g, N] (g = 32 or 16) ->
    (int8[K, N] holding the panels, pairs of k side by side: flat[p, k // 2, j, k % 2] =
    codes[k, 16p + j]; d as [N // 16, K // g, 16] in `scale_dtype(d, m)`: float16 stays
    float16, any other float becomes float32), and m packed as d where given.

    The codes keep the [in, out] shape (Flax checks a weight's shape against its
    declaration); only the order of the bytes differs."""
    K, N = jnp.shape(codes)
    if K % GROUP or N % PANEL:
        raise ValueError(f"q8_0_matmul takes K % {GROUP} == 0 and N % {PANEL} == 0, "
                         f"not [{K}, {N}]")
    H = K // weight_group(K, jnp.shape(d)[0])
    packed = q8_matmul_cpu.pack_panels(jnp.asarray(codes, jnp.int8))
    scales = (d,) if m is None else (d, m)
    dtype = scale_dtype(*scales)
    return packed, *(jnp.asarray(s).astype(dtype).reshape(H, N // PANEL, PANEL)
                     .transpose(1, 0, 2) for s in scales)


def unpack_panels(packed, dp, mp=None):
    """The inverse of `pack_panels`: (codes int8[K, N], d [K // g, N]), and m where given."""
    K, N = packed.shape
    return q8_matmul_cpu.unpack_panels(packed), *(s.transpose(1, 0, 2).reshape(-1, N)
                                                  for s in (dp, mp) if s is not None)


def q8_0_matmul(x, packed, dp, mp=None):
    """x: float[..., K] @ the packed weight [K, N] (offsets mp or None) -> [..., N] in x's
    dtype."""
    K, N = packed.shape
    return cpu_ffi.matmul("q8_0_matmul", x, N, packed, dp.reshape(-1), flat_offsets(dp, mp),
                          group=np.int64(weight_group(K, dp.shape[-2])))


def flat_offsets(dp, mp):
    """The kernel's offset operand: mp flat, or no values (of dp's dtype) for none."""
    return jnp.zeros((0,), dp.dtype) if mp is None else mp.reshape(-1)


def q8_0_matmul_reference(x, codes, d, m=None):
    """The kernel's product from unpacked codes int8[K, N], d and offsets m (or None)
    float16 or float32 [K // g, N], in plain jnp, weight group by weight group in the
    kernel's order: the same bits."""
    K, N = codes.shape
    scales = (d,) if m is None else (d, m)
    dtype = scale_dtype(*scales)
    d32, *m32 = (jnp.asarray(s).astype(dtype).astype(jnp.float32) for s in scales)
    y = fma_chain(*_reference_terms(x.reshape(-1, K), jnp.asarray(codes), d32, *m32))
    return y.reshape(*x.shape[:-1], N).astype(x.dtype)


@jax.jit
def _reference_terms(x, codes, d, m=None):
    """x [T, K], codes [K, N], float32 d (and m) [H, N] -> the kernel's a, b [H, T, N]: per
    weight group h, y += float(s) * (d * dx), dx the scale of x's group of 32 holding h;
    with offsets [2H, T, N], each group's followed by y += m * (dx * sum of h's xq)."""
    (T, K), (H, N) = x.shape, d.shape
    group = weight_group(K, H)
    xq, xs = quantize_groups(x.astype(jnp.float32))
    xq = xq.reshape(T, H, group).astype(jnp.int32)
    sums = jnp.einsum("thk,hkn->htn", xq, codes.reshape(H, group, N).astype(jnp.int32),
                      preferred_element_type=jnp.int32)
    dx = jnp.repeat(xs.T, GROUP // group, axis=0)  # [H, T]: each weight group's x scale
    a, b = sums.astype(jnp.float32), d[:, None] * dx[..., None]
    if m is None:
        return a, b
    xsum = dx * jnp.sum(xq, axis=-1).T.astype(jnp.float32)  # [H, T]
    a = jnp.stack([a, jnp.broadcast_to(m[:, None], (H, T, N))], 1)
    b = jnp.stack([b, jnp.broadcast_to(xsum[..., None], (H, T, N))], 1)
    return a.reshape(2 * H, T, N), b.reshape(2 * H, T, N)
